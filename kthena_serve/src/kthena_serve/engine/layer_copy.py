"""KV heads copied into another instance's rank pools on this host, layer by layer while a TP
engine's forward runs (the layer-wise PD hand-off between TP workers over shm).

A step's ``LayerCopy`` names the destination instance's rank pools (/dev/shm files) and which
heads of which blocks go where (``kthena_core.kv_head_moves``). Rank 0 broadcasts the step's
copies with its inputs; every rank maps the destination pools it writes (``RankCopier``, kept
mapped while they are used) and, in the model's per-layer hook, right after the layer has
written its K/V, copies that layer of the moves it is the source of::

    prefill rank r, after layer l:   for each move with src_rank == r
        decode rank move.dst_rank's pool, layer l, blocks dst_ids, heads [dst_start, +count)
            = this rank's pool, layer l, blocks src_ids, heads [src_start, +count)

The copies are plain stores of each rank's process inside its forward: once the step's forward
has returned on rank 0 (every rank has finished its layers), nothing of it is still writing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from kthena_core.shape import HeadMove
from kthena_serve.engine.model_runner import layer_caches
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool, KVPoolHandle

__all__ = ["LayerCopy", "RankCopier", "copy_heads", "moved_bytes"]

# Destination pools a rank keeps mapped beyond the ones the current step writes (an instance
# that restarted names new files; the old mappings go once more than this are kept).
_KEEP_MAPPED = 8


@attrs.frozen
class LayerCopy:
    """One step's layer-wise copy of one request's blocks into another instance's rank pools.

    Attributes:
        dst_names: the destination instance's rank pools (/dev/shm names), rank order.
        dst_layouts: their layouts, in the same order.
        moves: which source rank's heads go to which destination rank's.
        src_ids: the blocks of the source ranks' pools this step completes.
        dst_ids: the destination blocks they go to, one per ``src_ids`` entry.
    """

    dst_names: tuple[str, ...] = attrs.field(converter=tuple)
    dst_layouts: tuple[KVLayout, ...] = attrs.field(converter=tuple)
    moves: tuple[HeadMove, ...] = attrs.field(converter=tuple)
    src_ids: tuple[int, ...] = attrs.field(converter=tuple)
    dst_ids: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if len(self.dst_names) != len(self.dst_layouts):
            raise ValueError(f"{len(self.dst_names)} destination pools named for "
                             f"{len(self.dst_layouts)} layouts")
        if len(self.src_ids) != len(self.dst_ids):
            raise ValueError(f"{len(self.src_ids)} source blocks for {len(self.dst_ids)} "
                             "destination blocks")
        bad = [m.dst_rank for m in self.moves if not 0 <= m.dst_rank < len(self.dst_names)]
        if bad:
            raise ValueError(f"a move targets destination rank {bad[0]}; the destination has "
                             f"{len(self.dst_names)} ranks")


def copy_heads(src_parts: Sequence[torch.Tensor], dst_parts: Sequence[torch.Tensor],
               move: HeadMove, src_index: torch.Tensor, dst_index: torch.Tensor) -> int:
    """One layer's parts (K, V; int8 scales; MLA's latent) of blocks ``src_index``, the move's
    heads, into ``dst_index`` of the destination parts; returns the bytes copied."""
    moved = 0
    heads = slice(move.src_start, move.src_start + move.count)
    for part, target in zip(src_parts, dst_parts, strict=True):
        rows = part[:, :, heads].index_select(0, src_index)  # only the moved heads
        target[dst_index, :, move.dst_start:move.dst_start + move.count] = rows
        moved += rows.numel() * rows.element_size()
    return moved


def moved_bytes(src_caches: Sequence[Sequence[Sequence[torch.Tensor]]],
                moves: Sequence[HeadMove], num_blocks: int) -> int:
    """The bytes ``moves`` copy for ``num_blocks`` blocks of every layer, from the source ranks'
    layer caches (``src_caches[rank][layer]``)."""
    total = 0
    for move in moves:
        for parts in src_caches[move.src_rank]:
            for part in parts:
                one = part[0, :, move.src_start:move.src_start + move.count]
                total += one.numel() * one.element_size()
    return total * num_blocks


class RankCopier:
    """One rank's side of the layer-wise copies: its own pool's layer caches, the destination
    pools it writes (mapped by name, kept while used) and the per-layer hook of a step.

    Args:
        rank: this rank's place in its TP group (the ``src_rank`` of the moves it runs).
        pool: this rank's KV pool.
    """

    def __init__(self, rank: int, pool: KVPool) -> None:
        self.rank = rank
        self._caches = layer_caches(pool)
        self._mapped: dict[str, tuple[KVPool, list]] = {}

    def hook(self, copies: Sequence[LayerCopy]) -> Callable[[int], None] | None:
        """The per-layer hook that runs this rank's moves of ``copies`` (None: none of them).

        Raises:
            mooncake_kv.pool.PoolNotFoundError: a destination pool is gone (its instance
                stopped); the step fails, as a failed forward does.
        """
        work = []
        for copy in copies:
            mine = [m for m in copy.moves if m.src_rank == self.rank]
            if not mine or not copy.src_ids:
                continue
            src = torch.tensor(copy.src_ids, dtype=torch.long)
            dst = torch.tensor(copy.dst_ids, dtype=torch.long)
            for move in mine:
                name = copy.dst_names[move.dst_rank]
                work.append((self._map(name, copy.dst_layouts[move.dst_rank]), move, src, dst))
        self._drop_unused({name for copy in copies for name in copy.dst_names})
        if not work:
            return None

        def on_layer(layer: int) -> None:
            for caches, move, src, dst in work:
                copy_heads(self._caches[layer], caches[layer], move, src, dst)

        return on_layer

    def _map(self, name: str, layout: KVLayout) -> list:
        mapped = self._mapped.get(name)
        if mapped is None:
            pool = KVPool.attach(KVPoolHandle(name, layout))
            mapped = self._mapped[name] = (pool, layer_caches(pool))
        return mapped[1]

    def _drop_unused(self, used: set[str]) -> None:
        for name in [n for n in self._mapped if n not in used][:max(0, len(self._mapped)
                                                                    - _KEEP_MAPPED)]:
            self._mapped.pop(name)[0].close()

    def close(self) -> None:
        """Unmap every destination pool (never unlinks: their instances own the names)."""
        for pool, _caches in self._mapped.values():
            pool.close()
        self._mapped.clear()
