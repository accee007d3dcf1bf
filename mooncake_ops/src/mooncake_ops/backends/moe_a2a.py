"""MC2-style MoE dispatch and combine on any torch.distributed backend: the split exchange, the
token all-to-all and the sort by expert fused into one call each, overlapped where the data
allows (kthena_comm async collectives).

    dispatch   counts a2a ──────────┐  rows a2a ──────────────────┐
               │ sort pairs, gather │  │ receive order from counts │ → rows sorted by expert
    combine    back to received order → rows a2a → weighted index_add on the home rank

The count exchange sends one [E_local] int64 row per peer (how many rows go to each of its
experts): it gives the split sizes and, with no per-row ids, the order in which the received
rows sort by expert. Received rows arrive grouped (source rank, expert); the receive order
makes them (expert, source rank), each expert's rows in their senders' pair order:

    received   [ s0:e0 e0 | s0:e1 | s1:e0 | s1:e1 e1 ]     counts [[2, 1], [1, 2]]
    sorted     [ s0:e0 e0 | s1:e0 | s0:e1 | s1:e1 e1 ]     expert_counts (3, 3)

Bytes per peer d: dispatch 8 × E_local + rows_d × H × dtype size, combine rows_d × H × dtype
size (`ep.traffic`). The reference is the unfused path of `mooncake_ops.ep`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from kthena_comm import collectives as coll
from kthena_comm.groups import CommGroup
from mooncake_ops._moe_traffic import SPLIT_BYTES, Traffic, traffic, weighted_sum


@attrs.frozen(eq=False)  # holds tensors: identity, not elementwise, equality
class MoEDispatch:
    """What `moe_distribute_dispatch` received, sorted by expert, and how to send it home.

    Attributes:
        rows: [R, H] the received rows sorted by this rank's experts (torch_npu: expand_x,
            its rows beyond ``sum(expert_counts)`` unused).
        expert_counts: rows per local expert (torch_npu: expert_token_nums).
        experts: the global expert ids this rank holds.
        num_tokens: T, this rank's own tokens (combine returns [T, H]).
        dtype: the rows' dtype.
        traffic: the bytes both all-to-alls carry; None where a vendor op moved them.
        handle: the implementation's own state for its combine (opaque).
    """

    rows: torch.Tensor
    expert_counts: tuple[int, ...]
    experts: range
    num_tokens: int
    dtype: torch.dtype
    traffic: Traffic | None
    handle: Any = attrs.field(eq=False, repr=False)

    @property
    def num_rows(self) -> int:
        return sum(self.expert_counts)


@attrs.frozen(eq=False)
class A2AHandle:
    """The portable path's combine state: the home side's pairs and both split lists."""

    send_pairs: torch.Tensor  # [P] flat pair index of each sent row (sorted by global expert)
    send_splits: list[int]
    recv_splits: list[int]
    recv_order: torch.Tensor  # [R] received position of each expert-sorted row
    weights: torch.Tensor


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """[R] the received position of each row in (expert, source) order, from the counts
    [sources, experts] of the (source, expert)-ordered blocks received."""
    flat, device = counts.reshape(-1), counts.device
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts).t().reshape(-1)
    lengths = counts.t().reshape(-1)
    block = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum()), device=device) - first[block] + starts[block]


def moe_distribute_dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                            comm: CommGroup, experts: range, num_experts: int) -> MoEDispatch:
    world, top_k = comm.size, ids.shape[1]
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts).view(world, len(experts))
    pending_counts = coll.all_to_all(counts, comm, async_op=True)
    order = torch.argsort(flat, stable=True)  # by global expert: by rank, then by its experts
    send_rows = x.index_select(0, order // top_k)
    got = pending_counts.wait()
    send_splits, recv_splits = counts.sum(1).tolist(), got.sum(1).tolist()
    pending_rows = coll.all_to_all(send_rows, comm, send_splits, recv_splits, async_op=True)
    recv_order = _expert_major(got)
    rows = pending_rows.wait().index_select(0, recv_order)
    meta = (SPLIT_BYTES * len(experts) if world > 1 else 0, 0)
    moved = traffic(comm.group_rank, send_splits, recv_splits, x.shape[1] * x.element_size(),
                    meta)
    handle = A2AHandle(order, send_splits, recv_splits, recv_order, weights)
    return MoEDispatch(rows, tuple(got.sum(0).tolist()), experts, x.shape[0], x.dtype, moved,
                       handle)


def moe_distribute_combine(out_rows: torch.Tensor, dispatch: MoEDispatch,
                           comm: CommGroup) -> torch.Tensor:
    h: A2AHandle = dispatch.handle
    back = torch.empty_like(out_rows).index_copy_(0, h.recv_order, out_rows)
    pending = coll.all_to_all(back, comm, h.recv_splits, h.send_splits, async_op=True)
    return weighted_sum(pending.wait(), h.weights, h.send_pairs, dispatch.num_tokens).to(
        dispatch.dtype)
