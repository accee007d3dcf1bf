"""Cross-host handoff: one-sided put of a request's blocks into a decode worker's pool.

The decode worker registers its whole pool with a kthena_comm ``mooncake`` engine and sends the
``MemoryHandle`` in every ``PoolRef``; the prefill worker, after computing into its own pool,
turns (own block ids -> decode block ids) into byte ranges with ``KVLayout.pair_ranges``
(consecutive runs on both sides coalesce) and submits them as one asynchronous batch.

The model runs all layers in one call, so the put is batched *after* the prefill, not
layer by layer (``KVLayout.layer_ranges`` is ready for a model with a per-layer hook).
"""

from __future__ import annotations

from collections.abc import Sequence

from kthena_comm.transfer import MemoryHandle, MooncakeConfig, TransferBatch, create_engine
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool

__all__ = ["BlockPutter", "register_pool"]


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
