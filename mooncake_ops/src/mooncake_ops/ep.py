"""Expert parallelism (EP): each rank of a group holds a contiguous slice of the experts, and
each token-expert pair's row travels to the rank that holds its expert and back.

    rank r holds experts  expert_range(E, world, r) = r * E/world .. (r + 1) * E/world - 1

    home rank                      all-to-all             expert's rank
    x [T, H], ids [T, k]  ─ rows of the pairs for r ─▶  rows [R, H] + their expert ids
                                                        grouped matmul (its experts)
    out [T, H] = Σ_j w[t, j] · row   ◀─ the same rows ─  out_rows [R, H]
                  (weighted on the home rank)

This module is the unfused path, the reference of the fused one (`moe_distribute`):
`ep_dispatch` sends the split sizes (one ``exchange_splits``), then the rows, then each row's
expert id (int32) in two more all-to-alls; `run_dispatched` sorts the received rows by expert
and runs the grouped kernels; `ep_combine` sends the results back and sums them, weighted, on
the token's home rank. Each call returns what it moved (`Traffic`), computed from the routing:

    dispatch, to peer d:   8 (its split size)  +  rows_d × (H × dtype size + 4)
    combine, back from d:  rows_d × H × dtype size

Every rank brings its own tokens (attention data-parallel across the EP group). When every rank
holds the same tokens (TP-replicated attention) use `moe_distribute.replicated_ep_experts`
instead: no all-to-all at all, see there.
"""

from __future__ import annotations

import attrs
import torch

from kthena_comm import collectives as coll
from kthena_comm.groups import CommGroup
from mooncake_ops._moe_traffic import ID_BYTES, SPLIT_BYTES, Traffic, traffic, weighted_sum
from mooncake_ops.errors import ExpertParallelError, OpsDTypeError, OpsShapeError
from mooncake_ops.mc2 import resolve_group
from mooncake_ops.moe import check_routing
from mooncake_ops.moe_kernels import ExpertWeights

__all__ = ["Dispatched", "Traffic", "check_ep", "check_held", "ep_combine", "ep_dispatch", "expert_range",
           "run_dispatched"]



def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global expert ids EP rank ``ep_rank`` of ``ep_size`` holds: a contiguous
    ``num_experts / ep_size`` of them.

    Raises:
        ExpertParallelError: ``ep_size`` does not divide ``num_experts``, or the rank is
            outside the group.
    """
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ExpertParallelError(f"{num_experts} experts do not split evenly over an EP group "
                                  f"of {ep_size} ranks; allowed EP sizes: {divisors}")
    if not 0 <= ep_rank < ep_size:
        raise ExpertParallelError(f"ep_rank={ep_rank} is outside the EP group 0..{ep_size - 1}")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def check_ep(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, comm: CommGroup,
             num_experts: int) -> range:
    """The routing checks of `check_routing`, plus: the group splits the experts evenly and
    every id names one of them. Returns this rank's `expert_range`.

    Raises:
        OpsShapeError, OpsDTypeError, OpsTypeError: the tensors disagree.
        ExpertParallelError: the group does not divide the experts, or an id is out of range.
    """
    check_routing(x, weights, ids)
    held = expert_range(num_experts, comm.size, comm.group_rank)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ExpertParallelError(f"ids must name experts 0..{num_experts - 1}; got ids from "
                                  f"{int(ids.min())} to {int(ids.max())}")
    return held


def check_held(experts: ExpertWeights, held: range) -> None:
    """Raise ExpertParallelError unless ``experts`` are exactly the global ids ``held``."""
    if experts.expert_start != held.start or experts.num_experts != len(held):
        raise ExpertParallelError(
            f"this rank holds experts {held.start}..{held.stop - 1}; the experts given are "
            f"{experts.expert_start}..{experts.expert_start + experts.num_experts - 1} (pack "
            "them with expert_start=expert_range(...).start)")


@attrs.frozen(eq=False)  # holds tensors: identity, not elementwise, equality
class Dispatched:
    """What `ep_dispatch` received, and what `ep_combine` needs to send the results home.

    Attributes:
        rows: [R, H] the rows received, by source rank, each source's in its pair order.
        expert_ids: [R] int64, each row's expert among this rank's (0 .. E_local - 1).
        experts: the global ids this rank holds (`expert_range`).
        send_pairs: [P] the flat pair index (token * top_k + slot) of each row sent, in order.
        send_splits, recv_splits: rows sent to / received from each group rank.
        weights: [T, top_k] the home tokens' routing weights.
        dtype: the rows' dtype (combine sends results back in it).
        traffic: the bytes both all-to-alls carry (`Traffic`).
    """

    rows: torch.Tensor
    expert_ids: torch.Tensor
    experts: range
    send_pairs: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    weights: torch.Tensor
    dtype: torch.dtype
    traffic: Traffic


def ep_dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                group: CommGroup | object | None, num_experts: int) -> Dispatched:
    """Send each token-expert pair's row to the rank holding its expert (the unfused path).

    Args:
        x: [T, H] this rank's tokens.
        weights, ids: [T, top_k] their routing (`route_experts`); ids are global.
        group: the EP group (a kthena_comm ``CommGroup``, a torch ProcessGroup or None: world).
        num_experts: E, the experts over the whole group.

    Raises:
        ExpertParallelError: the group size does not divide E, or an id outside 0..E-1.
        OpsShapeError, OpsDTypeError: x, weights and ids disagree.
    """
    comm = resolve_group(group)
    held = check_ep(x, weights, ids, comm, num_experts)
    flat, top_k = ids.reshape(-1), ids.shape[1]
    dest = flat // len(held)
    order = torch.argsort(dest, stable=True)
    send_splits = torch.bincount(dest, minlength=comm.size).tolist()
    recv_splits = coll.exchange_splits(send_splits, comm)
    rows = coll.all_to_all(x.index_select(0, order // top_k), comm, send_splits, recv_splits)
    got_ids = coll.all_to_all(flat[order].to(torch.int32), comm, send_splits, recv_splits)
    meta = (SPLIT_BYTES if comm.size > 1 else 0, ID_BYTES)
    moved = traffic(comm.group_rank, send_splits, recv_splits,
                    x.shape[1] * x.element_size(), meta)
    return Dispatched(rows, got_ids.long() - held.start, held, order, tuple(send_splits),
                      tuple(recv_splits), weights, x.dtype, moved)


def run_dispatched(dispatched: Dispatched, experts: ExpertWeights) -> torch.Tensor:
    """The grouped matmul over what `ep_dispatch` received: [R, H], row i the MLP of
    ``dispatched.rows[i]``'s expert (the order `ep_combine` sends back).

    Raises:
        ExpertParallelError: ``experts`` are not the ones this rank holds.
    """
    held = dispatched.experts
    check_held(experts, held)
    order = torch.argsort(dispatched.expert_ids, stable=True)
    counts = torch.bincount(dispatched.expert_ids, minlength=len(held)).tolist()
    done = experts.run_sorted(dispatched.rows.index_select(0, order), counts)
    return torch.empty_like(done).index_copy_(0, order, done)


def ep_combine(out_rows: torch.Tensor, dispatched: Dispatched,
               group: CommGroup | object | None) -> torch.Tensor:
    """Send each result row back to its token's home rank and sum it there, weighted:
    [T, H] in the rows' dtype (the weighted sum in float32).

    Raises:
        OpsShapeError, OpsDTypeError: ``out_rows`` is not [R, H] in the dispatched dtype.
    """
    comm = resolve_group(group)
    rows = dispatched.rows
    if tuple(out_rows.shape) != tuple(rows.shape):
        raise OpsShapeError(f"out_rows must be [received rows, hidden] = {list(rows.shape)}, "
                            f"one result per dispatched row; got {list(out_rows.shape)}")
    if out_rows.dtype != dispatched.dtype:
        raise OpsDTypeError(f"out_rows are {out_rows.dtype}; combine sends rows in the "
                            f"dispatched dtype {dispatched.dtype}")
    back = coll.all_to_all(out_rows, comm, list(dispatched.recv_splits),
                           list(dispatched.send_splits))
    out = weighted_sum(back, dispatched.weights, dispatched.send_pairs,
                       dispatched.weights.shape[0])
    return out.to(dispatched.dtype)
