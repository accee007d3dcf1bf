"""Int8 KV quantisation: one float32 scale per token per head (symmetric, round half to even).

    x[token, head, :]  (head_dim floats)
        absmax = max |x|            scale = absmax / 127        q = rint(x * (127 / absmax))
        dequantised = q * scale     (a zero vector gets scale 0 and q = 0)

The native kernels compute exactly these float32 operations, so both paths store identical
bytes. Memory per cached element drops from 2 bytes (bf16) to 1 + 4 / head_dim.
"""

from __future__ import annotations

import torch

from mooncake_ops._validate import check_tensor
from mooncake_ops.errors import OpsDTypeError, OpsShapeError, OpsTypeError

__all__ = ["dequantize_int8", "quantize_int8", "unpack_int8_rows"]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [..., head_dim] per vector.

    Returns:
        (q int8 [..., head_dim], scale float32 [...]).

    Raises:
        OpsTypeError: ``x`` is not a tensor.  OpsDTypeError: not floating point.
        OpsShapeError: ``x`` is 0-D.
    """
    check_tensor("x", x, "floating point [..., head_dim]")
    if not x.is_floating_point():
        raise OpsDTypeError(f"x has dtype {x.dtype}; quantize_int8 takes a floating point "
                            "tensor [..., head_dim]")
    if x.dim() == 0:
        raise OpsShapeError("x must be [..., head_dim] (at least 1-D); got a 0-D tensor")
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)
    # tensor / tensor is an IEEE division; ``127.0 / absmax`` would be reciprocal-then-multiply
    # in torch, which rounds differently from the native kernel's division.
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)
    q = torch.round(xf * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, absmax / 127.0


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_int8`: q [..., head_dim] * scale [...] in ``dtype``.

    Raises:
        OpsTypeError: ``q`` or ``scale`` is not a tensor, or ``dtype`` not a torch.dtype.
        OpsDTypeError: ``q`` is not int8.  OpsShapeError: ``scale`` is not ``q.shape[:-1]``.
    """
    check_tensor("q", q, "int8 [..., head_dim]", (torch.int8,))
    check_tensor("scale", scale, "[...] (q.shape[:-1])", (torch.float32,))
    if not isinstance(dtype, torch.dtype):
        raise OpsTypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16); got "
                           f"{type(dtype).__name__} {dtype!r}")
    if q.dtype != torch.int8:
        raise OpsDTypeError(f"q has dtype {q.dtype}; dequantize_int8 takes quantize_int8's int8 q")
    if q.dim() == 0 or scale.shape != q.shape[:-1]:
        raise OpsShapeError(f"scale must have shape q.shape[:-1] = {tuple(q.shape[:-1])}; got "
                            f"{tuple(scale.shape)} (q is {tuple(q.shape)})")
    return (q.float() * scale[..., None]).to(dtype)


def unpack_int8_rows(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight packed by ``mooncake_ops.pack_int8_weight`` ([N, K + 4]: each row's K
    values, then its float32 scale's 4 bytes) -> (q int8 [N, K] view, scale float32 [N, 1])."""
    k = packed.shape[1] - 4
    return packed[:, :k], packed[:, k:].contiguous().view(torch.float32)
