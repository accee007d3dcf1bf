"""The one TP head-split rule and ModelShape: brute-force properties and known answers."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.shape import (
    HeadSplitError,
    ModelShape,
    ModelShapeError,
    allowed_tp_sizes,
    attention_head_range,
    check_tp,
    check_tp_divides_heads,
    kv_head_range,
    kv_heads_per_rank,
    tp_sizes_dividing_heads,
)


def test_smollm2_three_kv_heads_over_two_ranks():
    assert [kv_head_range(3, 2, r) for r in (0, 1)] == [range(0, 2), range(2, 3)]
    assert [attention_head_range(9, 3, 2, r) for r in (0, 1)] == [range(0, 6), range(6, 9)]
    assert [kv_heads_per_rank(3, 2, r) for r in (0, 1)] == [2, 1]
    assert kv_heads_per_rank(3, 2) == 2  # the pool size every rank uses


def test_replicated_kv_heads():
    assert [kv_head_range(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [attention_head_range(8, 2, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6),
                                                                     range(6, 8)]
    assert kv_heads_per_rank(2, 4) == 1


@given(kv=st.integers(1, 8), group=st.integers(1, 4), tp=st.integers(1, 40))
def test_split_covers_every_head_and_none_is_the_largest_share(kv, group, tp):
    heads = kv * group
    engine_runs = tp <= heads and (tp <= kv or tp % kv == 0)
    assert (tp in allowed_tp_sizes(heads, kv)) == engine_runs
    if not engine_runs:
        with pytest.raises(HeadSplitError, match=f"tp={tp}"):
            check_tp(heads, kv, tp)
        return
    check_tp(heads, kv, tp)
    kv_ranges = [kv_head_range(kv, tp, r) for r in range(tp)]
    q_ranges = [attention_head_range(heads, kv, tp, r) for r in range(tp)]
    assert sorted(h for q in q_ranges for h in q) == list(range(heads))  # every query head once
    for q, kvr in zip(q_ranges, kv_ranges, strict=True):
        assert len(q) >= 1 and {h // group for h in q} <= set(kvr)  # attention stays local
    if tp <= kv:
        assert sorted(h for r in kv_ranges for h in r) == list(range(kv))
    assert [kv_heads_per_rank(kv, tp, r) for r in range(tp)] == [len(r) for r in kv_ranges]
    assert kv_heads_per_rank(kv, tp) == max(len(r) for r in kv_ranges)
    assert max(len(r) for r in kv_ranges) - min(len(r) for r in kv_ranges) <= 1


def test_errors_say_what_is_allowed():
    with pytest.raises(HeadSplitError, match="tp=4 > num_kv_heads=3 must be a multiple.*allowed tp: 1, 2, 3, 6, 9"):
        check_tp(9, 3, 4)
    with pytest.raises(HeadSplitError, match="tp=12 exceeds num_attention_heads=9.*allowed tp: 1, 2, 3, 6, 9"):
        check_tp(9, 3, 12)
    with pytest.raises(HeadSplitError, match="use tp <= 3 or a multiple of 3"):
        kv_heads_per_rank(3, 4)
    with pytest.raises(HeadSplitError, match="rank=2 is outside 0..1"):
        kv_head_range(3, 2, 2)
    with pytest.raises(HeadSplitError, match="must both be >= 1"):
        kv_heads_per_rank(3, 0)
    assert issubclass(HeadSplitError, ValueError)


def test_model_shape_validates():
    shape = ModelShape(num_layers=30, num_attention_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                       intermediate_size=1536, vocab_size=49152, dtype="bfloat16")
    assert shape.dtype == "bf16"
    shape.check_tp(2)
    with pytest.raises(ModelShapeError, match="num_kv_heads must be a positive int, got 0"):
        ModelShape(num_layers=1, num_attention_heads=1, num_kv_heads=0, head_dim=1, hidden_size=1, intermediate_size=1,
                   vocab_size=1)
    with pytest.raises(ModelShapeError, match="must be a multiple of num_kv_heads=4"):
        ModelShape(num_layers=1, num_attention_heads=6, num_kv_heads=4, head_dim=1, hidden_size=1, intermediate_size=1,
                   vocab_size=1)
    with pytest.raises(ModelShapeError, match="unknown dtype 'float64'"):
        ModelShape(num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=1, hidden_size=1, intermediate_size=1,
                   vocab_size=1, dtype="float64")


@given(heads_per_kv=st.integers(1, 8), kv=st.integers(1, 16))
def test_the_planners_tp_are_the_engines_that_give_every_rank_as_many_heads(heads_per_kv, kv):
    heads = heads_per_kv * kv
    proposed = tp_sizes_dividing_heads(heads, kv)
    for tp in allowed_tp_sizes(heads, kv):
        counts = {len(attention_head_range(heads, kv, tp, r)) for r in range(tp)}
        assert (tp in proposed) == (len(counts) == 1)
        if tp not in proposed:
            with pytest.raises(HeadSplitError, match=f"tp={tp} does not divide"):
                check_tp_divides_heads(heads, kv, tp)


def test_tp_that_does_not_divide_the_heads_says_how_they_would_fall():
    with pytest.raises(HeadSplitError) as error:
        check_tp_divides_heads(128, 128, 25)  # DeepSeek-V3: MLA splits its 128 query heads
    assert str(error.value) == (
        "tp=25 does not divide num_attention_heads=128: its ranks would hold 6 or 5 query "
        "heads, and the rank with the most sets every step's pace; tp that divide the heads: "
        "1, 2, 4, 8, 16, 32, 64, 128")
    assert tp_sizes_dividing_heads(9, 3) == (1, 3, 9)  # SmolLM2: tp=2 runs (6 + 3), unproposed
    with pytest.raises(HeadSplitError, match="tp=4 exceeds|tp=4 > num_kv_heads"):
        check_tp_divides_heads(9, 3, 4)  # the engine's rule first
