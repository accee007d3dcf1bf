"""MC2 (CANN's Matrix Computation & Communication): matmul fused with a collective.

    matmul_all_reduce(x, w)      = all_reduce(x @ w)        row-parallel linear (K sharded)
    all_gather_matmul(x, w)      = all_gather(x) @ w        sequence-parallel input
    matmul_reduce_scatter(x, w)  = reduce_scatter(x @ w)    row-parallel, sequence-parallel out

``w`` is [K, N] (matmul convention; for an ``nn.Linear`` weight [out, in] pass ``weight.t()``).
On cpu / cuda the matmul is tiled over rows and each tile's collective overlaps the next tile's
matmul (`backends/mc2_tiled.py`); on npu the fused torch_npu kernels run (unverified on hardware).
``group`` is a kthena_comm ``CommGroup``, a torch ``ProcessGroup``, or None for the world group
(a single process without torch.distributed is a group of one: plain matmul).

What runs each op per device, and what a caller that asks for overlap gets (`require_fused`):

    op                      cpu     cuda                                    npu (torch_npu)
    matmul_all_reduce       tiled   tiled over NCCL streams                 npu_mm_all_reduce_base
    all_gather_matmul       tiled   symm_mem.fused_all_gather_matmul        npu_all_gather_base_mm
    matmul_reduce_scatter   tiled   symm_mem.fused_matmul_reduce_scatter    npu_mm_reduce_scatter_base
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from kthena_comm.groups import CommGroup
from kthena_comm.layout import Rank
from mooncake_ops._validate import FLOAT_DTYPES, check_dtype, check_same_device
from mooncake_ops.backends.base import MC2_OPS
from mooncake_ops.dispatch import impl, implementation_name
from mooncake_ops.errors import OpsShapeError, UnsupportedDeviceError

__all__ = ["all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter", "require_fused",
           "resolve_group"]

# The fused kernel each op needs, per device type that has one (cpu runs the tiled op).
_SYMM_MEM = {"all_gather_matmul": "torch.ops.symm_mem.fused_all_gather_matmul",
             "matmul_reduce_scatter": "torch.ops.symm_mem.fused_matmul_reduce_scatter"}
_TORCH_NPU = {"matmul_all_reduce": "npu_mm_all_reduce_base",
              "all_gather_matmul": "npu_all_gather_base_mm",
              "matmul_reduce_scatter": "npu_mm_reduce_scatter_base"}

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


def require_fused(device_type: str, ops: Sequence[str] = MC2_OPS) -> Mapping[str, str]:
    """What runs each of ``ops`` on ``device_type`` for a caller that asks for overlap (the
    table in the module docs), checked against the installed torch / torch_npu.

    On npu this imports torch_npu (call it only for an npu deployment).

    Returns:
        op -> implementation name (`mooncake_ops.capabilities`' spelling).

    Raises:
        UnsupportedDeviceError: a device type without MC2, or a fused kernel missing from the
            installed torch (cuda) or torch_npu (npu); the message names it and what works.
    """
    unknown = sorted(set(ops) - set(MC2_OPS))
    if unknown:
        raise OpsShapeError(f"require_fused: {unknown} are not MC2 ops; they are {list(MC2_OPS)}")
    missing: list[str] = []
    if device_type == "cuda":
        from mooncake_ops.backends import mc2_symm_mem

        if not mc2_symm_mem.available():
            missing = [_SYMM_MEM[op] for op in ops if op in _SYMM_MEM]
        where = f"torch {torch.__version__}"
    elif device_type == "npu":
        from mooncake_ops.backends.torch_npu_api import load

        try:
            api = load()
        except ImportError as error:
            raise UnsupportedDeviceError(f"MC2 overlap on npu needs torch_npu's MC2 ops "
                                         f"({', '.join(_TORCH_NPU[op] for op in ops)}), and "
                                         f"torch_npu does not import here ({error}); install "
                                         "torch_npu with CANN, or run without overlap") from None
        missing = [_TORCH_NPU[op] for op in ops if not api.has(_TORCH_NPU[op])]
        where = f"torch_npu {api.release.version}"
    elif device_type != "cpu":
        raise UnsupportedDeviceError(f"MC2 overlap runs on cpu (tiled), cuda and npu; device "
                                     f"type {device_type!r} has none")
    if missing:
        raise UnsupportedDeviceError(
            f"MC2 overlap on {device_type} needs {', '.join(missing)}, which {where} lacks; "
            "install a version that has it (torch's async-TP ops live in "
            "torch.distributed._symmetric_memory; torch_npu's MC2 ops in Ascend Extension "
            "6.0 and later), or run without overlap")
    return {op: implementation_name(op, device_type) for op in ops}
