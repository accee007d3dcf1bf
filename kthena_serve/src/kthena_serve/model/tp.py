"""Tensor parallelism as a plan applied from outside the model (gpt-fast style).

`TensorParallel` says who this process is (rank, world size) and how to sum partial results
(``all_reduce``). `plan_shards` is a pure function from the config and the rank to the slice of
heads and MLP columns the rank holds; the loader slices the weights with it and the model sizes
its layers with it. The model itself never calls a collective: its row-parallel layers (o_proj,
down_proj) just call ``tp.all_reduce`` when the world is larger than one.

    q/k/v, gate/up   column-parallel: each rank holds its heads' rows / its MLP columns
    o, down          row-parallel: each rank holds the matching input columns; outputs summed

Which heads a rank holds is kthena_core's one rule (`kthena_core.shape`): ``tp <= kv_heads``
splits the KV heads as evenly as whole heads allow (SmolLM2's 3 KV heads over 2 ranks: 2 + 1),
and a ``tp`` that is a multiple of ``kv_heads`` replicates each KV head on ``tp / kv_heads``
ranks. Each rank's query heads are those of its KV heads, so attention stays local and the
summed o_proj outputs are exact. The planner and the KV pool sizing use the same rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from kthena_core.shape import HeadSplitError, attention_head_range, kv_head_range
from kthena_serve.model.config import ModelConfig
from kthena_serve.model.errors import TensorParallelError

AllReduce = Callable[[torch.Tensor], torch.Tensor]
Collective = Callable[[torch.Tensor], torch.Tensor]


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
    """

    rank: int = 0
    world_size: int = 1
    all_reduce: AllReduce = _no_reduce
    all_gather: Collective = _no_reduce
    reduce_scatter: Collective = _no_reduce

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise TensorParallelError(f"rank {self.rank} of world_size {self.world_size} is invalid; "
                                      f"need world_size >= 1 and 0 <= rank < world_size")

    @classmethod
    def from_comm_group(cls, group: Any) -> TensorParallel:
        """kthena_comm's collectives over a ``CommGroup`` (rank, size from the group)."""
        from kthena_comm.collectives import all_gather, all_reduce, reduce_scatter

        return cls(group.group_rank, group.size, lambda t: all_reduce(t, group),
                   lambda t: all_gather(t, group), lambda t: reduce_scatter(t, group))

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
    """What one rank holds: ranges of query heads, KV heads and MLP intermediate columns."""

    q_heads: range
    kv_heads: range
    intermediate: range


def _split(total: int, parts: int, index: int) -> range:
    """Part `index` of `parts` contiguous, near-equal pieces of range(total) (larger ones first)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def plan_shards(config: ModelConfig, tp: TensorParallel | None) -> ShardPlan:
    """The slice of `config`'s model that rank ``tp.rank`` of ``tp.world_size`` holds.

    Raises:
        TensorParallelError: ``world_size`` exceeds the query heads, or exceeds the KV heads
            without being a multiple of them (the message lists the sizes that work).
    """
    rank, world = (tp.rank, tp.world_size) if tp else (0, 1)
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    try:
        q = attention_head_range(nh, nkv, world, rank)
        kv = kv_head_range(nkv, world, rank)
    except HeadSplitError as e:
        raise TensorParallelError(str(e)) from None
    return ShardPlan(q, kv, _split(config.intermediate_size, world, rank))
