"""The Kthena connector's pull where either worker is a TP engine: copied on one host (shm,
``RankPull``) or got over Mooncake (``RankGet``).

A TP worker's KV is split over its ranks' /dev/shm pools (``pd/reshard.py``), so the one-sided
get of ``transfer.BlockGetter`` (one pool into one pool, byte for byte) cannot serve it.
Instead the prefill worker's lease answers its TP size and every rank's pool name (a tp=1
worker: its own pool's shm segment), and the decode worker maps those pools and copies each
pinned block's heads into its own ranks' pools with the head rule::

    lease    ◀── {"tp": 2, "rank_shm_names": [rank 0's, rank 1's], "fingerprint": rank 0's,
                  "num_blocks": .., "first_token_id": ..}
    copy     for each move of kthena_core.kv_head_moves(kv heads, prefill tp, decode tp)
                 own rank d's heads [dst_start, +count) of the reserved blocks
                     = prefill rank p's heads [src_start, +count) of the pinned blocks
    release  only once the copy has returned

    prefill TP2 -> decode TP2   rank 0 -> rank 0, rank 1 -> rank 1 (whole heads)
    prefill TP1 -> decode TP2   3 heads: heads 0-1 -> rank 0, head 2 -> rank 1
    prefill TP2 -> decode TP1   rank 0's 2 heads and rank 1's 1 head merged into one pool

The copy runs in the decode worker's own process (on a worker thread) and is synchronous:
once it returns every store is done, so the pin may go and the blocks be read; a request
cancelled meanwhile frees its blocks only after the copy ends (``DecodeConnector.pull``).

Over ``--pd-transport mooncake`` (``RankGet``) the lease names each prefill rank's pool as
registered with the prefill worker's Mooncake engine (``rank_mooncake_handles``, rank order; a
tp=1 worker: its own pool's handle), and the decode worker, whose rank pools are registered
with its own engine, gets the same head moves as one-sided batch gets::

    lease    ◀── {"tp": 2, "rank_mooncake_handles": [rank 0's, rank 1's], ...}
    get      for each move: own rank d's pool ◀──get── prefill rank p's pool (moved heads)
    release  only once every get has completed or failed; one past its deadline: the blocks
             stay quarantined until it has ended (``busy``) and nothing of it can still land
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kthena_comm.errors import TransferTimeoutError
from kthena_comm.transfer import MemoryHandle, TransferBatch, TransferEngine, TransferFuture
from kthena_core.shape import kv_head_moves
from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.kv_params import MAX_TP_SIZE
from kthena_serve.pd.protocol import PoolRef
from kthena_serve.pd.reshard import DecodeRankPools, RankPools, copy_resharded, rank_layouts

if TYPE_CHECKING:
    from kthena_serve.engine.model_runner import Runner
    from mooncake_kv.layout import KVLayout

__all__ = ["RankGet", "RankPull", "own_rank_pools"]


def own_rank_pools(runner: Runner) -> RankPools:
    """A worker's own rank pools as its process sees them: rank 0's is the runner's own, a
    TP runner's spawned ranks' are mapped (``ParallelModelRunner.rank_pools``)."""
    from kthena_serve.engine.parallel_runner import ParallelModelRunner

    if not isinstance(runner, ParallelModelRunner):
        return RankPools([runner.pool])
    ranks = runner.rank_pools()[1:]
    mapped = RankPools.attach([name for name, _ in ranks], [layout for _, layout in ranks])
    return RankPools([runner.pool, *mapped.pools], owned=mapped.pools)


class RankPull:
    """Copies pinned blocks from a prefill instance's rank pools into this decode worker's
    rank pools, head by head (see the module docs).

    Args:
        own: this decode worker's rank pools, rank 0's first (closed by ``close``).
        model_config: the model's ``ModelConfig`` (its heads and KV geometry).
        config: this worker's engine config: a prefill worker of the same deployment has the
            same block size and KV dtypes (its lease's fingerprint says so).
    """

    def __init__(self, own: RankPools, model_config, config: EngineConfig) -> None:  # noqa: ANN001
        self.own, self.model_config, self.config = own, model_config, config
        self.sources = DecodeRankPools(model_config, config)  # any instance's pools, by names
        heads = model_config.shape.num_kv_heads
        self._num_heads = 1 if model_config.mla is not None else heads  # MLA: one latent

    @property
    def tp(self) -> int:
        """This decode worker's TP size."""
        return self.own.tp

    def source(self, data: Mapping[str, Any]) -> PoolRef:
        """The prefill instance a lease answer names (``tp``, ``rank_shm_names``,
        ``num_blocks``, ``fingerprint`` and ``kind`` of its rank 0 pool), checked against this
        worker's geometry.

        Raises:
            ValueError: no pool names for its ranks (it serves over another transport), a TP
                size the model's heads cannot take, or another model, dtype or block size.
        """
        tp, names = _lease_tp(data), data.get("rank_shm_names")
        if not isinstance(names, list) or len(names) != tp or not all(
                isinstance(name, str) and name for name in names):
            raise ValueError(f"this TP{self.tp} decode worker copies the prompt's heads from "
                             "the prefill worker's /dev/shm pools, and its lease does not name "
                             f"one for each of its {tp} rank(s): it does not serve over "
                             "--pd-transport shm; start every worker with the same "
                             "--pd-transport")
        ref = PoolRef(int(data["num_blocks"]), self.config.block_size, self.config.dtype,
                      kv_cache_dtype=self.config.kv_cache_dtype, tp=tp, rank_shm_names=names)
        _check_geometry(self.model_config, self.config, ref, data)
        return ref

    def copy(self, source: PoolRef, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
        """Copy ``source``'s blocks ``src_ids[i]`` into this worker's ``dst_ids[i]``, every
        head into the rank that owns it; returns the bytes copied. Synchronous: nothing of it
        lands after it returns.

        Raises:
            mooncake_kv.pool.PoolNotFoundError: a prefill rank's pool is gone (it stopped).
            mooncake_kv.pool.PoolMismatchError: a pool's size is not its layout's.
            IndexError: a block id outside either pool.
        """
        moves = kv_head_moves(self._num_heads, source.tp, self.own.tp)
        pools = self.sources.acquire(source)
        try:
            return copy_resharded(pools, self.own, moves, src_ids, dst_ids)
        finally:
            self.sources.release(source)

    def busy(self) -> bool:
        """Always False: a copy has ended when ``copy`` returns (or raises)."""
        return False

    def close(self) -> None:
        """Unmap every pool mapped here (the prefill ranks' and this worker's spawned ranks')."""
        self.sources.close()
        self.own.close()


class RankGet:
    """Gets pinned blocks from a prefill instance's rank pools, registered with its Mooncake
    engine, into this decode worker's rank pools, head by head (``--pd-transport mooncake``,
    either worker a TP engine): per move of ``kv_head_moves``, one one-sided batch get of the
    moved heads of each block, layer and part (``KVLayout.head_pair_ranges``; a move of every
    head is whole blocks, coalesced) from prefill rank p's pool into own rank d's.

    Every get is submitted before any is waited for, and ``copy`` returns or raises only once
    each has completed or failed or the deadline (``timeout_s`` from the first) has passed.
    A get past its deadline may still write (a Mooncake batch not yet ended): ``busy`` says
    so until it ends, and ``copy`` raises ``TransferTimeoutError``, so the decode worker
    keeps the blocks quarantined as for a tp=1 get (``transfer.BlockGetter``).

    Args:
        engine: this worker's Mooncake engine, every own rank pool registered with it.
        own: this worker's rank pools' handles in that engine, rank 0's first.
        layouts: their layouts, in the same order.
        model_config: the model's ``ModelConfig`` (its heads and KV geometry).
        config: this worker's engine config (a prefill worker of the deployment has the same
            block size and KV dtypes: its lease's fingerprint says so).
        timeout_s: the most one ``copy`` waits for its gets.
    """

    def __init__(self, engine: TransferEngine, own: Sequence[MemoryHandle],
                 layouts: Sequence[KVLayout], model_config, config: EngineConfig,  # noqa: ANN001
                 timeout_s: float) -> None:
        if len(own) != len(layouts):
            raise ValueError(f"{len(own)} rank pool handles for {len(layouts)} layouts")
        self.engine, self.own, self.layouts = engine, list(own), list(layouts)
        self.model_config, self.config, self.timeout_s = model_config, config, timeout_s
        heads = model_config.shape.num_kv_heads
        self._num_heads = 1 if model_config.mla is not None else heads  # MLA: one latent
        self._outlived: list[TransferFuture] = []  # gets `copy` stopped waiting for
        self._lock = threading.Lock()

    @property
    def tp(self) -> int:
        """This decode worker's TP size."""
        return len(self.own)

    def source(self, data: Mapping[str, Any]) -> PoolRef:
        """The prefill instance a lease answer names (``tp``, ``rank_mooncake_handles``,
        ``num_blocks``, ``fingerprint`` and ``kind`` of its rank 0 pool), checked against this
        worker's geometry.

        Raises:
            ValueError: no Mooncake handle for each of its ranks (it serves over another
                transport), a TP size the model's heads cannot take, or another model, dtype
                or block size.
        """
        tp, handles = _lease_tp(data), data.get("rank_mooncake_handles")
        if not isinstance(handles, list) or len(handles) != tp or not all(
                isinstance(handle, dict) for handle in handles):
            raise ValueError(f"this TP{self.tp} decode worker gets the prompt's heads from "
                             "the prefill worker's rank pools registered with Mooncake, and "
                             f"its lease does not name one for each of its {tp} rank(s): it "
                             "does not serve over --pd-transport mooncake; start every worker "
                             "with the same --pd-transport")
        parsed = [MemoryHandle.from_dict(handle) for handle in handles]
        for handle in parsed:
            if handle.backend != self.engine.backend:
                raise ValueError(f"it serves KV over {handle.backend}, this worker pulls over "
                                 f"{self.engine.backend}: use one --pd-transport")
        ref = PoolRef(int(data["num_blocks"]), self.config.block_size, self.config.dtype,
                      kv_cache_dtype=self.config.kv_cache_dtype, tp=tp,
                      rank_mooncake_handles=[handle.to_json() for handle in parsed])
        _check_geometry(self.model_config, self.config, ref, data)
        return ref

    def busy(self) -> bool:
        """Whether a get that ``copy`` stopped waiting for still runs in the engine: it may
        still write this worker's pools."""
        with self._lock:
            self._outlived = [future for future in self._outlived if not future.done()]
            return bool(self._outlived)

    def copy(self, source: PoolRef, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
        """Get ``source``'s blocks ``src_ids[i]`` into this worker's ``dst_ids[i]``, every head
        into the rank that owns it; returns the bytes moved.

        Raises:
            TransferTimeoutError: a get was not done by the deadline (it may still write;
                ``busy``), raised before any other error: the blocks must stay aside.
            mooncake_kv.layout errors (ids out of range or repeated), or the kthena_comm
            transfer error a get met, once every get submitted has ended.
        """
        if not src_ids:
            return 0
        remote = [MemoryHandle.from_json(handle) for handle in source.rank_handles()]
        remote_layouts = rank_layouts(self.model_config, self.config, source)
        futures: list[TransferFuture] = []
        num_bytes, error = 0, None
        for move in kv_head_moves(self._num_heads, source.tp, self.tp):
            try:
                pairs = remote_layouts[move.src_rank].head_pair_ranges(
                    src_ids, dst_ids, self.layouts[move.dst_rank], src_head=move.src_start,
                    dst_head=move.dst_start, num_heads=move.count)
                # a get: the local side is own rank d's pool (the pairs' dst), the remote
                # side prefill rank p's (their src)
                batch = TransferBatch(self.own[move.dst_rank], remote[move.src_rank],
                                      [p.dst_offset for p in pairs],
                                      [p.src_offset for p in pairs], [p.length for p in pairs])
                futures.append(self.engine.batch_get_async(batch))
            except Exception as failed:  # noqa: BLE001 - the submitted ones are waited for
                error = failed
                break
            num_bytes += batch.nbytes
        self._settle(futures, error)
        return num_bytes

    def _settle(self, futures: Sequence[TransferFuture], error: BaseException | None) -> None:
        """Wait for every future until one deadline; raise a timeout first, else ``error`` or
        the first failure."""
        deadline = time.monotonic() + self.timeout_s
        timeout: TransferTimeoutError | None = None
        for future in futures:
            try:
                future.wait(max(0.0, deadline - time.monotonic()))
            except TransferTimeoutError as late:
                timeout = timeout or late
            except Exception as failed:  # noqa: BLE001 - the first is raised below
                error = error or failed
        if timeout is not None:
            with self._lock:
                self._outlived += [future for future in futures if not future.done()]
            raise timeout
        if error is not None:
            raise error

    def close(self) -> None:
        """Nothing to unmap: the pools are this worker's, registered by its server."""


def _lease_tp(data: Mapping[str, Any]) -> int:
    """The prefill worker's TP size a lease answers (1 where it says none).

    Raises:
        ValueError: not an int in 1..MAX_TP_SIZE.
    """
    tp = data.get("tp", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or not 0 < tp <= MAX_TP_SIZE:
        raise ValueError(f"tp {tp!r} is not a TP size (an int in 1..{MAX_TP_SIZE})")
    return tp


def _check_geometry(model_config, config: EngineConfig, ref: PoolRef,  # noqa: ANN001
                    data: Mapping[str, Any]) -> None:
    """The lease's rank 0 pool (``fingerprint``, ``kind``) is what a TP``ref.tp`` worker of
    this deployment holds.

    Raises:
        ValueError: another model, dtype, --kv-cache-dtype or block size.
    """
    expected = rank_layouts(model_config, config, ref)[0]
    if data["fingerprint"] != expected.shape.fingerprint() \
            or data["kind"] != expected.kind.value:
        raise ValueError(f"its rank 0 KV blocks are {data['fingerprint']}/{data['kind']}, "
                         f"a TP{ref.tp} worker of this deployment's "
                         f"{expected.shape.fingerprint()}/{expected.kind.value}: run both "
                         "with the same model, dtype, --kv-cache-dtype and block size")
