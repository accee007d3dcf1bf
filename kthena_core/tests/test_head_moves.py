"""`kv_head_moves`: KV heads re-sharded between two TP layouts of one model (PD with a prefill
and a decode instance of different TP sizes). Property: every head every destination rank
holds is written exactly once, from a source rank holding that very head."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.shape import HeadSplitError, kv_head_moves, kv_head_range


@st.composite
def splits(draw):  # noqa: ANN001, ANN201
    """(num_kv_heads, src_tp, dst_tp), each tp one `kv_head_range` accepts."""
    heads = draw(st.integers(1, 16))

    def tp():  # noqa: ANN202
        return st.one_of(st.integers(1, heads),
                         st.integers(1, 4).map(lambda k: heads * k))

    return heads, draw(tp()), draw(tp())


@given(splits())
def test_every_destination_head_is_written_once_from_a_rank_that_holds_it(split) -> None:  # noqa: ANN001
    heads, src_tp, dst_tp = split
    written: dict[tuple[int, int], int] = {}  # (dst rank, local head) -> global head
    for move in kv_head_moves(heads, src_tp, dst_tp):
        src = kv_head_range(heads, src_tp, move.src_rank)
        dst = kv_head_range(heads, dst_tp, move.dst_rank)
        assert move.count >= 1
        for i in range(move.count):
            key = (move.dst_rank, move.dst_start + i)
            assert key not in written  # once
            global_src = src[move.src_start + i]  # IndexError: a head the rank does not hold
            assert dst[move.dst_start + i] == global_src  # the very head the slot holds
            written[key] = global_src
    expected = {(r, i) for r in range(dst_tp) for i in range(len(kv_head_range(heads, dst_tp, r)))}
    assert set(written) == expected


@pytest.mark.parametrize(("heads", "src", "dst", "moves"), [
    (2, 2, 2, [(0, 0, 0, 0, 1), (1, 0, 1, 0, 1)]),       # same tp: rank to rank, whole pools
    (3, 1, 2, [(0, 0, 0, 0, 2), (0, 2, 1, 0, 1)]),       # SmolLM2's 3 heads: one rank split in two
    (3, 2, 1, [(0, 0, 0, 0, 2), (1, 0, 0, 2, 1)]),       # ... and merged back
    (2, 1, 4, [(0, 0, 0, 0, 1), (0, 0, 1, 0, 1), (0, 1, 2, 0, 1), (0, 1, 3, 0, 1)]),  # replicated
])
def test_worked_examples(heads: int, src: int, dst: int, moves: list) -> None:
    got = [(m.src_rank, m.src_start, m.dst_rank, m.dst_start, m.count)
           for m in kv_head_moves(heads, src, dst)]
    assert got == moves


def test_a_tp_that_cannot_split_the_heads_is_refused_by_name() -> None:
    with pytest.raises(HeadSplitError, match="tp=3 > num_kv_heads=2"):
        kv_head_moves(2, 1, 3)
