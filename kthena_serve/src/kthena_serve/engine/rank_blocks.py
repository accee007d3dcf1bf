"""A TP engine's KV blocks as the offload tiers see them: one block of every KV head in order,
the bytes a one-rank pool of the same model holds (``--kv-offload`` at tp > 1).

Each rank of a TP engine holds a pool of its own KV heads (``kthena_core.kv_head_range``),
all with the same block ids, each a /dev/shm file that rank 0's process maps
(``ParallelModelRunner(shared_pool=True)``). ``RankBlocks`` is the ``BlockStorage`` the
offloader reads and writes there, in the layout of a tp=1 pool (MLA: the one latent, which
every rank holds a copy of)::

    SmolLM2's 3 KV heads at tp=2, block b of every layer and part (K, V; int8 scales):

    rank 0's pool  [b, :, heads 0-1] ─┐  read_block (merge)   ┌─ scratch block [0, :, heads 0-2]
    rank 1's pool  [b, :, head  2  ] ─┴─────────────────────▶ │  = a tp=1 pool's bytes ─▶ tiers
                                      ◀────────────────────── ┘
                                         write_block (split): a promoted block, head by head,
                                         into the ranks that own it (replicas: each of them)

So a block's key in the tiers is what a tp=1 engine gives it (its fingerprint names all the
model's KV heads), and an instance of any TP size reads what any other one put. All tier I/O
runs in rank 0's process, on the offloader's threads; the ranks only compute. The offloader's
bookkeeping is unchanged: a block is never reused while its copy is in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kthena_core.shape import kv_head_moves, kv_heads_per_rank
from kthena_serve.engine.model_runner import layer_caches
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool, KVPoolHandle
from mooncake_kv.types import BlockId

if TYPE_CHECKING:
    from kthena_serve.engine.model_runner import Runner
    from kthena_serve.engine.parallel_runner import ParallelModelRunner
    from mooncake_kv.tiers.offload import BlockStorage

__all__ = ["RankBlocks", "block_storage"]


class RankBlocks:
    """Whole blocks of a TP engine's rank pools, in the one-rank layout (see module docs).

    Args:
        pools: every rank's pool in rank order, rank 0's first.
        num_kv_heads: the model's KV heads (1 for MLA's latent, which every rank holds).
        owned: the pools this object mapped and unmaps at ``close``.

    Raises:
        ValueError: a rank's pool does not hold that rank's share of the heads, or the pools
            differ in block count or geometry.
    """

    def __init__(self, pools: Sequence[KVPool], num_kv_heads: int,
                 owned: Sequence[KVPool] = ()) -> None:
        tp = len(pools)
        if not tp:
            raise ValueError("RankBlocks needs every rank's pool, rank 0's first; got none")
        first = pools[0].layout
        for rank, pool in enumerate(pools):
            share = kv_heads_per_rank(num_kv_heads, tp, rank)
            want = KVLayout(attrs.evolve(first.shape, num_kv_heads=share), first.num_blocks,
                            first.kind)
            if pool.layout != want:
                raise ValueError(
                    f"rank {rank} of {tp}: its pool holds {pool.layout.num_blocks} blocks of "
                    f"{pool.layout.shape.fingerprint()} ({pool.layout.kind.value}), but its "
                    f"share of {num_kv_heads} KV heads is {want.num_blocks} blocks of "
                    f"{want.shape.fingerprint()} ({want.kind.value})")
        self._layout = KVLayout(attrs.evolve(first.shape, num_kv_heads=num_kv_heads),
                                first.num_blocks, first.kind)
        self._ranks = [layer_caches(pool) for pool in pools]
        self._merge = kv_head_moves(num_kv_heads, tp, 1)
        self._split = kv_head_moves(num_kv_heads, 1, tp)
        self._owned = list(owned)
        self._scratch = threading.local()  # one block per thread (copier, promoter)

    @classmethod
    def of_runner(cls, runner: ParallelModelRunner) -> RankBlocks:
        """The blocks of ``runner``'s ranks, their pools mapped here (rank 0's is its own).

        Raises:
            ValueError: the runner's pools are private (made without ``shared_pool``).
        """
        try:
            ranks = runner.rank_pools()
        except ValueError as error:
            raise ValueError(f"--kv-offload at tp > 1 reads every rank's pool from rank 0's "
                             f"process: build the runner with shared_pool=True ({error})") from None
        mapped: list[KVPool] = []
        try:
            for name, layout in ranks[1:]:
                mapped.append(KVPool.attach(KVPoolHandle(name, layout)))
            return cls([runner.pool, *mapped], runner.model.config.kv_heads_per_rank(1),
                       owned=mapped)
        except BaseException:
            for pool in mapped:
                pool.close()
            raise

    @property
    def layout(self) -> KVLayout:
        """The one-rank layout: every KV head, the ranks' block count and geometry."""
        return self._layout

    @property
    def tp(self) -> int:
        return len(self._ranks)

    def read_block(self, block_id: BlockId) -> bytes:
        """Block ``block_id`` of every rank, merged into the bytes a one-rank pool holds."""
        scratch = self._scratch_pool()
        caches = layer_caches(scratch)
        index = int(block_id)
        for move in self._merge:
            src = slice(move.src_start, move.src_start + move.count)
            dst = slice(move.dst_start, move.dst_start + move.count)
            for src_parts, dst_parts in zip(self._ranks[move.src_rank], caches, strict=True):
                for part, target in zip(src_parts, dst_parts, strict=True):
                    target[0, :, dst] = part[index, :, src]
        return scratch.read_block(BlockId(0))

    def write_block(self, block_id: BlockId, payload: bytes) -> None:
        """Split one-rank bytes (``read_block``'s) into block ``block_id`` of every rank.

        Raises:
            mooncake_kv.pool.BlockPayloadError: ``payload`` is not one block of this layout.
        """
        scratch = self._scratch_pool()
        scratch.write_block(BlockId(0), payload)
        caches = layer_caches(scratch)
        index = int(block_id)
        for move in self._split:
            src = slice(move.src_start, move.src_start + move.count)
            dst = slice(move.dst_start, move.dst_start + move.count)
            for src_parts, dst_parts in zip(caches, self._ranks[move.dst_rank], strict=True):
                for part, target in zip(src_parts, dst_parts, strict=True):
                    target[index, :, dst] = part[0, :, src]

    def _scratch_pool(self) -> KVPool:
        pool = getattr(self._scratch, "pool", None)
        if pool is None:
            pool = KVPool.create(attrs.evolve(self._layout, num_blocks=1))
            self._scratch.pool = pool
        return pool

    def close(self) -> None:
        """Unmap the other ranks' pools (their ranks unlink them). Safe to repeat."""
        for pool in self._owned:
            pool.close()
        self._owned = []
        self._ranks = []


def block_storage(runner: Runner) -> BlockStorage:
    """What the offloader of ``runner``'s engine reads and writes: its pool (one rank), or a
    ``RankBlocks`` over every rank's pool (tp > 1)."""
    from kthena_serve.engine.parallel_runner import ParallelModelRunner

    if isinstance(runner, ParallelModelRunner):
        return RankBlocks.of_runner(runner)
    return runner.pool

