"""Int8 KV quantisation: one float32 scale per token per head (symmetric, round half to even).

    x[token, head, :]  (head_dim floats)
        absmax = max |x|            scale = absmax / 127        q = rint(x * (127 / absmax))
        dequantised = q * scale     (a zero vector gets scale 0 and q = 0)

The native kernels compute exactly these float32 operations, so both paths store identical
bytes. Memory per cached element drops from 2 bytes (bf16) to 1 + 4 / head_dim.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_int8", "quantize_int8"]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [..., head_dim] per vector.

    Returns:
        (q int8 [..., head_dim], scale float32 [...]).
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1)
    # tensor / tensor is an IEEE division; ``127.0 / absmax`` would be reciprocal-then-multiply
    # in torch, which rounds differently from the native kernel's division.
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)
    q = torch.round(xf * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, absmax / 127.0


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_int8`: q [..., head_dim] * scale [...] in ``dtype``."""
    return (q.float() * scale[..., None]).to(dtype)
