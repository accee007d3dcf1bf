"""`MoEConfig`: what a mixture-of-experts checkpoint's ``config.json`` says about its experts.

One value for the served MoE families, read from each one's own keys:

    Mixtral      num_local_experts, intermediate_size; softmax top-k, renormalised; tensors
                 ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.E.w1/w3/w2``
    Qwen3-MoE    num_experts, moe_intermediate_size; softmax top-k, renormalised only with
                 norm_topk_prob; dense layers: mlp_only_layers, and every layer i with
                 (i + 1) % decoder_sparse_step != 0
    DeepSeek-V2  n_routed_experts, moe_intermediate_size, n_shared_experts; softmax, "greedy"
                 or "group_limited_greedy" top-k, times routed_scaling_factor; the first
                 first_k_dense_replace layers dense
    DeepSeek-V3  as V2 with sigmoid scores, the score-correction bias ("noaux_tc") and groups
                 ranked by their two best scores; renormalised (norm_topk_prob)

The other families' tensors are ``mlp.gate``, ``mlp.experts.E.gate_proj/up_proj/down_proj`` and
(DeepSeek) ``mlp.shared_experts.*``. Options the model does not implement are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kthena_serve.model.errors import CheckpointError, ModelError, UnsupportedModelError
from mooncake_ops.moe import RoutingRule

MOE_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM",
                               "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})


@attrs.frozen
class MoEConfig:
    """The experts of an MoE model.

    Attributes:
        num_experts: routed experts per MoE layer.
        rule: how the router chooses (mooncake_ops' `RoutingRule`).
        intermediate_size: each routed expert's SwiGLU width.
        shared_intermediate_size: the always-on shared experts' total width (0: none).
        correction_bias: the router has DeepSeek-V3's ``e_score_correction_bias``.
        dense_layers: layers with a dense MLP (the model's ``intermediate_size``) instead.
        prefix: the checkpoint's name of a layer's MoE block (``mlp``; Mixtral's
            ``block_sparse_moe``).
        expert_names: an expert's (gate, up, down) tensor names.
    """

    num_experts: int
    rule: RoutingRule
    intermediate_size: int
    shared_intermediate_size: int = 0
    correction_bias: bool = False
    dense_layers: frozenset[int] = frozenset()
    prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


def moe_config(config: Mapping[str, Any], num_layers: int) -> MoEConfig | None:
    """The `MoEConfig` of a parsed ``config.json``, or None for a dense architecture.

    Raises:
        UnsupportedModelError: an MoE option the model does not implement, or sizes that the
            routing rule cannot use.
    """
    archs = set(config.get("architectures") or ())
    try:
        if "MixtralForCausalLM" in archs:
            return _mixtral(config)
        if "Qwen3MoeForCausalLM" in archs:
            return _qwen3_moe(config, num_layers)
        if archs & {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}:
            return _deepseek(config, "DeepseekV3ForCausalLM" in archs)
    except ValueError as e:
        if isinstance(e, ModelError):
            raise
        raise UnsupportedModelError(f"the router config is not usable: {e}") from None
    return None


def _int(config: Mapping[str, Any], *keys: str) -> int:
    """The first of ``keys`` config.json sets (transformers 5 writes some under new names)."""
    for key in keys:
        if config.get(key) is not None:
            return int(config[key])
    raise CheckpointError(f"config.json lacks the required key {keys[0]!r}"
                          + (f" (or {', '.join(map(repr, keys[1:]))})" if keys[1:] else ""))


def _checked(moe: MoEConfig) -> MoEConfig:
    moe.rule.check_experts(moe.num_experts)
    return moe


def _mixtral(config: Mapping[str, Any]) -> MoEConfig:
    return _checked(MoEConfig(
        num_experts=_int(config, "num_local_experts"),
        rule=RoutingRule(_int(config, "num_experts_per_tok"), renormalize=True),
        intermediate_size=_int(config, "intermediate_size"),
        prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")))


def _qwen3_moe(config: Mapping[str, Any], num_layers: int) -> MoEConfig:
    step = int(config.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step={step} must be >= 1")
    dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    dense |= {i for i in range(num_layers) if (i + 1) % step}
    return _checked(MoEConfig(
        num_experts=_int(config, "num_experts", "num_local_experts"),
        rule=RoutingRule(_int(config, "num_experts_per_tok"),
                         renormalize=bool(config.get("norm_topk_prob", False))),
        intermediate_size=_int(config, "moe_intermediate_size"), dense_layers=frozenset(dense)))


def _deepseek(config: Mapping[str, Any], v3: bool) -> MoEConfig:
    arch = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
    method = config.get("topk_method", "noaux_tc" if v3 else "greedy")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise UnsupportedModelError(f"{arch} with topk_method={method!r} is not supported; "
                                    f"allowed: {', '.join(allowed)}")
    freq = int(config.get("moe_layer_freq", 1))
    if freq != 1:
        raise UnsupportedModelError(f"{arch} with moe_layer_freq={freq} is not supported; "
                                    "allowed: 1 (every layer after first_k_dense_replace is MoE)")
    renormalize = bool(config.get("norm_topk_prob", v3))
    if renormalize and not v3:
        # DeepSeek's own V2 code renormalises and then skips the scaling factor; transformers
        # ignores the key: the two disagree, and no released V2 checkpoint sets it
        raise UnsupportedModelError(f"{arch} with norm_topk_prob=true is not supported; "
                                    "allowed: norm_topk_prob=false")
    grouped = v3 or method == "group_limited_greedy"
    groups = int(config.get("n_group") or 1) if grouped else 1
    rule = RoutingRule(
        _int(config, "num_experts_per_tok"), scoring="sigmoid" if v3 else "softmax",
        renormalize=renormalize, num_groups=groups,
        topk_groups=int(config.get("topk_group") or 1) if grouped else 1,
        group_score="top2_sum" if v3 else "max",
        scaling=float(config.get("routed_scaling_factor", 1.0)))
    inter = _int(config, "moe_intermediate_size")
    return _checked(MoEConfig(
        num_experts=_int(config, "n_routed_experts"), rule=rule, intermediate_size=inter,
        shared_intermediate_size=inter * int(config.get("n_shared_experts") or 0),
        correction_bias=v3,
        dense_layers=frozenset(range(int(config.get("first_k_dense_replace") or 0)))))
