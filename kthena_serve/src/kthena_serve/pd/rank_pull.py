"""The Kthena connector's pull where either worker is a TP engine (same host, shm).

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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kthena_core.shape import kv_head_moves
from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.kv_params import MAX_TP_SIZE
from kthena_serve.pd.protocol import PoolRef
from kthena_serve.pd.reshard import DecodeRankPools, RankPools, copy_resharded, rank_layouts

if TYPE_CHECKING:
    from kthena_serve.engine.model_runner import Runner

__all__ = ["RankPull", "own_rank_pools"]


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
        tp, names = data.get("tp", 1), data.get("rank_shm_names")
        if isinstance(tp, bool) or not isinstance(tp, int) or not 0 < tp <= MAX_TP_SIZE:
            raise ValueError(f"tp {tp!r} is not a TP size (an int in 1..{MAX_TP_SIZE})")
        if not isinstance(names, list) or len(names) != tp or not all(
                isinstance(name, str) and name for name in names):
            raise ValueError(f"this TP{self.tp} decode worker copies the prompt's heads from "
                             "the prefill worker's /dev/shm pools, and its lease does not name "
                             f"one for each of its {tp} rank(s): with TP workers the Kthena "
                             "connector path runs over --pd-transport shm on one host")
        ref = PoolRef(int(data["num_blocks"]), self.config.block_size, self.config.dtype,
                      kv_cache_dtype=self.config.kv_cache_dtype, tp=tp, rank_shm_names=names)
        expected = rank_layouts(self.model_config, self.config, ref)[0]
        if data["fingerprint"] != expected.shape.fingerprint() \
                or data["kind"] != expected.kind.value:
            raise ValueError(f"its rank 0 KV blocks are {data['fingerprint']}/{data['kind']}, "
                             f"a TP{tp} worker of this deployment's "
                             f"{expected.shape.fingerprint()}/{expected.kind.value}: run both "
                             "with the same model, dtype, --kv-cache-dtype and block size")
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

    def close(self) -> None:
        """Unmap every pool mapped here (the prefill ranks' and this worker's spawned ranks')."""
        self.sources.close()
        self.own.close()
