"""Argument checks shared by the ops: types, shapes, dtypes and devices, before any kernel runs.

Only tensor metadata is read here (no device sync), so a check costs a few microseconds on the
serving hot path; a non-tensor argument costs one ``isinstance`` (in ``check_rank``) to catch. Checks that need tensor *values* (a context longer than its block table, a
block id outside the cache) are done by each implementation before it computes: the native
kernels in a C++ pre-pass, the PyTorch paths with `check_lengths` below.
"""

from __future__ import annotations

import reprlib

import torch

from mooncake_ops.errors import (
    BlockTableError,
    OpsDeviceError,
    OpsDTypeError,
    OpsShapeError,
    OpsTypeError,
)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: tuple[torch.dtype, ...], sep: str = ", ") -> str:
    return sep.join(str(d).removeprefix("torch.") for d in dtypes)


def not_a_tensor(name: str, value: object, what: str,
                 dtypes: tuple[torch.dtype, ...] | None = None) -> OpsTypeError:
    """The error for a non-tensor ``value`` passed as tensor argument ``name`` (error path)."""
    of = f" of {_names(dtypes, ' or ')}" if dtypes else ""
    got = "None" if value is None else f"{type(value).__name__} {reprlib.repr(value)}"
    hint = ""
    if isinstance(value, (list, tuple, int, float)) or hasattr(value, "__array__"):
        dtype = f", dtype=torch.{_names(dtypes[:1])}" if dtypes else ""
        hint = f"; convert it with torch.tensor(...{dtype}) on the op's device"
    return OpsTypeError(f"{name} must be a torch.Tensor, {what}{of}; got {got}{hint}")


def check_tensor(name: str, t: object, what: str,
                 dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """``t`` is a tensor (``what`` describes the expected layout, for the message)."""
    if not isinstance(t, torch.Tensor):
        raise not_a_tensor(name, t, what, dtypes)


def check_rank(name: str, t: torch.Tensor, ndim: int, layout: str,
               dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """``t`` is an ``ndim``-D tensor (and of one of ``dtypes`` when given)."""
    if not isinstance(t, torch.Tensor):
        raise not_a_tensor(name, t, f"{ndim}-D {layout}", dtypes)
    if t.dim() != ndim:
        raise OpsShapeError(f"{name} must be {ndim}-D {layout}; got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise OpsDTypeError(f"{name} has dtype {t.dtype}; allowed: {_names(dtypes)}")


def check_scale(scale: object) -> None:
    """The softmax scale is a Python number."""
    if not isinstance(scale, (float, int)) or isinstance(scale, bool):
        got = "None" if scale is None else f"{type(scale).__name__} {reprlib.repr(scale)}"
        raise OpsTypeError(f"scale must be a Python float (usually head_dim ** -0.5); got {got}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise OpsDTypeError(f"{name} has dtype {t.dtype}; allowed: {_names(allowed)}")


def check_same_device(*named: tuple[str, torch.Tensor | None]) -> None:
    device = named[0][1].device
    for name, t in named[1:]:
        if t is not None and t.device != device:
            raise OpsDeviceError(f"{name} is on {t.device} but {named[0][0]} is on {device}; "
                                 "move every argument of the op to one device")


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise OpsShapeError(f"{name}.shape[{dim}] is {t.shape[dim]} but {what} is {expected}; "
                            f"got shape {tuple(t.shape)}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> None:
    """K/V caches [num_blocks, block_size, num_kv_heads, head_dim], same shape and dtype; int8
    caches need float32 scales [num_blocks, block_size, num_kv_heads]."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_rank("k_cache", k_cache, 4, layout, CACHE_DTYPES)
    check_tensor("v_cache", v_cache, f"4-D {layout}", CACHE_DTYPES)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise OpsShapeError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
                            f"{tuple(k_cache.shape)} {k_cache.dtype}")
    is_int8 = k_cache.dtype == torch.int8
    if is_int8 != (k_scale is not None) or is_int8 != (v_scale is not None):
        raise OpsDTypeError("k_scale and v_scale are required with int8 caches and not allowed "
                            f"otherwise; caches are {k_cache.dtype}, k_scale "
                            f"{'given' if k_scale is not None else 'None'}, v_scale "
                            f"{'given' if v_scale is not None else 'None'}")
    if is_int8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(name, s, "[num_blocks, block_size, num_kv_heads]", (torch.float32,))
            check_dtype(name, s, (torch.float32,))
            if s.shape != k_cache.shape[:3]:
                raise OpsShapeError(f"{name} must be [num_blocks, block_size, num_kv_heads] = "
                                    f"{tuple(k_cache.shape[:3])}; got {tuple(s.shape)}")


def check_compute_dtype(name: str, t: torch.Tensor, cache: torch.Tensor) -> None:
    check_dtype(name, t, FLOAT_DTYPES)
    if cache.dtype != torch.int8 and cache.dtype != t.dtype:
        raise OpsDTypeError(f"{name} is {t.dtype} but the cache is {cache.dtype}; use a cache of "
                            f"the same dtype, or an int8 cache with scales")


def check_heads(name: str, t: torch.Tensor, k_cache: torch.Tensor) -> None:
    """``t``: [..., num_heads, head_dim] with num_heads a multiple of the cache's KV heads."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if t.shape[-1] != head_dim:
        raise OpsShapeError(f"{name} head_dim {t.shape[-1]} != cache head_dim {head_dim}")
    if t.shape[-2] % num_kv_heads:
        raise OpsShapeError(f"{name} has {t.shape[-2]} heads, not a multiple of the cache's "
                            f"{num_kv_heads} KV heads (GQA needs num_heads = k * num_kv_heads)")


def check_lengths(name: str, lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                  num_blocks: int) -> int:
    """Value checks for the PyTorch paths: 0 <= lens <= table capacity, and every block id a
    sequence uses lies in [0, num_blocks). Returns max(lens) (0 for an empty batch)."""
    if lens.numel() == 0:
        return 0
    low, high = int(lens.min()), int(lens.max())
    capacity = block_tables.shape[1] * block_size
    if low < 0:
        raise BlockTableError(f"{name} has a negative entry ({low}); lengths must be >= 0")
    if high > capacity:
        raise BlockTableError(f"a sequence needs {high} cached tokens but block_tables holds "
                              f"{block_tables.shape[1]} blocks x {block_size} = {capacity}; "
                              "pass a wider block table (allocate more blocks)")
    used = torch.arange(block_tables.shape[1], device=lens.device) * block_size < lens[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        seq, col = (int(i) for i in bad.nonzero()[0])
        raise BlockTableError(f"block_tables[{seq}, {col}] = {int(block_tables[seq, col])} is "
                              f"used but outside the cache's {num_blocks} blocks")
    return high
