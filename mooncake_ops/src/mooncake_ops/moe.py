"""Mixture-of-experts compute: the router's top-k choice and the grouped expert matmul.

`route_experts` turns a router's logits into each token's ``top_k`` experts and their weights,
by one of the rules the served families use (`RoutingRule`):

    Mixtral, Qwen3-MoE   softmax over all experts, top-k, renormalised over the k (Qwen3-MoE:
                         only with ``norm_topk_prob``)
    DeepSeek-V2          softmax; "greedy" top-k, or "group_limited_greedy": keep the
                         ``topk_groups`` groups with the highest best score, top-k within them;
                         times ``routed_scaling_factor``
    DeepSeek-V3          sigmoid; the choice adds the score-correction bias (the weights do
                         not); groups ranked by the sum of their two best biased scores;
                         renormalised (``norm_topk_prob``), times ``routed_scaling_factor``

`fused_experts` runs every token through its experts' SwiGLU MLPs and sums them, weighted: the
token-expert pairs are sorted by expert, so each expert runs one matmul pair over all of its
tokens (a grouped matmul), and the results are scattered back with one weighted ``index_add``.
`fused_experts_reference` is the per-token loop it must equal (up to summation order).
`run_experts` is the same computation over experts packed once at load for the grouped kernels
a measurement chose (`mooncake_ops.moe_kernels`, `mooncake_ops.moe_selection`):

    choice = choose_moe_kernels("auto", gate_up, down, top_k, cache_dir=...)  # once, at load
    experts = pack_experts(gate_up, down, **choice.pack_args())               # per layer
    y = run_experts(x, weights, ids, experts)                                 # per step

The pipeline every path shares: `sort_pairs` (pairs on this rank's experts, sorted by expert),
the grouped matmul over the gathered rows, and `weighted_sum` (one float32 ``index_add``).

Under expert parallelism a rank holds experts ``expert_start .. expert_start + E_local - 1``;
pairs routed elsewhere contribute nothing here, and summing over the ranks gives the whole.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from mooncake_ops._moe_traffic import weighted_sum
from mooncake_ops._validate import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_rank
from mooncake_ops.errors import OpsDTypeError, OpsShapeError
from mooncake_ops.moe_kernels import LOOP, ExpertWeights

__all__ = ["RoutingRule", "SortedPairs", "check_routing", "experts_float32", "fused_experts",
           "fused_experts_reference", "route_experts", "run_experts", "sort_pairs",
           "weighted_sum"]

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


def _choice(allowed: tuple[str, ...]):
    def check(_inst: object, attribute: attrs.Attribute, value: str) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name}={value!r} is not a routing rule's; allowed: "
                             f"{', '.join(allowed)}")
    return check


@attrs.frozen
class RoutingRule:
    """How a router's logits choose experts (see the module docstring for each family's rule).

    Attributes:
        top_k: experts per token.
        scoring: ``softmax`` or ``sigmoid`` of the logits, in float32.
        renormalize: divide the k chosen weights by their sum.
        num_groups: experts fall into this many equal groups (1: no grouping).
        topk_groups: the groups a token may choose from (``num_groups``: all).
        group_score: how a group is ranked: its best score (``max``) or the sum of its two best
            (``top2_sum``; with the correction bias added).
        scaling: the routed weights are multiplied by it (DeepSeek's routed_scaling_factor).
    """

    top_k: int
    scoring: str = attrs.field(default="softmax", validator=_choice(SCORINGS))
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = attrs.field(default="max", validator=_choice(GROUP_SCORES))
    scaling: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k={self.top_k}: a token goes to at least 1 expert")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups={self.topk_groups} must be in 1..num_groups="
                             f"{self.num_groups}")

    def check_experts(self, num_experts: int) -> None:
        """Raise ValueError unless this rule can route over ``num_experts`` experts."""
        if num_experts % self.num_groups:
            raise ValueError(f"{num_experts} experts do not split into num_groups="
                             f"{self.num_groups} equal groups")
        reachable = num_experts // self.num_groups * self.topk_groups
        if self.top_k > reachable:
            raise ValueError(f"top_k={self.top_k} exceeds the {reachable} experts the "
                             f"{self.topk_groups} chosen groups hold")


def route_experts(logits: torch.Tensor, rule: RoutingRule,
                  correction_bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights: ([T, top_k] float32 weights, [T, top_k] int64 ids).

    Args:
        logits: [T, E] router logits (any float dtype; scored in float32).
        rule: the family's `RoutingRule`.
        correction_bias: [E], added to the scores for the choice only (DeepSeek-V3); None: none.

    Raises:
        OpsShapeError: logits not [T, E], or the bias not [E].
        ValueError: the rule cannot route over E experts.
    """
    check_rank("logits", logits, 2, "[num_tokens, num_experts]")
    check_dtype("logits", logits, FLOAT_DTYPES)
    num_experts = logits.shape[1]
    rule.check_experts(num_experts)
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise OpsShapeError(f"correction_bias must be [num_experts] = [{num_experts}]; got "
                            f"{tuple(correction_bias.shape)}")
    logits = logits.float()
    scores = logits.softmax(-1) if rule.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if rule.topk_groups < rule.num_groups:
        choice = _keep_best_groups(choice, rule)
    ids = torch.topk(choice, rule.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if rule.scaling != 1.0:
        weights = weights * rule.scaling
    return weights, ids


def _keep_best_groups(choice: torch.Tensor, rule: RoutingRule) -> torch.Tensor:
    """``choice`` with every expert outside each token's ``topk_groups`` best groups at -inf."""
    grouped = choice.view(choice.shape[0], rule.num_groups, -1)
    if rule.group_score == "max":
        group_scores = grouped.max(-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    best = torch.topk(group_scores, rule.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


def check_routing(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """x [T, H] floating, ids [T, top_k] int32/int64 and weights [T, top_k] floating.

    Raises:
        OpsTypeError, OpsShapeError, OpsDTypeError: naming the argument and what it must be.
    """
    check_rank("x", x, 2, "[num_tokens, hidden]", FLOAT_DTYPES)
    check_rank("ids", ids, 2, "[num_tokens, top_k]", INDEX_DTYPES)
    check_rank("weights", weights, 2, "[num_tokens, top_k]", FLOAT_DTYPES)
    want = (x.shape[0], ids.shape[1])
    for name, tensor in (("ids", ids), ("weights", weights)):
        if tuple(tensor.shape) != want:
            raise OpsShapeError(f"{name} must be [num_tokens, top_k] = {list(want)} for x "
                                f"{list(x.shape)} and ids {list(ids.shape)}; got "
                                f"{list(tensor.shape)}")


def _check_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor) -> None:
    check_routing(x, weights, ids)
    check_rank("gate_up", gate_up, 3, "[experts, 2 * intermediate, hidden]")
    check_rank("down", down, 3, "[experts, hidden, intermediate]")
    experts, two_inter, hidden = gate_up.shape
    if two_inter % 2:
        raise OpsShapeError(f"gate_up's rows ({two_inter}) must be gate and up stacked: even")
    want = {"gate_up": (experts, two_inter, x.shape[1]),
            "down": (experts, x.shape[1], two_inter // 2)}
    for name, tensor in (("gate_up", gate_up), ("down", down)):
        if tuple(tensor.shape) != want[name]:
            raise OpsShapeError(f"{name} must be {list(want[name])} for x {list(x.shape)} and "
                                f"gate_up {list(gate_up.shape)}; got {list(tensor.shape)}")
    for name, tensor in (("gate_up", gate_up), ("down", down)):
        if tensor.dtype != x.dtype:
            raise OpsDTypeError(f"{name} is {tensor.dtype} but x is {x.dtype}; the experts "
                                "run in x's dtype")


@attrs.frozen(eq=False)  # holds tensors: identity, not elementwise, equality
class SortedPairs:
    """A batch's token-expert pairs on this rank's experts, sorted by expert (stable).

    Attributes:
        pair_of: [P] sorted position -> flat pair index ``token * top_k + slot``.
        counts: pairs per local expert (E_local entries, summing to P).
        top_k: experts per token.
    """

    pair_of: torch.Tensor
    counts: tuple[int, ...]
    top_k: int

    @property
    def tokens(self) -> torch.Tensor:
        """[P] the token of each sorted pair."""
        return self.pair_of // self.top_k


def sort_pairs(ids: torch.Tensor, num_local: int, expert_start: int = 0) -> SortedPairs:
    """The pairs of ``ids`` [T, top_k] whose expert is one of ``expert_start ..
    expert_start + num_local - 1``, sorted by expert (ties keep token order)."""
    top_k = ids.shape[1]
    local = ids.reshape(-1) - expert_start
    mine = (local >= 0) & (local < num_local)
    pairs = None if bool(mine.all()) else mine.nonzero().squeeze(1)
    if pairs is not None:
        local = local[pairs]
    order = torch.argsort(local, stable=True)
    counts = tuple(torch.bincount(local, minlength=num_local).tolist())
    return SortedPairs(order if pairs is None else pairs[order], counts, top_k)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, *,
                  expert_start: int = 0) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for each token t, over the experts
    this rank holds: [T, hidden] in x's dtype.

    Each expert is a SwiGLU MLP: ``down_e @ (silu(gate_e @ x) * (up_e @ x))``, with
    ``gate_up[e]`` = [gate rows | up rows] ([2I, H]) and ``down[e]`` = [H, I]. Pairs whose
    expert is outside ``expert_start .. expert_start + experts - 1`` are skipped. The grouped
    matmul is the torch loop (`moe_kernels.LOOP`); `run_experts` runs a measured choice.

    Raises:
        OpsShapeError, OpsDTypeError: the tensors disagree (see the shapes above).
    """
    _check_experts(x, weights, ids, gate_up, down)
    pairs = sort_pairs(ids, gate_up.shape[0], expert_start)
    rows = x.index_select(0, pairs.tokens)
    out_rows = LOOP.run(rows, pairs.counts, (gate_up, down))
    return weighted_sum(out_rows, weights, pairs.pair_of, x.shape[0]).to(x.dtype)


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                experts: ExpertWeights) -> torch.Tensor:
    """`fused_experts` over experts packed once for their chosen kernels (`pack_experts`):
    [T, hidden] in x's dtype, over the experts ``experts`` holds.

    Raises:
        OpsShapeError, OpsDTypeError: x, weights and ids disagree with each other or with
            the experts' hidden size and dtype.
    """
    return experts_float32(x, weights, ids, experts).to(x.dtype)


def experts_float32(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: ExpertWeights) -> torch.Tensor:
    """`run_experts` before its final rounding: the weighted sums in float32."""
    check_routing(x, weights, ids)
    if x.shape[1] != experts.hidden:
        raise OpsShapeError(f"x is {list(x.shape)}; the experts take hidden size "
                            f"{experts.hidden}")
    if x.dtype != experts.dtype:
        raise OpsDTypeError(f"x is {x.dtype}; the experts are {experts.dtype} (cast x, or "
                            "pack the experts in x's dtype)")
    pairs = sort_pairs(ids, experts.num_experts, experts.expert_start)
    out_rows = experts.run_sorted(x.index_select(0, pairs.tokens), pairs.counts)
    return weighted_sum(out_rows, weights, pairs.pair_of, x.shape[0])


def fused_experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                            gate_up: torch.Tensor, down: torch.Tensor, *,
                            expert_start: int = 0) -> torch.Tensor:
    """`fused_experts` one token and one chosen expert at a time, in float32 (the reference)."""
    _check_experts(x, weights, ids, gate_up, down)
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - expert_start
            if 0 <= e < gate_up.shape[0]:
                h = gate_up[e].float() @ x[t].float()
                h = F.silu(h[:inter]) * h[inter:]
                out[t] += float(weights[t, j]) * (down[e].float() @ h)
    return out.to(x.dtype)
