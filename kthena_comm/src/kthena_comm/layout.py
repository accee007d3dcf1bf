"""Rank arithmetic of a parallel layout: which global ranks form each TP / PP / DP / SP group.

The layout itself is kthena_core's `Layout` (tp, pp, dp, sp; a plan's ``plan.layout``). Rank
order puts TP innermost, then PP, then DP (the order kthena_core's planner emits)::

    global rank = (dp_idx * pp + pp_idx) * tp + tp_idx

    tp=2, pp=1, dp=2 (4 ranks)      TP groups: [0 1] [2 3]
       dp0: r0 r1                   DP groups: [0 2] [1 3]
       dp1: r2 r3                   PP groups: [0] [1] [2] [3]

Sequence parallelism (Megatron style) runs over the TP group, so SP groups equal TP groups when
``sp > 1`` and are single ranks when ``sp == 1``. Everything here is pure arithmetic.
"""

from __future__ import annotations

from typing import NewType

import attrs

from kthena_comm.errors import LayoutError
from kthena_core.layout import Layout

Rank = NewType("Rank", int)
"""A global rank in the world process group."""

GroupKind = str
"""One of ``"tp"``, ``"pp"``, ``"dp"``, ``"sp"``."""

GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp", "sp")


@attrs.frozen
class RankCoords:
    """Position of one rank in the (dp, pp, tp) grid."""

    dp_idx: int
    pp_idx: int
    tp_idx: int


def global_rank(layout: Layout, coords: RankCoords) -> Rank:
    """Global rank of grid position ``coords``."""
    return Rank((coords.dp_idx * layout.pp + coords.pp_idx) * layout.tp + coords.tp_idx)


def coords_of(layout: Layout, rank: int) -> RankCoords:
    """Grid position of global ``rank``; raises LayoutError when it is outside the layout."""
    if not 0 <= rank < layout.num_devices:
        raise LayoutError(f"rank {rank} outside layout of {layout.num_devices} ranks")
    tp_idx = rank % layout.tp
    pp_idx = (rank // layout.tp) % layout.pp
    return RankCoords(rank // (layout.tp * layout.pp), pp_idx, tp_idx)


def group_ranks(layout: Layout, kind: GroupKind) -> tuple[tuple[Rank, ...], ...]:
    """Every group of ``kind``, each as ascending global ranks, in a deterministic order.

    All ranks must create groups in the same order, so this order is part of the contract.
    """
    if kind == "sp":
        kind = "tp" if layout.sp > 1 else "single"
    members: dict[tuple[int, ...], list[Rank]] = {}
    for rank in range(layout.num_devices):
        c = coords_of(layout, rank)
        key = {"tp": (c.dp_idx, c.pp_idx), "pp": (c.dp_idx, c.tp_idx),
               "dp": (c.pp_idx, c.tp_idx), "single": (rank,)}.get(kind)
        if key is None:
            raise LayoutError(f"unknown group kind {kind!r}; allowed: {', '.join(GROUP_KINDS)}")
        members.setdefault(key, []).append(Rank(rank))
    return tuple(tuple(m) for m in members.values())


def group_of(layout: Layout, kind: GroupKind, rank: int) -> tuple[Rank, ...]:
    """The ``kind`` group that contains ``rank``."""
    return next(g for g in group_ranks(layout, kind) if rank in g)
