"""Tensor parallelism as a plan applied from outside the model (gpt-fast style).

`TensorParallel` says who this process is (rank, world size) and how to sum partial results
(``all_reduce``). `plan_shards` is a pure function from the config and the rank to the slice of
heads and MLP columns the rank holds; the loader slices the weights with it and the model sizes
its layers with it. The model itself never calls a collective: its row-parallel layers (o_proj,
down_proj) call one op, ``tp.linear_all_reduce(x, weight, matmul)``, and under sequence
parallelism ``all_gather_linear`` / ``linear_reduce_scatter``. Without ``fused`` each is the
matmul and then the collective; with it (`kthena_serve.model.overlap`: MC2, compute-communication
overlap) each is one fused op that overlaps the two.

    q/k/v, gate/up   column-parallel: each rank holds its heads' rows / its MLP columns
    o, down          row-parallel: each rank holds the matching input columns; outputs summed
    MoE experts      each expert split like the MLP (its gate/up rows, its down columns); the
                     router and the routing are replicated, and one all-reduce sums the layer;
                     with expert parallelism each rank holds experts / tp whole experts instead
    norms            replicated: the layer norms act on the whole hidden vector, Qwen3's q/k
                     norms on each head alone, so every rank holds all of their weights

Which heads a rank holds is kthena_core's one rule (`kthena_core.shape`): ``tp <= kv_heads``
splits the KV heads as evenly as whole heads allow (SmolLM2's 3 KV heads over 2 ranks: 2 + 1),
and a ``tp`` that is a multiple of ``kv_heads`` replicates each KV head on ``tp / kv_heads``
ranks. Each rank's query heads are those of its KV heads, so attention stays local and the
summed o_proj outputs are exact. The planner and the KV pool sizing use the same rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F

from kthena_core.shape import HeadSplitError, attention_head_range, kv_head_range
from kthena_serve.model.config import ModelConfig
from kthena_serve.model.errors import TensorParallelError

AllReduce = Callable[[torch.Tensor], torch.Tensor]
Collective = Callable[[torch.Tensor], torch.Tensor]
Matmul = Callable[..., torch.Tensor]  # F.linear's signature: (x, weight [out, in], bias=None)


class FusedCollectives(Protocol):
    """A matmul fused with its collective over the TP group (MC2). Weights are dense
    ``[out, in]`` (``nn.Linear``'s layout); ``x`` is [rows, in]."""

    def matmul_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``all_reduce(x @ weight.T)``: [rows, out] on every rank."""
        ...

    def all_gather_matmul(self, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """``all_gather(x) @ weight.T (+ bias)``: [world * rows, out], in rank order."""
        ...

    def matmul_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``reduce_scatter(x @ weight.T)``: this rank's [rows / world, out] of the sum."""
        ...


def _no_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@attrs.frozen
class TensorParallel:
    """This process's place in a tensor-parallel group and the collectives its layers use.

    Attributes:
        rank: 0 .. world_size - 1.
        world_size: number of ranks sharing each layer.
        all_reduce: sums a tensor over the group, in place, and returns it.
        all_gather: every rank's [n, ...] tensor -> [world_size * n, ...], in rank order
            (sequence parallelism, `kthena_serve.model.sp`).
        reduce_scatter: the group's [world_size * n, ...] tensors -> this rank's [n, ...]
            chunk of their sum (sequence parallelism).
        fused: MC2 ops that overlap each row-parallel matmul with its collective (and, under
            sequence parallelism, the all-gather with the matmul after it); None: the matmul,
            then the collective. The model keeps the weights these ops take dense.
    """

    rank: int = 0
    world_size: int = 1
    all_reduce: AllReduce = _no_reduce
    all_gather: Collective = _no_reduce
    reduce_scatter: Collective = _no_reduce
    fused: FusedCollectives | None = None

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise TensorParallelError(f"rank {self.rank} of world_size {self.world_size} is invalid; "
                                      f"need world_size >= 1 and 0 <= rank < world_size")
        if self.fused is not None and self.world_size == 1:
            raise TensorParallelError("fused collectives (TP overlap) need world_size > 1: one "
                                      "rank has no collective to overlap; drop them or use tp > 1")

    def linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor,
                          matmul: Matmul = F.linear) -> torch.Tensor:
        """A row-parallel linear: the group's sum of ``matmul(x, weight)`` (one rank: just it)."""
        if self.world_size == 1:
            return matmul(x, weight)
        if self.fused is not None:
            return self.fused.matmul_all_reduce(x, weight)
        return self.all_reduce(matmul(x, weight))

    def all_gather_linear(self, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None,
                          matmul: Matmul = F.linear) -> torch.Tensor:
        """``matmul(all_gather(x), weight, bias)``: a column-parallel linear over every rank's
        rows (sequence parallelism)."""
        if self.fused is not None:
            return self.fused.all_gather_matmul(x, weight, bias)
        return matmul(self.all_gather(x), weight, bias)

    def linear_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor,
                              matmul: Matmul = F.linear) -> torch.Tensor:
        """This rank's rows of the group's sum of ``matmul(x, weight)`` (sequence parallelism)."""
        if self.fused is not None:
            return self.fused.matmul_reduce_scatter(x, weight)
        return self.reduce_scatter(matmul(x, weight))

    @classmethod
    def from_comm_group(cls, group: Any, fused: FusedCollectives | None = None) -> TensorParallel:
        """kthena_comm's collectives over a ``CommGroup`` (rank, size from the group)."""
        from kthena_comm.collectives import all_gather, all_reduce, reduce_scatter

        return cls(group.group_rank, group.size, lambda t: all_reduce(t, group),
                   lambda t: all_gather(t, group), lambda t: reduce_scatter(t, group), fused)

    @classmethod
    def from_torch_distributed(cls, group: Any = None) -> TensorParallel:
        """``torch.distributed``'s collectives over `group` (the default group if None)."""
        import torch.distributed as dist

        world = dist.get_world_size(group)
        # torch >= 2.13 names them *_single (the *_tensor spellings warn)
        gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(tensor, group=group)
            return tensor

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
            gather_into(out, tensor, group=group)
            return out

        def scatter(tensor: torch.Tensor) -> torch.Tensor:
            out = tensor.new_empty((tensor.shape[0] // world, *tensor.shape[1:]))
            scatter_from(out, tensor, group=group)
            return out

        return cls(dist.get_rank(group), world, reduce, gather, scatter)


@attrs.frozen
class ShardPlan:
    """What one rank holds: ranges of query heads, KV heads and MLP intermediate columns; in
    an MoE model also the routed experts' and the shared experts' intermediate columns (each
    expert is split like a dense MLP) and the experts themselves (all of them: no expert
    parallelism here)."""

    q_heads: range
    kv_heads: range
    intermediate: range
    expert_intermediate: range = range(0)
    shared_intermediate: range = range(0)
    experts: range = range(0)


def _split(total: int, parts: int, index: int) -> range:
    """Part `index` of `parts` contiguous, near-equal pieces of range(total) (larger ones first)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def plan_shards(config: ModelConfig, tp: TensorParallel | None, *,
                expert_parallel: bool = False) -> ShardPlan:
    """The slice of `config`'s model that rank ``tp.rank`` of ``tp.world_size`` holds; with
    ``expert_parallel``, an MoE model's routed experts go whole to the ranks (``experts /
    world_size`` each) instead of each being split over all of them.

    Raises:
        TensorParallelError: ``world_size`` exceeds the query heads, or exceeds the KV heads
            without being a multiple of them (the message lists the sizes that work); expert
            parallelism for a dense model, or over a world size that does not divide the
            experts.
    """
    rank, world = (tp.rank, tp.world_size) if tp else (0, 1)
    nh, nkv = config.shape.num_attention_heads, config.shape.num_kv_heads
    try:
        q = attention_head_range(nh, nkv, world, rank)
        kv = kv_head_range(nkv, world, rank)
    except HeadSplitError as e:
        raise TensorParallelError(str(e)) from None
    moe, dense = config.moe, _split(config.shape.intermediate_size, world, rank)
    if moe is None:
        if expert_parallel:
            raise TensorParallelError("expert parallelism needs an MoE model; this one is "
                                      "dense: drop --enable-expert-parallel")
        return ShardPlan(q, kv, dense)
    shared = _split(moe.shared_intermediate_size, world, rank)
    if not expert_parallel:
        return ShardPlan(q, kv, dense, _split(moe.intermediate_size, world, rank), shared,
                         range(moe.num_experts))
    if moe.num_experts % world:
        sizes = [d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]
        raise TensorParallelError(f"expert parallelism over tp={world} ranks: {moe.num_experts} "
                                  f"experts do not split evenly; allowed tp: {sizes}")
    per_rank = moe.num_experts // world
    return ShardPlan(q, kv, dense, range(moe.intermediate_size), shared,
                     range(rank * per_rank, (rank + 1) * per_rank))
