"""Where an MoE layer's checkpoint tensors go in `SparseMoE`, for this rank.

Per layer, under the family's prefix P (``mlp``; Mixtral ``block_sparse_moe``) and expert
names (gate, up, down) (``gate_proj, up_proj, down_proj``; Mixtral ``w1, w3, w2``)::

    P.gate.weight [E, hidden]                -> router_weight, whole
    P.gate.e_score_correction_bias [E]       -> correction_bias, whole (DeepSeek-V3)
    P.experts.e.gate [I, hidden]             -> experts_gate_up[e][:w], this rank's rows
    P.experts.e.up   [I, hidden]             -> experts_gate_up[e][w:]
    P.experts.e.down [hidden, I]             -> experts_down[e], this rank's columns
    P.shared_experts.{gate,up,down}_proj     -> shared (DeepSeek), split like a dense MLP
"""

from __future__ import annotations

import re

import torch

from kthena_serve.model.moe import SparseMoE
from kthena_serve.model.moe_config import MoEConfig
from kthena_serve.model.tp import ShardPlan

# (destination, dim the source is sliced on (None: whole), source range, source size on it)
Target = tuple[torch.Tensor, int | None, range | None, int | None]
_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")
_SHARED = ("gate_proj", "up_proj", "down_proj")


def moe_weight_names(moe: MoEConfig, experts: range | None = None) -> list[str]:
    """The tensor names (below ``model.layers.N.``) an MoE layer's checkpoint must hold for
    ``experts`` (None: all of them; under expert parallelism a rank reads its own)."""
    p = moe.prefix
    names = [f"{p}.gate.weight"]
    if moe.correction_bias:
        names.append(f"{p}.gate.e_score_correction_bias")
    names += [f"{p}.experts.{e}.{n}.weight" for e in experts or range(moe.num_experts)
              for n in moe.expert_names]
    if moe.shared_intermediate_size:
        names += [f"{p}.shared_experts.{n}.weight" for n in _SHARED]
    return names


def moe_target(layer: SparseMoE, plan: ShardPlan, moe: MoEConfig, name: str) -> Target | None:
    """Where tensor ``name`` (below ``model.layers.N.``) goes, or None if nowhere here (another
    rank's expert, or a name this family does not have)."""
    rest = name.removeprefix(f"{moe.prefix}.")
    if rest == "gate.weight":
        return layer.router_weight, None, None, None
    if rest == "gate.e_score_correction_bias" and layer.correction_bias is not None:
        return layer.correction_bias, None, None, None
    if rest.startswith("shared_experts.") and layer.shared is not None:
        kind = rest.removeprefix("shared_experts.").removesuffix(".weight")
        return _swiglu_target(layer.shared.gate_up_weight, layer.shared.down_weight, kind,
                              _SHARED, plan.shared_intermediate, moe.shared_intermediate_size)
    match = _EXPERT.match(rest)
    if match is None or not plan.experts.start <= int(match.group(1)) < plan.experts.stop:
        return None
    e = int(match.group(1)) - plan.experts.start
    return _swiglu_target(layer.experts_gate_up[e], layer.experts_down[e], match.group(2),
                          moe.expert_names, plan.expert_intermediate, moe.intermediate_size)


def _swiglu_target(gate_up: torch.Tensor, down: torch.Tensor, kind: str,
                   names: tuple[str, str, str], columns: range, full: int) -> Target | None:
    width = len(columns)
    gate, up, down_name = names
    if kind == gate:
        return gate_up[:width], 0, columns, full
    if kind == up:
        return gate_up[width:], 0, columns, full
    if kind == down_name:
        return down, 1, columns, full
    return None
