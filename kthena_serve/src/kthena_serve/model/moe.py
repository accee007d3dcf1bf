"""`SparseMoE`: an MoE layer's feed-forward, for this rank's share of every expert.

The router (``router_weight`` [E, hidden], DeepSeek-V3's ``correction_bias`` [E]) is replicated
and scored in float32 (`mooncake_ops.route_experts`); every rank routes the same tokens the
same way. Each routed expert's SwiGLU is split over the TP ranks like the dense MLP (gate/up
rows, down columns), stacked as ``experts_gate_up`` [E, 2w, hidden] and ``experts_down``
[E, hidden, w]; `mooncake_ops.fused_experts` runs them as a grouped matmul, weighted (once
packed, `mooncake_ops.run_experts` with the grouped kernels measured fastest here), and the
shared experts (DeepSeek) add their own partial output. One all-reduce then sums the ranks'
partial outputs, as the dense MLP's row-parallel down projection does; under sequence
parallelism the tokens are all-gathered first and the sum reduce-scattered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kthena_serve.model.moe_config import MoEConfig
from kthena_serve.model.sp import TokenShards
from kthena_serve.model.tp import ShardPlan, TensorParallel
from mooncake_ops import fused_experts, pack_experts, route_experts, run_experts, silu_and_mul
from mooncake_ops.moe_kernels import ExpertWeights
from mooncake_ops.moe_selection import MoEKernelChoice


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class SharedExperts(nn.Module):
    """DeepSeek's shared experts: one SwiGLU MLP of their total width, this rank's columns.
    Its partial output is added to the routed experts' before the layer's one all-reduce."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_weight = _empty(2 * width, hidden)
        self.down_weight = _empty(hidden, width)
        self.matmul = F.linear  # a packed kernel on CPU (the model's pack_linear_weights)
        self.gate_up_silu = None  # the packed kernel's fused SwiGLU input, when it has one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_silu is not None:
            hidden = self.gate_up_silu(x, self.gate_up_weight)
        else:
            hidden = silu_and_mul(self.matmul(x, self.gate_up_weight))
        return self.matmul(hidden, self.down_weight)


class SparseMoE(nn.Module):
    """The routed (and shared) experts of one layer, for this rank (see the module docs)."""

    def __init__(self, moe: MoEConfig, hidden: int, plan: ShardPlan,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.rule = moe.rule
        width, experts = len(plan.expert_intermediate), len(plan.experts)
        self.expert_start = plan.experts.start
        self.router_weight = _empty(moe.num_experts, hidden)
        self.correction_bias = _empty(moe.num_experts) if moe.correction_bias else None
        self.experts_gate_up = _empty(experts, 2 * width, hidden)
        self.experts_down = _empty(experts, hidden, width)
        self.shared = (SharedExperts(hidden, len(plan.shared_intermediate))
                       if moe.shared_intermediate_size else None)
        self.tp = tp
        self.packed: ExpertWeights | None = None  # the experts laid out for their kernels

    def pack(self, choice: MoEKernelChoice) -> None:
        """Lay the experts out for the grouped kernels ``choice`` names (the last step of
        loading, as for the dense weights); the dense copies are dropped."""
        self.packed = pack_experts(self.experts_gate_up, self.experts_down,
                                   **choice.pack_args(), expert_start=self.expert_start)
        for name in ("experts_gate_up", "experts_down"):
            self._parameters.pop(name)
            setattr(self, name, None)

    def forward(self, x: torch.Tensor, shards: TokenShards | None = None) -> torch.Tensor:
        if shards is not None:
            x = shards.gather(x)
        logits = F.linear(x.float(), self.router_weight.float())
        bias = None if self.correction_bias is None else self.correction_bias.float()
        weights, ids = route_experts(logits, self.rule, bias)
        if self.packed is not None:
            out = run_experts(x, weights, ids, self.packed)
        else:
            out = fused_experts(x, weights, ids, self.experts_gate_up, self.experts_down,
                                expert_start=self.expert_start)
        if self.shared is not None:
            out = out + self.shared(x)
        if shards is not None:
            return shards.scatter_sum(out)
        return out if self.tp.world_size == 1 else self.tp.all_reduce(out)
