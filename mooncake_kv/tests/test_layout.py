"""KVLayout: segment arithmetic, range coalescing properties, pair ranges, misuse."""

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_kv.layout import (
    DEFAULT_LAYOUT,
    BlockIdError,
    ByteRange,
    KVLayout,
    KVPart,
    LayerIndexError,
    LayoutError,
    LayoutKind,
    LayoutMismatchError,
)
from mooncake_kv.sizing import KVDtype, KVShape

SMOLLM2 = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)

shapes = st.builds(
    KVShape,
    num_layers=st.integers(1, 4),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 5),
    block_size=st.integers(1, 4),
    dtype=st.sampled_from(list(KVDtype)),
)


@st.composite
def layouts_and_ids(draw):
    layout = KVLayout(draw(shapes), draw(st.integers(1, 12)), draw(st.sampled_from(LayoutKind)))
    ids = draw(st.lists(st.integers(0, layout.num_blocks - 1), max_size=layout.num_blocks))
    return layout, ids


def block_bytes(layout: KVLayout, block_id: int) -> set[int]:
    """Every byte offset a block owns, from the fine-grained segments."""
    owned: set[int] = set()
    for layer in range(layout.shape.num_layers):
        for part in KVPart:
            segments = [layout.segment(block_id, layer, part)]
            if layout.shape.dtype.is_quantized:
                segments.append(layout.scale_segment(block_id, layer, part))
            for seg in segments:
                owned.update(range(seg.offset, seg.end))
    return owned


def num_runs(ids) -> int:
    ids = sorted(set(ids))
    return sum(1 for i, b in enumerate(ids) if i == 0 or ids[i - 1] != b - 1)


@given(layouts_and_ids())
def test_batch_ranges_cover_exactly_the_blocks(case):
    layout, ids = case
    ranges = layout.batch_ranges(ids)
    covered = [offset for r in ranges for offset in range(r.offset, r.end)]
    expected = set().union(*(block_bytes(layout, b) for b in ids)) if ids else set()
    assert len(covered) == len(set(covered)), "ranges overlap"
    assert set(covered) == expected
    assert all(a.end < b.offset for a, b in zip(ranges, ranges[1:], strict=False)), "unsorted or unmerged"
    assert len(ranges) <= num_runs(ids) * len(layout.pieces())
    if layout.kind is LayoutKind.BLOCK_MAJOR:
        assert len(ranges) <= len(set(ids)) * (2 if layout.shape.dtype.is_quantized else 1)


@given(shapes, st.integers(1, 6), st.sampled_from(LayoutKind))
def test_segments_tile_the_buffer(shape, num_blocks, kind):
    layout = KVLayout(shape, num_blocks, kind)
    owned = [block_bytes(layout, b) for b in range(num_blocks)]
    assert sum(map(len, owned)) == num_blocks * layout.bytes_per_block
    union = set().union(*owned)
    assert len(union) == num_blocks * layout.bytes_per_block  # no byte owned twice
    quantized = layout.shape.dtype.is_quantized
    padding = set(range(layout.data_bytes, layout.scale_offset)) if quantized else set()
    assert union | padding == set(range(layout.total_bytes))


def _pair_case(case, extra, rnd):
    """(source layout, its distinct block ids, a destination layout ``extra`` blocks larger, as
    many destination ids, a random source buffer), drawn from ``rnd``."""
    layout, ids = case
    src_ids = sorted(set(ids))
    dst = KVLayout(layout.shape, layout.num_blocks + extra, layout.kind)
    dst_ids = rnd.sample(range(dst.num_blocks), len(src_ids))
    src_buf = bytes(rnd.getrandbits(8) for _ in range(layout.total_bytes))
    return layout, src_ids, dst, dst_ids, src_buf


def _moved(pairs, src_buf, dst) -> bytearray:
    """A zeroed buffer of ``dst`` after each pair's bytes are copied into it from ``src_buf``."""
    dst_buf = bytearray(dst.total_bytes)
    for p in pairs:
        dst_buf[p.dst_offset : p.dst_offset + p.length] = src_buf[p.src_offset : p.src_offset + p.length]
    return dst_buf


@given(layouts_and_ids(), st.integers(0, 10), st.randoms(use_true_random=False))
def test_pair_ranges_move_each_block_to_its_destination(case, extra, rnd):
    layout, src_ids, dst, dst_ids, src_buf = _pair_case(case, extra, rnd)
    pairs = layout.pair_ranges(src_ids, dst_ids, dst)
    dst_buf = _moved(pairs, src_buf, dst)
    for s, d in zip(src_ids, dst_ids, strict=True):
        src_block = b"".join(src_buf[r.offset : r.end] for r in layout.block_ranges(s))
        dst_block = b"".join(dst_buf[r.offset : r.end] for r in dst.block_ranges(d))
        assert src_block == dst_block
    assert sum(p.length for p in pairs) == len(src_ids) * layout.bytes_per_block
    assert len(pairs) <= len(src_ids) * len(layout.pieces())


def test_default_is_block_major():
    assert DEFAULT_LAYOUT is LayoutKind.BLOCK_MAJOR
    assert KVLayout(SMOLLM2, 8).kind is LayoutKind.BLOCK_MAJOR


@pytest.mark.parametrize(
    ("kind", "contiguous", "scattered"),
    [(LayoutKind.BLOCK_MAJOR, 1, 64), (LayoutKind.PER_LAYER, 60, 64 * 60)],
)
def test_golden_range_counts_for_64_blocks_of_smollm2(kind, contiguous, scattered):
    layout = KVLayout(SMOLLM2, 256, kind)
    assert len(layout.batch_ranges(range(100, 164))) == contiguous
    assert len(layout.batch_ranges(range(0, 256, 4))) == scattered


def test_golden_offsets_block_major():
    layout = KVLayout(SMOLLM2, 10, LayoutKind.BLOCK_MAJOR)
    unit = 16 * 3 * 64 * 2
    assert layout.unit_bytes == unit
    assert layout.segment(2, 1, KVPart.V) == ByteRange((2 * 60 + 2 + 1) * unit, unit)
    assert layout.block_ranges(3) == (ByteRange(3 * 60 * unit, 60 * unit),)


def test_golden_offsets_per_layer():
    layout = KVLayout(SMOLLM2, 10, LayoutKind.PER_LAYER)
    unit = layout.unit_bytes
    assert layout.segment(2, 1, KVPart.V) == ByteRange((1 * 20 + 10 + 2) * unit, unit)
    assert len(layout.block_ranges(3)) == 60


def test_int8_scales_follow_the_data_region_aligned():
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=3, block_size=1, dtype="int8")
    layout = KVLayout(shape, 3, LayoutKind.BLOCK_MAJOR)
    assert layout.data_bytes == 3 * 2 * 2 * 3
    assert layout.scale_offset == 64
    assert layout.block_ranges(1) == (ByteRange(12, 12), ByteRange(64 + 16, 16))
    assert layout.total_bytes == 64 + 3 * 2 * 2 * 4


@given(layouts_and_ids(), st.integers(0, 10), st.randoms(use_true_random=False))
def test_pair_ranges_of_one_layer_move_that_layer_only(case, extra, rnd):
    layout, src_ids, dst, dst_ids, src_buf = _pair_case(case, extra, rnd)
    layer = rnd.randrange(layout.shape.num_layers)
    dst_buf = _moved(layout.pair_ranges(src_ids, dst_ids, dst, layer=layer), src_buf, dst)
    for s, d in zip(src_ids, dst_ids, strict=True):
        for other in range(layout.shape.num_layers):
            for part in KVPart:
                segs = [(layout.segment(s, other, part), dst.segment(d, other, part))]
                if layout.shape.dtype.is_quantized:
                    segs.append((layout.scale_segment(s, other, part), dst.scale_segment(d, other, part)))
                for src_seg, dst_seg in segs:
                    got = bytes(dst_buf[dst_seg.offset : dst_seg.end])
                    want = src_buf[src_seg.offset : src_seg.end] if other == layer else bytes(dst_seg.length)
                    assert got == want
    # every layer's ranges together move exactly what the whole-block ranges move
    whole = sum(p.length for p in layout.pair_ranges(src_ids, dst_ids, dst))
    assert sum(p.length for lay in range(layout.shape.num_layers)
               for p in layout.pair_ranges(src_ids, dst_ids, dst, layer=lay)) == whole


def test_pair_ranges_of_one_layer_coalesce_runs():
    layout = KVLayout(SMOLLM2, 16, LayoutKind.PER_LAYER)
    assert len(layout.pair_ranges(range(0, 6), range(8, 14), layer=2)) == 2  # K run, V run
    with pytest.raises(LayerIndexError, match="valid layers"):
        layout.pair_ranges([0], [1], layer=SMOLLM2.num_layers)


def test_layer_ranges_for_layerwise_transfer():
    per_layer = KVLayout(SMOLLM2, 8, LayoutKind.PER_LAYER)
    assert len(per_layer.layer_ranges(range(2, 6), layer=3)) == 2  # K row and V row
    block_major = KVLayout(SMOLLM2, 8, LayoutKind.BLOCK_MAJOR)
    ranges = block_major.layer_ranges(range(2, 6), layer=3)
    assert len(ranges) == 4 and all(r.length == 2 * block_major.unit_bytes for r in ranges)


def test_fit_stays_within_budget():
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=3, block_size=1, dtype="int8")
    layout = KVLayout.fit(shape, 100)
    assert layout is not None and layout.total_bytes <= 100
    assert KVLayout(shape, layout.num_blocks + 1).total_bytes > 100
    assert KVLayout.fit(SMOLLM2, 1000) is None


def test_layout_is_a_picklable_value():
    layout = KVLayout(SMOLLM2, 8, "per_layer")
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert hash(layout) == hash(KVLayout(SMOLLM2, 8, LayoutKind.PER_LAYER))


def test_misuse_raises_specific_errors():
    layout = KVLayout(SMOLLM2, 8)
    with pytest.raises(BlockIdError, match=r"block id 8 .* 0\.\.7"):
        layout.batch_ranges([1, 8])
    with pytest.raises(BlockIdError, match="block id -1"):
        layout.block_ranges(-1)
    with pytest.raises(LayerIndexError, match=r"layer 30 .* 0\.\.29"):
        layout.segment(0, 30, KVPart.K)
    with pytest.raises(TypeError, match="only int8"):
        layout.scale_segment(0, 0, KVPart.K)
    with pytest.raises(LayoutMismatchError, match="2 source blocks but 1"):
        layout.pair_ranges([0, 1], [2])
    with pytest.raises(BlockIdError, match="repeat"):
        layout.pair_ranges([0, 0], [1, 2])
    other = KVLayout(SMOLLM2, 8, LayoutKind.PER_LAYER)
    with pytest.raises(LayoutMismatchError, match="orders must match"):
        layout.pair_ranges([0], [0], other)
    with pytest.raises(LayoutError, match="unknown layout 'row_major'"):
        KVLayout(SMOLLM2, 8, "row_major")
    with pytest.raises(ValueError, match="num_blocks"):
        KVLayout(SMOLLM2, 0)
