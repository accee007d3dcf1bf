"""RoPE cos/sin cache with the common ``rope_scaling`` variants of HF configs.

Frequencies f_i = theta ** (-2i / r), i < r/2 (r = rotary dim), then per ``rope_type``:

    linear   f_i / factor                                   (position interpolation)
    dynamic  theta' = theta * (factor * L / L0 - (factor - 1)) ** (r / (r - 2)), L = max_position
    llama3   long wavelengths (> L0 / low_freq_factor) / factor, short ones (< L0 /
             high_freq_factor) kept, a smooth blend between
    yarn     blend of f_i and f_i / factor by a linear ramp over the dims whose rotation count
             in L0 lies between beta_slow and beta_fast; cos/sin scaled by the attention factor

(L0 = ``original_max_position_embeddings``.) ``dynamic`` here is static: HF recomputes theta'
as the live sequence grows past L0; a fixed cache uses L = max_position, which matches HF once
the sequence reaches max_position (and differs, by design of that variant, before).
Computed in float64, returned in ``dtype``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mooncake_ops.errors import RopeScalingError

__all__ = ["build_rope_cache"]


def build_rope_cache(head_dim: int, max_position: int, rope_theta: float, *,
                     rope_scaling: Mapping[str, Any] | None = None,
                     dtype: torch.dtype = torch.float32, rotary_dim: int | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """The [max_position, rotary_dim] cache (cos half | sin half) for `rotary_embedding`.

    Raises:
        RopeScalingError: unknown ``rope_type`` or a missing field; ValueError: odd dims.
    """
    rot = head_dim if rotary_dim is None else rotary_dim
    if rot % 2 or rot > head_dim or max_position < 1:
        raise ValueError(f"rotary_dim {rot} must be even and <= head_dim {head_dim}; "
                         f"max_position {max_position} must be >= 1")
    inv_freq = rope_theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    inv_freq, attention_factor = _scaled(inv_freq, rot, max_position, rope_theta, rope_scaling)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
    return cache.to(dtype=dtype, device=device)


def _scaled(inv_freq, rot, max_position, theta, scaling) -> tuple[torch.Tensor, float]:
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    rule = _RULES.get(kind)
    if rule is None:
        raise RopeScalingError(f"rope_type {kind!r} is not supported; supported: "
                               f"{', '.join(sorted(_RULES))}")
    return rule(inv_freq, rot, max_position, theta, scaling)


def _field(scaling: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = scaling.get(name, default)
    if value is None:
        raise RopeScalingError(f"rope_scaling {dict(scaling)} lacks {name!r}, which its "
                               f"rope_type needs")
    return value


def _default(inv_freq, rot, max_position, theta, scaling):
    return inv_freq, 1.0


def _linear(inv_freq, rot, max_position, theta, scaling):
    return inv_freq / _field(scaling, "factor"), 1.0


def _dynamic(inv_freq, rot, max_position, theta, scaling):
    factor = _field(scaling, "factor")
    original = _field(scaling, "original_max_position_embeddings", max_position)
    if max_position <= original:
        return inv_freq, 1.0
    base = theta * (factor * max_position / original - (factor - 1)) ** (rot / (rot - 2))
    return base ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot), 1.0


def _llama3(inv_freq, rot, max_position, theta, scaling):
    factor = _field(scaling, "factor")
    low, high = _field(scaling, "low_freq_factor"), _field(scaling, "high_freq_factor")
    original = _field(scaling, "original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original / low, inv_freq / factor,
                       torch.where(wavelen < original / high, inv_freq, blended)), 1.0


def _yarn(inv_freq, rot, max_position, theta, scaling):
    factor = _field(scaling, "factor")
    original = _field(scaling, "original_max_position_embeddings", max_position)
    fast, slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def dim_of(num_rotations: float) -> float:  # dim whose rotation count in `original` is this
        return rot * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(fast)), 0)
    high = min(math.ceil(dim_of(slow)), rot - 1)
    span = (high - low) or 1e-3
    ramp = ((torch.arange(rot // 2, dtype=torch.float64) - low) / span).clamp(0.0, 1.0)
    extrapolated = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
    scaled = inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated
    return scaled, _yarn_attention_factor(scaling, factor)


def _yarn_attention_factor(scaling, factor) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if "mscale" in scaling and "mscale_all_dim" in scaling:  # DeepSeek-V2/V3 form
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


_RULES: dict[str, Callable[..., tuple[torch.Tensor, float]]] = {
    "default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3,
    "yarn": _yarn,
}
