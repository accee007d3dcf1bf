"""paged_batch: the tensors equal a plain-Python computation, and bad input is named."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mooncake_kv import (  # noqa: E402
    KVCacheBlocks,
    KVCacheManager,
    PagedBatch,
    PagedBatchError,
    paged_batch,
)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[tuple[list[int], int, int]], int]:
    """Sequences whose blocks cover their tokens, sometimes with spare blocks."""
    block_size = draw(st.integers(1, 8))
    decode = draw(st.booleans())
    seqs = []
    for _ in range(draw(st.integers(0, 6))):
        num_cached = draw(st.integers(0, 40))
        num_new = 1 if decode else draw(st.integers(1, 20))
        num_blocks = -(-(num_cached + num_new) // block_size) + draw(st.integers(0, 2))
        block_ids = draw(st.lists(st.integers(0, 1000), min_size=num_blocks, max_size=num_blocks))
        seqs.append((block_ids, num_cached, num_new))
    return seqs, block_size


def reference(seqs: list[tuple[list[int], int, int]], block_size: int) -> dict[str, list]:
    """The definition, one token at a time."""
    width = max((len(b) for b, _, _ in seqs), default=0)
    out: dict[str, list] = {"block_tables": [], "slot_mapping": [], "positions": [],
                            "logits_indices": []}
    for block_ids, num_cached, num_new in seqs:
        out["block_tables"].append(list(block_ids) + [0] * (width - len(block_ids)))
        for pos in range(num_cached, num_cached + num_new):
            out["positions"].append(pos)
            out["slot_mapping"].append(block_ids[pos // block_size] * block_size
                                       + pos % block_size)
        out["logits_indices"].append(len(out["positions"]) - 1)
    out["cached_lens"] = [c for _, c, _ in seqs]
    out["query_lens"] = [n for _, _, n in seqs]
    out["context_lens"] = [c + n for _, c, n in seqs]
    return out


@given(batches())
def test_matches_the_plain_python_definition(case) -> None:  # type: ignore[no-untyped-def]
    seqs, block_size = case
    batch = paged_batch(seqs, block_size=block_size)
    expected = reference(seqs, block_size)
    dtypes = {"block_tables": torch.int32, "slot_mapping": torch.int64,
              "positions": torch.int64, "cached_lens": torch.int32, "query_lens": torch.int32,
              "context_lens": torch.int32, "logits_indices": torch.int64}
    for name, dtype in dtypes.items():
        got = getattr(batch, name)
        assert got.dtype == dtype, name
        assert got.tolist() == expected[name], name
    assert tuple(batch.block_tables.shape) == (len(seqs), len(expected["block_tables"][0])
                                               if seqs else 0)
    assert batch.is_decode_only == all(n == 1 for _, _, n in seqs)
    assert (batch.num_seqs, batch.num_tokens) == (len(seqs), sum(n for _, _, n in seqs))


def test_golden_mixed_batch() -> None:
    batch = paged_batch([((3, 5), 17, 1), ((1, 2, 4), 0, 3)], block_size=16)
    assert batch.block_tables.tolist() == [[3, 5, 0], [1, 2, 4]]
    assert batch.slot_mapping.tolist() == [5 * 16 + 1, 16, 17, 18]
    assert batch.positions.tolist() == [17, 0, 1, 2]
    assert batch.logits_indices.tolist() == [0, 3]
    assert batch.context_lens.tolist() == [18, 3]
    assert not batch.is_decode_only


def test_takes_the_managers_block_tables() -> None:
    mgr = KVCacheManager(8, 4)
    prompt = list(range(10))
    match = mgr.match_prefix("r", prompt)
    num_new = len(prompt) - match.num_cached_tokens
    blocks = mgr.try_allocate("r", num_new)
    assert isinstance(blocks, KVCacheBlocks)
    batch = paged_batch([(blocks, match.num_cached_tokens, num_new)], block_size=4)
    slots = [block * 4 + row for block in blocks.block_ids for row in range(4)]
    assert batch.slot_mapping.tolist() == slots[:10]


def test_to_moves_every_tensor() -> None:
    batch = paged_batch([((0,), 0, 2)], block_size=4).to("cpu")
    assert isinstance(batch, PagedBatch) and batch.slot_mapping.tolist() == [0, 1]


def test_a_hand_built_batch_is_checked() -> None:
    """The model reads a PagedBatch as is, so one built by hand (tests, benches) is checked."""
    i32 = torch.int32
    ok = paged_batch([((0,), 0, 2), ((1,), 0, 1)], block_size=4)  # 3 tokens, 2 sequences
    assert attrs.evolve(ok).num_tokens == 3
    with pytest.raises(PagedBatchError, match="slot_mapping must be a torch.int64 tensor, got "
                                              "torch.int32"):
        attrs.evolve(ok, slot_mapping=torch.zeros(3, dtype=i32))
    with pytest.raises(PagedBatchError, match=r"query_lens must have shape \(2,\)"):
        attrs.evolve(ok, query_lens=torch.ones(3, dtype=i32))
    with pytest.raises(PagedBatchError, match=r"must both be \[num_tokens\]"):
        attrs.evolve(ok, positions=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(PagedBatchError, match="decode-only batch has one token per sequence"):
        attrs.evolve(ok, is_decode_only=True)
    with pytest.raises(PagedBatchError, match="block_tables must be 2-D"):
        attrs.evolve(ok, block_tables=torch.zeros(2, dtype=i32))
    assert issubclass(PagedBatchError, ValueError)


BAD = [
    ("block_size", [((0,), 0, 1)], 0, ValueError, r"block_size must be an int >= 1 \(got 0\)"),
    ("negative cached", [((0,), 0, 1), ((0,), -1, 1)], 4, ValueError,
     r"sequence 1: num_cached must be an int >= 0 \(got -1\)"),
    ("no new token", [((0,), 2, 0)], 4, ValueError,
     r"sequence 0: num_new must be an int >= 1 \(got 0\)"),
    ("too few blocks", [((0, 1), 6, 3)], 4, ValueError,
     r"sequence 0: 2 blocks x block_size 4 = 8 slots cannot hold num_cached \+ num_new = "
     r"6 \+ 3 = 9 tokens; reserve the slots first"),
    ("negative block", [((0,), 0, 1), ((2, -3), 4, 1)], 4, ValueError,
     r"sequence 1: block id -3 is negative"),
    ("negative block, prefill", [((0,), 0, 2), ((2, -3), 4, 1)], 4, ValueError,
     r"sequence 1: block id -3 is negative"),
    ("not a triple", [((0,), 1)], 4, TypeError,
     r"sequence 0 must be a \(block_ids, num_cached, num_new\) triple, got \(\(0,\), 1\)"),
]


@pytest.mark.parametrize(("case", "seqs", "block_size", "error", "message"), BAD,
                         ids=[c[0] for c in BAD])
def test_bad_input_names_the_sequence_and_values(case, seqs, block_size, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        paged_batch(seqs, block_size=block_size)


def test_without_torch_the_error_names_the_pool_extra() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from mooncake_kv import {name}\n")
    for name in ("paged_batch", "KVPool"):
        done = subprocess.run([sys.executable, "-c", code.format(name=name)],
                              capture_output=True, text=True)
        assert done.returncode != 0
        assert f"mooncake_kv.{name} needs torch" in done.stderr
        assert "pip install 'mooncake-kv[pool]'" in done.stderr
