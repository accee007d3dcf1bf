"""Per-token layer ops: RMSNorm (optionally fused with the residual add), RoPE, SiLU-and-mul.

RoPE cache row p = [cos(p * f_0) .. cos(p * f_{r/2-1}) | sin(p * f_0) .. sin(p * f_{r/2-1})]
(r = rotary dim <= head_dim; dims past r pass through). Pairs rotated by frequency f_i:

    is_neox=True  (Llama, Qwen):  (x[i], x[i + r/2])      rotate halves
    is_neox=False (GPT-J):        (x[2i], x[2i + 1])      rotate interleaved pairs
"""

from __future__ import annotations

import torch

from mooncake_ops._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_dtype,
    check_rank,
    check_same_device,
)
from mooncake_ops.dispatch import impl
from mooncake_ops.errors import OpsShapeError

__all__ = ["rms_norm", "rotary_embedding", "silu_and_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, in fp32, returned in x's dtype.

    With ``residual``: ``h = x + residual`` (rounded to x's dtype), returns
    ``(rms_norm(h) * weight, h)`` — the Llama pre-norm's fused add.

    Raises:
        OpsShapeError, OpsDTypeError: weight not [hidden]; residual not shaped like x.
    """
    check_dtype("x", x, FLOAT_DTYPES)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise OpsShapeError(f"weight must be [hidden] = [{x.shape[-1]}]; got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise OpsShapeError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                            f"{tuple(x.shape)} {x.dtype}")
    return impl("rms_norm", x.device.type)(x, weight, eps, residual)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, *,
                     is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions; returns new (q, k) tensors.

    Args:
        positions: int64 [num_tokens].
        q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim].
        cos_sin_cache: [max_position, rotary_dim] from `build_rope_cache`.
        is_neox: rotate halves (Llama) or interleaved pairs (GPT-J).

    Raises:
        OpsShapeError: shapes disagree; BlockTableError: a position beyond the cache.
    """
    check_rank("positions", positions, 1, "[num_tokens]")
    check_dtype("positions", positions, INDEX_DTYPES)
    for name, t in (("q", q), ("k", k)):
        check_rank(name, t, 3, "[num_tokens, heads, head_dim]")
        check_dim(name, t, 0, positions.shape[0], "num_tokens (positions.shape[0])")
    check_rank("cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]")
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > q.shape[-1] or q.shape[-1] != k.shape[-1]:
        raise OpsShapeError(f"rotary_dim {rot} must be even and <= head_dim; q head_dim "
                            f"{q.shape[-1]}, k head_dim {k.shape[-1]} must be equal")
    check_same_device(("q", q), ("k", k), ("positions", positions),
                      ("cos_sin_cache", cos_sin_cache))
    return impl("rotary_embedding", q.device.type)(positions, q, k, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., 2d] -> ``silu(x[..., :d]) * x[..., d:]`` (the SwiGLU gate)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise OpsShapeError(f"silu_and_mul needs an even last dim [..., 2*d]; got {tuple(x.shape)}")
    return impl("silu_and_mul", x.device.type)(x)
