"""Where a DeepSeek layer's attention tensors go in `MLAttention`, for this rank's heads.

    self_attn.q_proj / q_b_proj    [heads * (nope + rope), in]   rows of this rank's heads
    self_attn.q_a_proj, kv_a_proj_with_mqa, q_a_layernorm, kv_a_layernorm       whole
    self_attn.kv_b_proj            [heads * (nope + v), kv_lora_rank]  rows of this rank's heads
    self_attn.o_proj               [hidden, heads * v]           columns of this rank's heads
"""

from __future__ import annotations

import torch

from kthena_serve.model.mla import MLAttention
from kthena_serve.model.mla_config import MLAConfig
from kthena_serve.model.tp import ShardPlan

# (destination, dim the source is sliced on (None: whole), source range, source size on it)
Target = tuple[torch.Tensor, int | None, range | None, int | None]


def mla_weight_names(mla: MLAConfig) -> list[str]:
    """The attention tensor names (below ``model.layers.N.``) an MLA layer must hold."""
    q = (["q_a_proj", "q_a_layernorm", "q_b_proj"] if mla.q_lora_rank else ["q_proj"])
    return [f"self_attn.{n}.weight" for n in
            (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]


def mla_target(attn: MLAttention, plan: ShardPlan, mla: MLAConfig, num_heads: int,
               kind: str) -> Target | None:
    """Where attention tensor ``kind`` (e.g. ``self_attn.kv_b_proj``) goes, or None."""
    def rows(per_head: int) -> tuple[int, range, int]:
        return 0, range(plan.q_heads.start * per_head, plan.q_heads.stop * per_head), \
            num_heads * per_head

    name = kind.removeprefix("self_attn.")
    whole = {"q_a_proj": "q_a_weight", "q_a_layernorm": "q_a_norm",
             "kv_a_proj_with_mqa": "kv_a_weight", "kv_a_layernorm": "kv_a_norm"}
    if name in whole and hasattr(attn, whole[name]):
        return getattr(attn, whole[name]), None, None, None
    if name == "q_proj" and not mla.q_lora_rank:
        return (attn.q_weight, *rows(mla.qk_head_dim))
    if name == "q_b_proj" and mla.q_lora_rank:
        return (attn.q_b_weight, *rows(mla.qk_head_dim))
    if name == "kv_b_proj":
        return (attn.kv_b_weight, *rows(mla.qk_nope_head_dim + mla.v_head_dim))
    if name == "o_proj":
        _, cols, full = rows(mla.v_head_dim)
        return attn.o_weight, 1, cols, full
    return None
