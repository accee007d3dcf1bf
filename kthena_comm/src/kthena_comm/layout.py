"""Parallel layout: which global ranks form each TP / PP / DP / SP group.

Rank order puts TP innermost, then PP, then DP (the order kthena_core's planner emits)::

    global rank = (dp_idx * pp_size + pp_idx) * tp_size + tp_idx

    tp=2, pp=1, dp=2 (4 ranks)      TP groups: [0 1] [2 3]
       dp0: r0 r1                   DP groups: [0 2] [1 3]
       dp1: r2 r3                   PP groups: [0] [1] [2] [3]

Sequence parallelism (Megatron style) runs over the TP group, so SP groups equal TP groups when
``sp_size > 1`` and are single ranks when ``sp_size == 1``. Everything here is pure arithmetic.
"""

from __future__ import annotations

from typing import NewType, Protocol, runtime_checkable

import attrs

from kthena_comm.errors import LayoutError

Rank = NewType("Rank", int)
"""A global rank in the world process group."""

GroupKind = str
"""One of ``"tp"``, ``"pp"``, ``"dp"``, ``"sp"``."""

GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp", "sp")


@runtime_checkable
class ParallelLayout(Protocol):
    """What kthena_comm needs from a plan (kthena_core's ``Plan`` satisfies it)."""

    tp_size: int
    pp_size: int
    dp_size: int
    sp_size: int


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class ParallelConfig:
    """A plain layout for tests and for callers without a planner."""

    tp_size: int = attrs.field(validator=_positive)
    pp_size: int = attrs.field(default=1, validator=_positive)
    dp_size: int = attrs.field(default=1, validator=_positive)
    sp_size: int = attrs.field(default=1, validator=_positive)


@attrs.frozen
class RankCoords:
    """Position of one rank in the (dp, pp, tp) grid."""

    dp_idx: int
    pp_idx: int
    tp_idx: int


def world_size_of(layout: ParallelLayout) -> int:
    """Number of ranks a layout needs: tp × pp × dp (SP shares the TP ranks)."""
    return layout.tp_size * layout.pp_size * layout.dp_size


def check_layout(layout: ParallelLayout) -> None:
    """Raise LayoutError unless sizes are positive and SP is 1 or equal to TP."""
    for kind in GROUP_KINDS:
        size = getattr(layout, f"{kind}_size")
        if not isinstance(size, int) or size < 1:
            raise LayoutError(f"{kind}_size must be a positive int, got {size!r}")
    if layout.sp_size not in (1, layout.tp_size):
        raise LayoutError(f"sp_size={layout.sp_size} must be 1 or equal tp_size={layout.tp_size}: "
                          "sequence parallelism runs over the tensor-parallel group")


def global_rank(layout: ParallelLayout, coords: RankCoords) -> Rank:
    """Global rank of grid position ``coords``."""
    return Rank((coords.dp_idx * layout.pp_size + coords.pp_idx) * layout.tp_size + coords.tp_idx)


def coords_of(layout: ParallelLayout, rank: int) -> RankCoords:
    """Grid position of global ``rank``; raises LayoutError when it is outside the layout."""
    if not 0 <= rank < world_size_of(layout):
        raise LayoutError(f"rank {rank} outside layout of {world_size_of(layout)} ranks")
    tp_idx = rank % layout.tp_size
    pp_idx = (rank // layout.tp_size) % layout.pp_size
    return RankCoords(rank // (layout.tp_size * layout.pp_size), pp_idx, tp_idx)


def group_ranks(layout: ParallelLayout, kind: GroupKind) -> tuple[tuple[Rank, ...], ...]:
    """Every group of ``kind``, each as ascending global ranks, in a deterministic order.

    All ranks must create groups in the same order, so this order is part of the contract.
    """
    check_layout(layout)
    if kind == "sp":
        kind = "tp" if layout.sp_size > 1 else "single"
    members: dict[tuple[int, ...], list[Rank]] = {}
    for rank in range(world_size_of(layout)):
        c = coords_of(layout, rank)
        key = {"tp": (c.dp_idx, c.pp_idx), "pp": (c.dp_idx, c.tp_idx),
               "dp": (c.pp_idx, c.tp_idx), "single": (rank,)}.get(kind)
        if key is None:
            raise LayoutError(f"unknown group kind {kind!r}; allowed: {', '.join(GROUP_KINDS)}")
        members.setdefault(key, []).append(Rank(rank))
    return tuple(tuple(m) for m in members.values())


def group_of(layout: ParallelLayout, kind: GroupKind, rank: int) -> tuple[Rank, ...]:
    """The ``kind`` group that contains ``rank``."""
    return next(g for g in group_ranks(layout, kind) if rank in g)
