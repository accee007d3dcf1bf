"""The grouped expert matmul: every candidate kernel against `fused_experts_reference` and a
float64 oracle (error bound derived in _moe_oracle), the row-class switch, and misuse."""

from __future__ import annotations

import pytest
import torch
from _moe_oracle import assert_within, experts64
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_ops as mo
from mooncake_ops.moe import sort_pairs
from mooncake_ops.moe_kernels import (
    GROUPED_MM,
    LOOP,
    PADDED_BMM,
    GroupedKernel,
    grouped_candidates,
    grouped_kernel,
    grouped_mm_available,
)

DTYPES = (torch.float32, torch.bfloat16)


def _case(seed, num_experts, hidden, inter, top_k, tokens, dtype):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5)
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=gen)
    return x.to(dtype), weights, ids, gate_up.to(dtype), down.to(dtype)


def _all_candidates(dtype):
    return grouped_candidates(torch.empty(0, dtype=dtype))


shapes = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1), "num_experts": st.sampled_from([2, 4, 8]),
    "hidden": st.sampled_from([32, 64]), "inter": st.sampled_from([16, 48]),
    "top_k": st.integers(1, 2), "tokens": st.sampled_from([0, 1, 3, 17, 40]),
    "dtype": st.sampled_from(DTYPES)})


@settings(max_examples=25, deadline=None)
@given(case=shapes)
def test_every_candidate_matches_the_reference_within_the_derived_bound(case):
    dtype = case["dtype"]
    x, weights, ids, gate_up, down = _case(**case)
    exact, bound = experts64(x, weights, ids, gate_up, down, compute_dtype=dtype,
                             out_dtype=dtype)
    _, ref_bound = experts64(x, weights, ids, gate_up, down, compute_dtype=torch.float32,
                             out_dtype=dtype)
    reference = mo.fused_experts_reference(x, weights, ids, gate_up, down)
    assert_within(reference, exact, ref_bound, "fused_experts_reference")
    for kernel in _all_candidates(dtype):
        experts = mo.pack_experts(gate_up, down, kernels=(kernel, kernel))
        got = mo.run_experts(x, weights, ids, experts)
        assert got.dtype == dtype and got.shape == x.shape
        assert_within(got, exact, bound, f"{kernel.name} vs float64")
        assert_within(got, reference.double(), bound + ref_bound, f"{kernel.name} vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_keeps_its_signature_and_skips_other_ranks_experts(dtype):
    x, weights, ids, gate_up, down = _case(3, 8, 64, 48, 2, 23, dtype)
    start = 2  # this rank holds experts 2..5
    held_up, held_down = gate_up[start:start + 4], down[start:start + 4]
    exact, bound = experts64(x, weights, ids, held_up, held_down, compute_dtype=dtype,
                             out_dtype=dtype, expert_start=start)
    got = mo.fused_experts(x, weights, ids, held_up, held_down, expert_start=start)
    assert_within(got, exact, bound, "fused_experts, experts 2..5")
    packed = mo.pack_experts(held_up, held_down, expert_start=start)
    assert torch.equal(mo.run_experts(x, weights, ids, packed), got)  # the same torch loop


def test_sort_pairs_groups_each_experts_pairs_in_token_order():
    ids = torch.tensor([[3, 1], [1, 0], [2, 3]])
    pairs = sort_pairs(ids, num_local=2, expert_start=1)  # experts 1 and 2
    assert pairs.counts == (2, 1)
    assert pairs.pair_of.tolist() == [1, 2, 4]  # (t0, slot 1), (t1, slot 0), (t2, slot 0)
    assert pairs.tokens.tolist() == [0, 1, 2]


def _recording(name: str, seen: list) -> GroupedKernel:
    def run(rows, counts, state):
        seen.append((name, rows.shape[0]))
        return LOOP.run(rows, counts, state)
    return GroupedKernel(name, "dense", LOOP.pack, run)


def test_calls_up_to_decode_max_rows_run_the_decode_kernel():
    seen: list = []
    x, weights, ids, gate_up, down = _case(5, 4, 32, 16, 2, 9, torch.float32)
    experts = mo.pack_experts(gate_up, down, kernels=(_recording("small", seen),
                                                      _recording("large", seen)),
                              decode_max_rows=8)
    mo.run_experts(x[:4], weights[:4], ids[:4], experts)  # 8 pairs
    mo.run_experts(x, weights, ids, experts)  # 18 pairs
    assert seen == [("small", 8), ("large", 18)]


def test_kernels_of_two_layouts_are_refused_and_names_resolve():
    packed = GroupedKernel("packed-copy", "packed-copy", LOOP.pack, LOOP.run)
    _, _, _, gate_up, down = _case(1, 2, 32, 16, 1, 1, torch.float32)
    with pytest.raises(ValueError, match="two copies of every expert"):
        mo.pack_experts(gate_up, down, kernels=(LOOP, packed))
    assert grouped_kernel("torch-padded-bmm") is PADDED_BMM
    with pytest.raises(ValueError, match="known: .*torch-loop"):
        grouped_kernel("no-such-kernel")
    names = {k.name for k in _all_candidates(torch.float32)}
    assert {LOOP.name, PADDED_BMM.name} <= names
    assert (GROUPED_MM.name in names) == grouped_mm_available()


def test_misuse_names_what_was_wrong():
    x, weights, ids, gate_up, down = _case(2, 4, 32, 16, 2, 5, torch.float32)
    experts = mo.pack_experts(gate_up, down)
    with pytest.raises(mo.OpsShapeError, match=r"gate_up must be \[experts, 2 \* intermediate"):
        mo.pack_experts(gate_up, down[:, :, :8])
    with pytest.raises(mo.OpsDTypeError, match="the experts are torch.float32"):
        mo.run_experts(x.bfloat16(), weights, ids, experts)
    with pytest.raises(mo.OpsShapeError, match="the experts take hidden size 32"):
        mo.run_experts(x[:, :16], weights, ids, experts)
    with pytest.raises(mo.OpsShapeError, match=r"weights must be \[num_tokens, top_k\]"):
        mo.run_experts(x, weights[:, :1], ids, experts)
    with pytest.raises(mo.OpsDTypeError, match="ids has dtype torch.float32"):
        mo.run_experts(x, weights, ids.float(), experts)
    with pytest.raises(mo.OpsShapeError, match="counts must give each of the 4 experts"):
        experts.run_sorted(x, [5, 0, 0])
    with pytest.raises(mo.OpsDTypeError, match="gate_up is torch.bfloat16 but x is"):
        mo.fused_experts(x, weights, ids, gate_up.bfloat16(), down)
