"""PD between TP instances on one host: each rank's KV heads copied into the decode ranks that
own them, re-sharded when the two instances have different TP sizes.

A TP worker's ranks each hold a pool of their own KV heads (``kthena_core.kv_head_range``), all
with the same block ids, each a /dev/shm file (``ParallelModelRunner(shared_pool=True)``). The
decode worker names every rank's file in its ``PoolRef`` (``tp``, ``rank_shm_names``). The
prefill worker computes into its own rank pools, with its own prefix cache, then copies the
blocks the decode worker lacks (``ReshardCopy``, a ``BlockPush``):

    for each move of kv_head_moves(kv_heads, prefill tp, decode tp)
        for each layer and part (K, V; an int8 pool's scales; MLA's one latent)
            decode rank d's heads [dst_start, +count) of dst blocks
                = prefill rank p's heads [src_start, +count) of src blocks

    prefill TP2 -> decode TP2   rank 0 -> rank 0, rank 1 -> rank 1 (whole heads)
    prefill TP1 -> decode TP2   SmolLM2's 3 heads: heads 0-1 -> rank 0, head 2 -> rank 1
    prefill TP2 -> decode TP1   rank 0's 2 heads and rank 1's 1 head merged into one pool

Layer-wise (``--pd-kv-push layerwise``, the default), each step's completed blocks are copied
layer by layer while the prefill runs: a TP prefill's ranks each copy their own heads right
after each layer (engine/layer_copy.py: rank 0 broadcasts the step's plan with its inputs), a
tp=1 prefill copies in the model's per-layer hook. Batched, the prefill worker's own process
copies every block once the prefill is done. Either way the stores are plain stores of
processes of this worker that end with the step (layer-wise) or with ``finish`` (batched):
nothing is left in flight, so a failed or cancelled hand-off never writes later. A tp=1 pair
keeps the zero-copy path (the
prefill writes straight into the decode pool). Across hosts (``--pd-transport mooncake``) the
same moves are one-sided puts between the ranks' registered pools: pd/reshard_put.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kthena_core.shape import HeadMove, kv_head_moves, kv_heads_per_rank
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.layer_copy import LayerCopy, copy_heads, moved_bytes
from kthena_serve.engine.model_runner import kv_layout_for, layer_caches
from kthena_serve.pd.protocol import PoolRef
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool, KVPoolHandle

__all__ = ["DecodeRankPools", "RankPools", "ReshardCopy", "copy_layers", "copy_resharded",
           "rank_layouts"]


def rank_layouts(model_config, config: EngineConfig, ref: PoolRef,  # noqa: ANN001 - ModelConfig
                 ) -> list[KVLayout]:
    """The layout of each rank's pool of the TP instance ``ref`` names: that rank's own KV heads
    (MLA: one latent), the instance's block count, block size and KV dtype."""
    shape = model_config.shape
    cfg = EngineConfig(model=config.model, dtype=ref.dtype, block_size=ref.block_size,
                       num_kv_blocks=ref.num_blocks, kv_cache_dtype=ref.kv_cache_dtype)
    heads = [1 if model_config.mla is not None else
             kv_heads_per_rank(shape.num_kv_heads, ref.tp, rank) for rank in range(ref.tp)]
    return [kv_layout_for(shape.num_layers, n, model_config.kv_head_dim, cfg,
                          num_parts=model_config.kv_parts) for n in heads]


class RankPools:
    """The pools of one TP instance's ranks, in rank order, as this process sees them.

    Args:
        pools: rank 0's first.
        owned: pools this object closes (those it mapped); the others belong to their runner.
    """

    def __init__(self, pools: Sequence[KVPool], owned: Sequence[KVPool] = ()) -> None:
        self.pools = list(pools)
        self.caches = [layer_caches(pool) for pool in self.pools]
        self._owned = list(owned)

    @property
    def tp(self) -> int:
        return len(self.pools)

    @classmethod
    def attach(cls, names: Sequence[str], layouts: Sequence[KVLayout]) -> RankPools:
        """Map the /dev/shm pools ``names`` (one per rank, with its layout).

        Raises:
            mooncake_kv.pool.PoolNotFoundError: a name is not (or no longer) there.
            mooncake_kv.pool.PoolMismatchError: a file's size is not its layout's.
        """
        pools: list[KVPool] = []
        try:
            for name, layout in zip(names, layouts, strict=True):
                pools.append(KVPool.attach(KVPoolHandle(name, layout)))
        except BaseException:
            for pool in pools:
                pool.close()
            raise
        return cls(pools, owned=pools)

    def close(self) -> None:
        """Unmap the pools this object mapped (never unlinks: their creators own the names)."""
        for pool in self._owned:
            pool.close()
        self._owned = []


def copy_resharded(src: RankPools, dst: RankPools, moves: Sequence[HeadMove],
                   src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
    """Copy blocks ``src_ids[i]`` of ``src``'s ranks into ``dst_ids[i]`` of ``dst``'s, each
    rank's heads where ``moves`` sends them; returns the bytes copied.

    Raises:
        ValueError: ``src_ids`` and ``dst_ids`` differ in length.
    """
    return copy_layers(src, dst, moves, range(len(src.caches[0])), src_ids, dst_ids)


def copy_layers(src: RankPools, dst: RankPools, moves: Sequence[HeadMove],
                layers: Sequence[int], src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
    """``copy_resharded`` of ``layers`` only; returns the bytes copied.

    Raises:
        ValueError: ``src_ids`` and ``dst_ids`` differ in length.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    if not src_ids:
        return 0
    src_index = torch.tensor(list(src_ids), dtype=torch.long)
    dst_index = torch.tensor(list(dst_ids), dtype=torch.long)
    return sum(copy_heads(src.caches[move.src_rank][layer], dst.caches[move.dst_rank][layer],
                          move, src_index, dst_index) for layer in layers for move in moves)


class ReshardCopy:
    """One request's hand-off from a prefill instance's rank pools into the decode instance
    ``ref`` names (a ``BlockPush``; see the module docs).

    Layer-wise (``--pd-kv-push layerwise``, the default): each step's completed blocks go layer
    by layer while the prefill runs. A TP prefill's ranks copy their own heads in their forward
    (``layer_copy``: the plan rank 0 broadcasts with the step); a tp=1 prefill copies in the
    model's hook (``push_layer``). Batched: every block once the prefill is done (``finish``).

    Args:
        src: this prefill worker's rank pools.
        targets: the decode instances' pools mapped here (mapped on first use).
        ref: the decode instance's pool reference.
        layerwise: copy layer by layer while the prefill runs.
    """

    def __init__(self, src: RankPools, targets: DecodeRankPools, ref: PoolRef, *,
                 layerwise: bool = False) -> None:
        self.src, self.targets, self.ref, self.layerwise = src, targets, ref, layerwise
        heads = targets.model_config.shape.num_kv_heads
        self.moves = kv_head_moves(1 if targets.model_config.mla is not None else heads,
                                   src.tp, ref.tp)
        self.num_bytes = 0
        self._copying = threading.Event()

    def layer_copy(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> LayerCopy:
        """This step's copy of ``src_ids`` into ``dst_ids``, which a TP runner's ranks run
        layer by layer in their forward; unsettled until ``step_done``.

        Raises:
            ValueError: the decode pool names no /dev/shm rank pools.
        """
        self._copying.set()
        copy = LayerCopy(self.ref.rank_names(),
                         rank_layouts(self.targets.model_config, self.targets.config, self.ref),
                         self.moves, src_ids, dst_ids)
        self.num_bytes += moved_bytes(self.src.caches, self.moves, len(src_ids))
        return copy

    def step_done(self) -> None:
        """The forward that ran this push's ``layer_copy`` has returned (or failed) on every
        rank: nothing of it writes any more."""
        self._copying.clear()

    def push_layer(self, layer: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy ``layer`` of ``src_ids`` into ``dst_ids`` now (a tp=1 prefill's model hook)."""
        self._copying.set()
        try:
            dst = self.targets.acquire(self.ref)
            try:
                self.num_bytes += copy_layers(self.src, dst, self.moves, (layer,), src_ids,
                                              dst_ids)
            finally:
                self.targets.release(self.ref)
        finally:
            self._copying.clear()

    def finish(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
        """Copy ``src_ids`` into ``dst_ids`` (batched; layer-wise they are there already);
        returns the bytes copied."""
        if self.layerwise:
            return self.num_bytes
        self._copying.set()
        try:
            dst = self.targets.acquire(self.ref)
            try:
                self.num_bytes += copy_resharded(self.src, dst, self.moves, src_ids, dst_ids)
                return self.num_bytes
            finally:
                self.targets.release(self.ref)
        finally:
            self._copying.clear()

    def settled(self) -> bool:
        """True unless the copy runs: its stores are this process's and end with ``finish``."""
        return not self._copying.is_set()


class DecodeRankPools:
    """The decode instances' rank pools mapped here, by their names (once per instance); an
    instance that restarted exports new names, and the old mapping is dropped as soon as no
    copy uses it.

    Args:
        model_config: the model's ``ModelConfig`` (its heads, layers and KV geometry).
        config: this worker's engine config (its model).
    """

    def __init__(self, model_config, config: EngineConfig) -> None:  # noqa: ANN001
        self.model_config, self.config = model_config, config
        self._pools: dict[tuple[str, ...], RankPools] = {}
        self._users: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    def acquire(self, ref: PoolRef) -> RankPools:
        """The mapped pools of ``ref``'s ranks (mapped now if new); give them back with
        ``release(ref)``.

        Raises:
            ValueError: ``ref`` names no rank pools, or they are not on this host.
        """
        names = ref.rank_names()
        with self._lock:
            pools = self._pools.get(names)
            if pools is None:
                pools = RankPools.attach(names, rank_layouts(self.model_config, self.config, ref))
                for key in [k for k in self._pools if not self._users.get(k)]:
                    self._pools.pop(key).close()
                self._pools[names] = pools
            self._users[names] = self._users.get(names, 0) + 1
            return pools

    def release(self, ref: PoolRef) -> None:
        with self._lock:
            names = ref.rank_names()
            self._users[names] -= 1
            if not self._users[names]:
                del self._users[names]

    def close(self) -> None:
        with self._lock:
            for pools in self._pools.values():
                pools.close()
            self._pools.clear()
