"""MC2-style MoE dispatch and combine (CANN's moe_distribute family), and the one-call EP
MoE layer built on them.

    d = moe_distribute_dispatch(x, weights, ids, ep_group, num_experts)   # rows by expert
    out_rows = experts.run_sorted(d.rows[:d.num_rows], d.expert_counts)     # grouped matmul
    y = moe_distribute_combine(out_rows, d, ep_group)                      # [T, H] home

or all three in one: ``y = ep_experts(x, weights, ids, experts, ep_group, num_experts)``.

Per device (`mooncake_ops.dispatch`; what runs is in `capabilities()`):

    cpu, cuda   backends/moe_a2a.py: the count exchange, the row all-to-all and the sort by
                expert in one call, overlapped (kthena_comm async all-to-all); its reference
                is the unfused `ep.ep_dispatch` / `ep.ep_combine`
    npu         torch_npu.npu_moe_distribute_dispatch / npu_moe_distribute_combine over the EP
                group's HCCL communicator, within their documented shapes (backends/npu.py);
                documentation only: never run on an NPU

Tokens: every rank of the EP group brings its own (attention data-parallel, as DeepSeek and
vLLM run EP). Where every rank holds the same tokens (attention tensor-parallel over the same
ranks), `replicated_ep_experts` computes each rank's experts over all the tokens and sums the
ranks' shares with one all-reduce, with no all-to-all: it moves T × H float32 per rank (a ring
all-reduce: 2 (W-1)/W of it each way), where slicing the tokens, dispatching and all-gathering
would move about 2 × k × T/W rows plus a T × H gather; with k = 6-8 the all-reduce moves less,
and the compute is the same (each rank runs its experts' pairs of all T tokens either way).
"""

from __future__ import annotations

import torch

from kthena_comm import collectives as coll
from kthena_comm.groups import CommGroup
from mooncake_ops.backends.moe_a2a import MoEDispatch
from mooncake_ops.dispatch import impl
from mooncake_ops.ep import check_ep, check_held, ep_combine, ep_dispatch, run_dispatched
from mooncake_ops.errors import OpsDTypeError, OpsShapeError
from mooncake_ops.mc2 import resolve_group
from mooncake_ops.moe import experts_float32
from mooncake_ops.moe_kernels import ExpertWeights

__all__ = ["MoEDispatch", "ep_experts", "moe_distribute_combine", "moe_distribute_dispatch",
           "replicated_ep_experts"]


def moe_distribute_dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                            group: CommGroup | object | None, num_experts: int) -> MoEDispatch:
    """Send each token-expert pair's row to the rank holding its expert; receive this rank's
    rows sorted by its experts (`MoEDispatch.rows`, `expert_counts`).

    Args:
        x: [T, H] this rank's tokens.
        weights, ids: [T, top_k] their routing (`route_experts`); ids are global expert ids,
            distinct within a row for the npu op (top-k gives that).
        group: the EP group (``CommGroup``, torch ProcessGroup, or None: the world).
        num_experts: E over the whole group; rank r holds `expert_range` (E, W, r).

    Raises:
        ExpertParallelError: W does not divide E, or an id outside 0..E-1.
        OpsShapeError, OpsDTypeError: x, weights and ids disagree.
    """
    comm = resolve_group(group)
    held = check_ep(x, weights, ids, comm, num_experts)
    return impl("moe_distribute_dispatch", x.device.type)(x, weights, ids, comm, held,
                                                          num_experts)


def moe_distribute_combine(out_rows: torch.Tensor, dispatch: MoEDispatch,
                           group: CommGroup | object | None) -> torch.Tensor:
    """Send each result row back to its token's home rank and sum it there, weighted by the
    routing: [T, H] in the dispatched dtype.

    Args:
        out_rows: [dispatch.num_rows, H], row i the expert MLP of ``dispatch.rows[i]``.
        dispatch: what `moe_distribute_dispatch` returned on this rank.
        group: the same EP group.

    Raises:
        OpsShapeError, OpsDTypeError: out_rows is not one row per dispatched row, in its dtype.
    """
    want = (dispatch.num_rows, dispatch.rows.shape[1])
    if out_rows.dim() != 2 or tuple(out_rows.shape) != want:
        raise OpsShapeError(f"out_rows must be [dispatched rows, hidden] = {list(want)}; got "
                            f"{list(out_rows.shape)}")
    if out_rows.dtype != dispatch.dtype:
        raise OpsDTypeError(f"out_rows are {out_rows.dtype}; combine sends rows in the "
                            f"dispatched dtype {dispatch.dtype}")
    comm = resolve_group(group)
    return impl("moe_distribute_combine", out_rows.device.type)(out_rows, dispatch, comm)


def ep_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               experts: ExpertWeights, group: CommGroup | object | None, num_experts: int, *,
               fused: bool = True) -> torch.Tensor:
    """The routed experts of this rank's tokens under EP: dispatch, the grouped matmul over
    this rank's experts, combine. [T, H] in x's dtype; equal to `run_experts` with every
    expert on one rank, up to float32 summation order.

    Args:
        experts: this rank's experts, ``pack_experts(..., expert_start=expert_range(E, W,
            r).start)``.
        fused: the MC2-style ops (`moe_distribute_dispatch` / `_combine`); False: the
            unfused reference (`ep.ep_dispatch` / `ep.ep_combine`).

    Raises:
        ExpertParallelError: ``experts`` are not the slice this rank holds, or as dispatch.
    """
    comm = resolve_group(group)
    if not fused:
        sent = ep_dispatch(x, weights, ids, comm, num_experts)
        return ep_combine(run_dispatched(sent, experts), sent, comm)
    d = moe_distribute_dispatch(x, weights, ids, comm, num_experts)
    check_held(experts, d.experts)
    out_rows = experts.run_sorted(d.rows[:d.num_rows], d.expert_counts)
    return moe_distribute_combine(out_rows, d, comm)


def replicated_ep_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                          experts: ExpertWeights,
                          group: CommGroup | object | None) -> torch.Tensor:
    """The routed experts when every rank of the group holds the same tokens: each rank runs
    its experts' pairs, and one float32 all-reduce sums the shares: [T, H] in x's dtype.

    Args:
        experts: this rank's experts, packed with ``expert_start`` = its `expert_range`'s
            start (pairs on other ranks' experts are skipped here and summed there).

    Raises:
        OpsShapeError, OpsDTypeError: as `run_experts`.
    """
    comm = resolve_group(group)
    return coll.all_reduce(experts_float32(x, weights, ids, experts), comm).to(x.dtype)
