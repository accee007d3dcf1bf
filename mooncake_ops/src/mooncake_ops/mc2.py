"""MC2 (CANN's Matrix Computation & Communication): matmul fused with a collective.

    matmul_all_reduce(x, w)      = all_reduce(x @ w)        row-parallel linear (K sharded)
    all_gather_matmul(x, w)      = all_gather(x) @ w        sequence-parallel input
    matmul_reduce_scatter(x, w)  = reduce_scatter(x @ w)    row-parallel, sequence-parallel out

``w`` is [K, N] (matmul convention; for an ``nn.Linear`` weight [out, in] pass ``weight.t()``).
On cpu / cuda the matmul is tiled over rows and each tile's collective overlaps the next tile's
matmul (`backends/mc2_tiled.py`); on npu the fused torch_npu kernels run (unverified on hardware).
``group`` is a kthena_comm ``CommGroup``, a torch ``ProcessGroup``, or None for the world group
(a single process without torch.distributed is a group of one: plain matmul).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kthena_comm.groups import CommGroup
from kthena_comm.layout import Rank
from mooncake_ops._validate import FLOAT_DTYPES, check_dtype, check_same_device
from mooncake_ops.dispatch import impl
from mooncake_ops.errors import OpsShapeError

__all__ = ["all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter", "resolve_group"]

# Measured (docs/mooncake_ops.md): over gloo the collective runs on the same CPU cores as the
# matmul, so tiling only adds per-tile latency; devices whose collectives are offloaded to DMA
# engines (cuda, npu) overlap. ``num_tiles=None`` picks per device type.
AUTO_TILES = {"cpu": 1}
DEFAULT_TILES = 4


def _tiles_for(x: torch.Tensor, num_tiles: int | None) -> int:
    if num_tiles is None:
        return AUTO_TILES.get(x.device.type, DEFAULT_TILES)
    if num_tiles < 1:
        raise OpsShapeError(f"num_tiles must be >= 1 (or None for the device default); got {num_tiles}")
    return num_tiles


def resolve_group(group: CommGroup | Any | None) -> CommGroup:
    """A ``CommGroup`` for ``group`` (CommGroup, torch ProcessGroup or None = world)."""
    if isinstance(group, CommGroup):
        return group
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise OpsShapeError("a process group was given but torch.distributed is not "
                                "initialised; call kthena_comm.init_parallel_groups first")
        return CommGroup("local", (Rank(0),), Rank(0))
    pg = group if group is not None else dist.group.WORLD
    ranks = tuple(Rank(r) for r in dist.get_process_group_ranks(pg))
    return CommGroup("mc2", ranks, Rank(dist.get_rank()), pg if len(ranks) > 1 else None)


def _operands(x: torch.Tensor, w: torch.Tensor, op: str) -> torch.Tensor:
    """Validate and flatten x [..., K] to [rows, K]."""
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("w", w, FLOAT_DTYPES)
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[0]:
        raise OpsShapeError(f"{op}: x [..., K] @ w [K, N] needs x.shape[-1] == w.shape[0]; got "
                            f"x {tuple(x.shape)}, w {tuple(w.shape)} (an nn.Linear weight "
                            "[out, in] must be passed as weight.t())")
    check_same_device(("x", x), ("w", w))
    return x.reshape(-1, x.shape[-1])


def matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, group: CommGroup | Any | None = None, *,
                      num_tiles: int | None = None, bias: torch.Tensor | None = None,
                      timeout_s: float | None = None) -> torch.Tensor:
    """``all_reduce(x @ w) (+ bias)`` over ``group``; x [..., K_local] -> [..., N].

    ``num_tiles``: row tiles whose collectives overlap the next tile's matmul; None picks the
    device default (1 on cpu, where gloo shares the compute cores; 4 elsewhere).

    Raises:
        OpsShapeError, OpsDTypeError: operands that do not multiply.
    """
    x2 = _operands(x, w, "matmul_all_reduce")
    comm = resolve_group(group)
    out = impl("matmul_all_reduce", x.device.type)(x2, w, comm, _tiles_for(x, num_tiles),
                                                   bias, timeout_s)
    return out.view(*x.shape[:-1], w.shape[1])


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, group: CommGroup | Any | None = None, *,
                      num_tiles: int | None = None, bias: torch.Tensor | None = None,
                      timeout_s: float | None = None, return_gathered: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(x) @ w (+ bias)``: x [m, K] on each rank -> [world * m, N] in rank order.

    With ``return_gathered`` also returns the gathered x [world * m, K].
    """
    if x.dim() != 2:
        raise OpsShapeError(f"all_gather_matmul needs x [m, K]; got {tuple(x.shape)}")
    _operands(x, w, "all_gather_matmul")
    comm = resolve_group(group)
    return impl("all_gather_matmul", x.device.type)(x, w, comm, _tiles_for(x, num_tiles), bias,
                                                    timeout_s, return_gathered)


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor,
                          group: CommGroup | Any | None = None, *,
                          num_tiles: int | None = None, bias: torch.Tensor | None = None,
                          timeout_s: float | None = None) -> torch.Tensor:
    """``reduce_scatter(x @ w) (+ bias)``: x [M, K_local] -> this rank's [M / world, N] rows.

    Raises:
        OpsShapeError: M not divisible by the group size (pad the rows).
    """
    if x.dim() != 2:
        raise OpsShapeError(f"matmul_reduce_scatter needs x [M, K]; got {tuple(x.shape)}")
    _operands(x, w, "matmul_reduce_scatter")
    comm = resolve_group(group)
    if x.shape[0] % comm.size:
        raise OpsShapeError(f"matmul_reduce_scatter: M = {x.shape[0]} rows must be divisible by "
                            f"the group size {comm.size}; pad x")
    return impl("matmul_reduce_scatter", x.device.type)(x, w, comm, _tiles_for(x, num_tiles), bias,
                                                        timeout_s)
