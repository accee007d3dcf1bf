"""`MLAConfig`: DeepSeek-V2/V3's multi-head latent attention, as ``config.json`` states it.

Each token of a layer caches one vector of ``kv_lora_rank + qk_rope_head_dim`` values (the
normalised latent c_kv and the RoPE'd shared key part k_pe), the same on every TP rank; the
pool holds it as a latent layout (mooncake_kv's ``num_parts`` 1: one "head" of that width).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from kthena_core.model_spec import ModelSpec
from kthena_serve.model.errors import UnsupportedModelError


@attrs.frozen
class MLAConfig:
    """The latent attention of a DeepSeek-V2/V3 checkpoint.

    Attributes:
        kv_lora_rank: width of the cached latent c_kv.
        q_lora_rank: width of the query's low-rank bottleneck (0: a plain q_proj).
        qk_rope_head_dim: per head, the query / key dims that RoPE rotates (k's shared by all
            heads and cached).
        qk_nope_head_dim: per head, the query / key dims without position.
        v_head_dim: per head, the value width.
        rope_is_neox: RoPE rotates halves (True) or interleaved pairs (DeepSeek's own layout:
            V2 always, V3 with ``rope_interleave``).
        softmax_scale: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times YaRN's mscale
            squared when the RoPE scaling sets ``mscale_all_dim``.
    """

    kv_lora_rank: int
    q_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    rope_is_neox: bool
    softmax_scale: float

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_config(config: Mapping[str, Any], spec: ModelSpec,
               rope_scaling: Mapping[str, Any] | None) -> MLAConfig | None:
    """The `MLAConfig` of a parsed ``config.json`` (None unless it sets ``kv_lora_rank``).

    Raises:
        UnsupportedModelError: attention biases, or a RoPE dim that is odd.
    """
    if not spec.is_mla:
        return None
    if config.get("attention_bias"):
        raise UnsupportedModelError(f"{spec.architecture} with attention_bias=true is not "
                                    "supported; allowed: attention_bias=false")
    if spec.qk_rope_head_dim % 2 or spec.qk_rope_head_dim <= 0:
        raise UnsupportedModelError(f"qk_rope_head_dim={spec.qk_rope_head_dim} must be even "
                                    "and > 0 (RoPE rotates pairs)")
    v3 = "DeepseekV3ForCausalLM" in (config.get("architectures") or ())
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    mscale_all_dim = (rope_scaling or {}).get("mscale_all_dim")
    factor = float((rope_scaling or {}).get("factor", 1.0))
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return MLAConfig(spec.kv_lora_rank, spec.q_lora_rank, spec.qk_rope_head_dim,
                     spec.qk_nope_head_dim, spec.v_head_dim,
                     rope_is_neox=v3 and not config.get("rope_interleave", True),
                     softmax_scale=scale)
