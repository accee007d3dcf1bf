"""MC2 on CUDA through torch's symmetric-memory async-TP ops. UNVERIFIED ON HARDWARE.

torch (2.5 and later; ``torch.distributed._symmetric_memory`` registers them) ships two of the
three MC2 shapes as fused, micro-pipelined CUDA ops over NCCL groups:

    all_gather_matmul       torch.ops.symm_mem.fused_all_gather_matmul(x, [w], 0, group_name,
                                                                       return_A=...)
                            -> (gathered x or None, [all_gather(x) @ w])
    matmul_reduce_scatter   torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w, "sum", 0,
                                                                           group_name)
                            -> reduce_scatter(x @ w) along rows
    matmul_all_reduce       (no symmetric-memory op) the tiled op: NCCL runs each tile's
                            all-reduce on its own stream while the next tile multiplies

``group_name`` is the process group's ``group_name``. Torch before 2.8 needed
``enable_symm_mem_for_group`` once per group (later ones deprecate it and do it themselves);
it is called once per group here. A group of one, or a CommGroup without a process group,
runs the tiled op (a plain matmul).
"""

from __future__ import annotations

import functools
import warnings

import torch

from mooncake_ops.backends import mc2_tiled

__all__ = ["OPS", "all_gather_matmul", "available", "matmul_reduce_scatter"]

OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")


@functools.cache
def available() -> bool:
    """Whether the installed torch has both fused async-TP ops (needs no GPU to answer)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  registers torch.ops.symm_mem
    except ImportError:
        return False
    return all(hasattr(torch.ops.symm_mem, op) for op in OPS)


@functools.cache
def _enabled(group_name: str) -> str:
    from torch.distributed import _symmetric_memory as symm_mem

    with warnings.catch_warnings():  # deprecated (and a no-op need) from torch 2.8 on
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group_name)
    return group_name


def _group_name(comm) -> str | None:
    pg = comm.process_group
    return None if comm.size == 1 or pg is None else _enabled(pg.group_name)


def all_gather_matmul(x, w, comm, num_tiles, bias=None, timeout_s=None, return_gathered=False):
    name = _group_name(comm)
    if name is None:
        return mc2_tiled.all_gather_matmul(x, w, comm, num_tiles, bias, timeout_s,
                                           return_gathered)
    gathered, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(
        x.contiguous(), [w], 0, name, return_A=return_gathered)
    out = out if bias is None else out.add_(bias)
    return (out, gathered) if return_gathered else out


def matmul_reduce_scatter(x, w, comm, num_tiles, bias=None, timeout_s=None):
    name = _group_name(comm)
    if name is None:
        return mc2_tiled.matmul_reduce_scatter(x, w, comm, num_tiles, bias, timeout_s)
    out = torch.ops.symm_mem.fused_matmul_reduce_scatter(x.contiguous(), w, "sum", 0, name)
    return out if bias is None else out.add_(bias)
