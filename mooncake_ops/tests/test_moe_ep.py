"""Expert parallelism over two real gloo ranks (spawned processes on 127.0.0.1): the fused
(MC2-style) and unfused paths and the replicated-token path equal one rank holding every
expert, and each all-to-all's bytes equal those counted here from the routing."""

from __future__ import annotations

import pytest
import torch
from _moe_oracle import assert_within, experts64

import mooncake_ops as mo
from mooncake_ops import _ep_worker
from mooncake_ops._ep_worker import DTYPES, case_experts, case_inputs

WORLD = 2
CASES = [
    {"name": "fp32", "dtype": "float32", "num_experts": 8, "hidden": 64, "inter": 48,
     "top_k": 2, "tokens": [13, 7], "seed": 1},
    {"name": "bf16", "dtype": "bfloat16", "num_experts": 8, "hidden": 64, "inter": 32,
     "top_k": 3, "tokens": [9, 16], "seed": 2},
    {"name": "home", "dtype": "float32", "num_experts": 4, "hidden": 32, "inter": 16,
     "top_k": 2, "tokens": [6, 5], "seed": 3, "home": True},  # rank 0 sends nobody anything
    {"name": "empty", "dtype": "float32", "num_experts": 4, "hidden": 32, "inter": 16,
     "top_k": 1, "tokens": [0, 8], "seed": 4},  # rank 0 has no tokens at all
]
BY_NAME = {case["name"]: case for case in CASES}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every rank's results of every case, from one launch (all ranks stopped on return)."""
    out = tmp_path_factory.mktemp("ep-ranks")
    _ep_worker.launch("run", {"cases": CASES, "out": str(out)}, world=WORLD, timeout_s=240)
    return {(case["name"], rank): torch.load(out / f"{case['name']}-{rank}.pt")
            for case in CASES for rank in range(WORLD)}


def _rows_to(case: dict, rank: int) -> list[int]:
    """Rows ``rank`` sends to each rank: its pairs whose expert that rank holds."""
    per_rank = case["num_experts"] // WORLD
    _, _, ids = case_inputs(case, rank)
    return [int((ids // per_rank == d).sum()) for d in range(WORLD)]


@pytest.mark.parametrize("name", BY_NAME)
def test_every_ep_path_equals_one_rank_with_every_expert(outputs, name):
    case = BY_NAME[name]
    dtype = DTYPES[case["dtype"]]
    gate_up, down = case_experts(case)
    for rank in range(WORLD):
        x, weights, ids = case_inputs(case, rank)
        exact, bound = experts64(x, weights, ids, gate_up, down, compute_dtype=dtype,
                                 out_dtype=dtype)
        one_rank = mo.fused_experts(x, weights, ids, gate_up, down)
        assert_within(one_rank, exact, bound, f"{name} rank {rank}: one rank")
        got = outputs[(name, rank)]
        for path in ("fused", "unfused", "one_call"):
            assert got[path].shape == x.shape and got[path].dtype == dtype
            assert_within(got[path], exact, bound, f"{name} rank {rank}: {path} vs float64")
            assert_within(got[path], one_rank.double(), 2 * bound,
                          f"{name} rank {rank}: {path} vs one rank")


@pytest.mark.parametrize("name", BY_NAME)
def test_replicated_tokens_sum_each_ranks_share_with_one_all_reduce(outputs, name):
    case = BY_NAME[name]
    dtype = DTYPES[case["dtype"]]
    gate_up, down = case_experts(case)
    x, weights, ids = case_inputs(case, 0)  # every rank held rank 0's tokens
    exact, bound = experts64(x, weights, ids, gate_up, down, compute_dtype=dtype,
                             out_dtype=dtype, extra_sums=WORLD - 1)
    for rank in range(WORLD):
        assert_within(outputs[(name, rank)]["replicated"], exact, bound,
                      f"{name} rank {rank}: replicated")


@pytest.mark.parametrize("name", BY_NAME)
def test_all_to_all_bytes_are_those_of_the_routing(outputs, name):
    case = BY_NAME[name]
    row_bytes = case["hidden"] * DTYPES[case["dtype"]].itemsize
    per_rank = case["num_experts"] // WORLD
    sends = [_rows_to(case, rank) for rank in range(WORLD)]
    for rank in range(WORLD):
        out = [sends[rank][d] for d in range(WORLD)]  # rows this rank sends to d
        back = [sends[s][rank] for s in range(WORLD)]  # rows s sends to this rank
        unfused = {"rank": rank,
                   "dispatch_sent": tuple(8 + n * (row_bytes + 4) for n in out),
                   "dispatch_received": tuple(8 + n * (row_bytes + 4) for n in back),
                   "combine_sent": tuple(n * row_bytes for n in back),
                   "combine_received": tuple(n * row_bytes for n in out)}
        fused = {**unfused, "dispatch_sent": tuple(8 * per_rank + n * row_bytes for n in out),
                 "dispatch_received": tuple(8 * per_rank + n * row_bytes for n in back)}
        assert outputs[(name, rank)]["traffic_unfused"] == unfused
        assert outputs[(name, rank)]["traffic_fused"] == fused
    if name == "home":
        assert sends[0] == [sum(sends[0]), 0]  # the case does what it says


@pytest.mark.parametrize("name", BY_NAME)
def test_fused_dispatch_hands_over_rows_sorted_by_expert_then_source(outputs, name):
    case = BY_NAME[name]
    per_rank = case["num_experts"] // WORLD
    inputs = [case_inputs(case, rank) for rank in range(WORLD)]
    for rank in range(WORLD):
        rows, counts = [], []
        for expert in range(rank * per_rank, (rank + 1) * per_rank):
            before = len(rows)
            for x, _, ids in inputs:  # sources in rank order, pairs in flat order
                rows += [x[p // ids.shape[1]] for p in (ids.reshape(-1) == expert).nonzero()
                         .flatten().tolist()]
            counts.append(len(rows) - before)
        got = outputs[(name, rank)]
        assert got["expert_counts"] == tuple(counts)
        want = torch.stack(rows) if rows else got["sorted_rows"].new_zeros(0, case["hidden"])
        assert torch.equal(got["sorted_rows"], want)


# ---- one process: a group of one, and misuse ---------------------------------------------------
def _single(dtype=torch.float32):
    case = {**CASES[0], "dtype": "float32" if dtype == torch.float32 else "bfloat16"}
    gate_up, down = case_experts(case)
    x, weights, ids = case_inputs(case, 0)
    return case, x, weights, ids, gate_up, down


def test_a_group_of_one_is_the_local_computation():
    case, x, weights, ids, gate_up, down = _single()
    experts = mo.pack_experts(gate_up, down)
    local = mo.run_experts(x, weights, ids, experts)
    assert torch.equal(mo.ep_experts(x, weights, ids, experts, None, 8), local)
    exact, bound = experts64(x, weights, ids, gate_up, down, compute_dtype=torch.float32,
                             out_dtype=torch.float32)
    assert_within(mo.ep_experts(x, weights, ids, experts, None, 8, fused=False), exact, bound,
                  "unfused, group of one")
    assert torch.equal(mo.replicated_ep_experts(x, weights, ids, experts, None), local)
    sent = mo.ep_dispatch(x, weights, ids, None, 8)
    assert sent.traffic.off_rank() == {"dispatch_sent": 0, "dispatch_received": 0,
                                       "combine_sent": 0, "combine_received": 0}


def test_experts_split_contiguously_and_uneven_splits_are_refused():
    assert mo.expert_range(8, 2, 1) == range(4, 8)
    assert mo.expert_range(64, 8, 0) == range(0, 8)
    with pytest.raises(mo.ExpertParallelError, match=r"allowed EP sizes: \[1, 2, 3, 6\]"):
        mo.expert_range(6, 4, 0)
    with pytest.raises(mo.ExpertParallelError, match="outside the EP group 0..1"):
        mo.expert_range(8, 2, 2)


def test_misuse_names_what_was_wrong():
    case, x, weights, ids, gate_up, down = _single()
    bad = ids.clone()
    bad[0, 0] = 8
    with pytest.raises(mo.ExpertParallelError, match="experts 0..7; got ids from 0 to 8"):
        mo.ep_dispatch(x, weights, bad, None, 8)
    half = mo.pack_experts(gate_up[:4], down[:4])
    with pytest.raises(mo.ExpertParallelError, match="holds experts 0..7; the experts given"):
        mo.ep_experts(x, weights, ids, half, None, 8)
    with pytest.raises(mo.ExpertParallelError, match="expert_start=expert_range"):
        mo.run_dispatched(mo.ep_dispatch(x, weights, ids, None, 8), half)
    d = mo.moe_distribute_dispatch(x, weights, ids, None, 8)
    with pytest.raises(mo.OpsShapeError, match="out_rows must be"):
        mo.moe_distribute_combine(d.rows[1:], d, None)
    with pytest.raises(mo.OpsDTypeError, match="dispatched dtype torch.float32"):
        mo.moe_distribute_combine(d.rows.bfloat16(), d, None)
    sent = mo.ep_dispatch(x, weights, ids, None, 8)
    with pytest.raises(mo.OpsShapeError, match="one result per dispatched row"):
        mo.ep_combine(sent.rows[:-1], sent, None)
