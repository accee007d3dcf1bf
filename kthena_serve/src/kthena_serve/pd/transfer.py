"""One-sided KV block moves between PD workers' pools over a kthena_comm transfer engine.

Put (``BlockPutter``, the PD router's path across hosts): the decode worker registers its
whole pool with a kthena_comm ``mooncake`` engine and sends the ``MemoryHandle`` in every
``PoolRef``; the prefill worker, after computing into its own pool, turns (own block ids ->
decode block ids) into byte ranges with ``KVLayout.pair_ranges`` (consecutive runs on both
sides coalesce) and submits them as one asynchronous batch.

The model runs all layers in one call, so the put is batched *after* the prefill, not
layer by layer (``KVLayout.layer_ranges`` is ready for a model with a per-layer hook).

Get (behind the Kthena router, ``BlockGetter``): the prefill worker serves its own pool — in a
``shm`` segment other processes on the host can map (``shm_segment_pool``), or registered with
Mooncake — and the decode worker copies the prompt blocks it lacks into its reservation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kthena_comm.transfer import (
    MemoryHandle,
    MooncakeConfig,
    ShmConfig,
    TransferBatch,
    TransferEngine,
    create_engine,
)
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool

__all__ = ["BlockGetter", "BlockPutter", "register_pool", "shm_engine", "shm_segment_pool"]


def register_pool(pool: KVPool, host: str, timeout_s: float):  # noqa: ANN201
    """A mooncake engine with ``pool`` registered; returns (engine, handle)."""
    engine = create_engine("mooncake", MooncakeConfig(host=host, timeout_s=timeout_s))
    return engine, engine.register(pool.buffer)


class BlockPutter:
    """Puts blocks of a local pool into a remote pool over Mooncake (batched, async + wait)."""

    def __init__(self, pool: KVPool, host: str, timeout_s: float) -> None:
        self.layout = pool.layout
        self.engine, self.local = register_pool(pool, host, timeout_s)
        self.timeout_s = timeout_s

    def put(self, remote_json: str, dst_layout: KVLayout, src_ids: Sequence[int],
            dst_ids: Sequence[int]) -> int:
        """Copy ``src_ids[i]`` -> remote ``dst_ids[i]``; returns the bytes moved.

        Raises:
            kthena_comm.transfer errors (PeerUnreachableError, TransferTimeoutError ...).
        """
        if not src_ids:
            return 0
        remote = MemoryHandle.from_json(remote_json)
        pairs = self.layout.pair_ranges(list(src_ids), list(dst_ids), dst_layout)
        batch = TransferBatch(self.local, remote, [p.src_offset for p in pairs],
                              [p.dst_offset for p in pairs], [p.length for p in pairs])
        future = self.engine.batch_put_async(batch)
        self.engine.wait([future], timeout_s=self.timeout_s)
        return batch.nbytes

    def close(self) -> None:
        self.engine.close()


def shm_engine(timeout_s: float) -> TransferEngine:
    """A kthena_comm ``shm`` engine (same-host one-sided transfer)."""
    return create_engine("shm", ShmConfig(timeout_s=timeout_s))


def shm_segment_pool(engine, layout: KVLayout) -> tuple[KVPool, MemoryHandle]:  # noqa: ANN001
    """A pool in a shared segment ``engine`` (shm) allocates: peers on the host can get from it.

    The segment is the engine's: it goes when the engine closes, or, if the process is
    killed, when the engine's janitor notices (close the pool first).
    """
    handle = engine.allocate(layout.total_bytes)
    buffer = torch.frombuffer(engine.buffer(handle), dtype=torch.uint8)
    return KVPool(layout, buffer, None, is_owner=True), handle


class BlockGetter:
    """Gets blocks of a remote pool into a local registered pool (one batch, async + wait).

    Args:
        engine: the transfer engine ``local`` is registered with (shm or mooncake).
        local: the handle of this worker's pool.
        layout: this worker's pool layout.
        timeout_s: the most one get may take.
    """

    def __init__(self, engine: TransferEngine, local: MemoryHandle, layout: KVLayout,
                 timeout_s: float) -> None:
        self.engine, self.local, self.layout, self.timeout_s = engine, local, layout, timeout_s

    def get(self, remote: MemoryHandle, remote_layout: KVLayout, src_ids: Sequence[int],
            dst_ids: Sequence[int]) -> int:
        """Copy remote ``src_ids[i]`` -> local ``dst_ids[i]``; returns the bytes moved.

        Raises:
            mooncake_kv.layout errors: ids out of range or repeated, layouts of another shape.
            kthena_comm.transfer errors (PeerUnreachableError, TransferTimeoutError ...).
        """
        if not src_ids:
            return 0
        pairs = remote_layout.pair_ranges(list(src_ids), list(dst_ids), self.layout)
        batch = TransferBatch(self.local, remote, [p.dst_offset for p in pairs],
                              [p.src_offset for p in pairs], [p.length for p in pairs])
        future = self.engine.batch_get_async(batch)
        self.engine.wait([future], timeout_s=self.timeout_s)
        return batch.nbytes
