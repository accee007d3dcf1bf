"""KV layout: where each block's K, V (and int8 scales) live inside one pool buffer.

A pool is a single byte buffer. Its data region holds `num_blocks x num_layers x 2` *units*,
one unit being one block's K (or V) for one layer: block_size x num_kv_heads x head_dim
elements. A latent layout (``num_parts`` 1: MLA caches one compressed vector per token and
layer) has K units only, `num_blocks x num_layers` of them, in the same orders. Two orders of the same units are supported:

    BLOCK_MAJOR  [block][layer][k|v][token][head][dim]      (default, chosen by measurement)

        | blk 0: L0.K L0.V L1.K L1.V ... | blk 1: L0.K L0.V ... | blk 2: ...
        '------------ one range --------'   blocks 0-1 together: still one range

    PER_LAYER    [layer][k|v][block][token][head][dim]

        | L0.K: blk0 blk1 blk2 ... | L0.V: blk0 blk1 ... | L1.K: ... | ...
          ^ block 1 is 2 x num_layers separate ranges, one in every (layer, k|v) row

With int8 the float32 scales ([token][head] per unit) follow the data region in the same
order, starting at a 64-byte aligned offset. Either way every block occupies a fixed set of
*pieces* (base, stride): block b covers [base + b*stride, base + (b+1)*stride) in each piece.
Consecutive block ids therefore extend a piece instead of adding ranges, which is what
`batch_ranges` and `pair_ranges` exploit to hand a transfer engine few, large ranges.

Offsets are relative to the start of the pool buffer; add the buffer's address to get what a
one-sided transfer engine registers and reads or writes.

Pure Python: the torch tensors over this layout live in `mooncake_kv.pool`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import attrs

from mooncake_kv.sizing import SCALE_BYTES, KVShape, SizingError, max_num_blocks
from mooncake_kv.types import BlockId, KVCacheError

__all__ = [
    "DEFAULT_LAYOUT",
    "BlockIdError",
    "ByteRange",
    "KVLayout",
    "KVPart",
    "LayerIndexError",
    "LayoutError",
    "LayoutKind",
    "LayoutMismatchError",
    "RangePair",
]

SCALE_ALIGN = 64


class BlockIdError(KVCacheError, IndexError):
    """A block id outside the pool, or one given twice where ids must be distinct."""


class LayerIndexError(KVCacheError, IndexError):
    """A layer index outside 0..num_layers-1."""


class LayoutError(KVCacheError, ValueError):
    """An unknown layout name."""


class LayoutMismatchError(LayoutError):
    """Two layouts that cannot exchange blocks (different shape or order)."""


class LayoutKind(str, enum.Enum):
    """Physical order of the pool's units (see the module docstring)."""

    BLOCK_MAJOR = "block_major"
    PER_LAYER = "per_layer"


# Measured by `python -m mooncake_kv.layout_bench` (docs/mooncake_kv.md, "Pool, layout and
# tiers"): block-major needs 1 range per run of blocks instead of 2 x num_layers, and reading
# the per-layer views for attention costs the same in both orders.
DEFAULT_LAYOUT = LayoutKind.BLOCK_MAJOR


class KVPart(enum.IntEnum):
    K = 0
    V = 1


@attrs.frozen
class ByteRange:
    """`length` bytes starting `offset` bytes into the pool buffer."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@attrs.frozen
class RangePair:
    """One contiguous copy: `length` bytes from src_offset (source pool) to dst_offset."""

    src_offset: int
    dst_offset: int
    length: int


def _parse_kind(value: LayoutKind | str) -> LayoutKind:
    try:
        return LayoutKind(value)
    except ValueError:
        allowed = [kind.value for kind in LayoutKind]
        raise LayoutError(f"unknown layout {value!r}; use one of {allowed}") from None


def _positive_int(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SizingError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class KVLayout:
    """Byte geometry of a pool of `num_blocks` blocks of `shape`, in `kind` order.

    A frozen, picklable value: a pool's layout can be sent to another process (attach to a
    shared pool) or a peer (compute remote offsets) as is.
    """

    shape: KVShape
    num_blocks: int = attrs.field(validator=_positive_int)
    kind: LayoutKind = attrs.field(default=DEFAULT_LAYOUT, converter=_parse_kind)

    @classmethod
    def fit(
        cls, shape: KVShape, num_bytes: int, kind: LayoutKind | str = DEFAULT_LAYOUT
    ) -> KVLayout | None:
        """The largest layout whose buffer fits in `num_bytes`; None when no block fits."""
        num_blocks = max_num_blocks(shape, num_bytes)
        while num_blocks > 0:
            layout = cls(shape, num_blocks, kind)
            if layout.total_bytes <= num_bytes:
                return layout
            num_blocks -= 1  # the scale region's alignment padding did not fit
        return None

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def unit_elements(self) -> int:
        """Elements in one unit: one block's K (or V) of one layer."""
        return self.shape.block_size * self.shape.num_kv_heads * self.shape.head_dim

    @property
    def unit_bytes(self) -> int:
        return self.unit_elements * self.shape.dtype.element_bytes

    @property
    def scale_unit_elements(self) -> int:
        """float32 scales in one unit (0 unless int8)."""
        if not self.shape.dtype.is_quantized:
            return 0
        return self.shape.block_size * self.shape.num_kv_heads

    @property
    def num_units(self) -> int:
        return self.num_blocks * self.shape.num_layers * self.shape.num_parts

    @property
    def data_bytes(self) -> int:
        return self.num_units * self.unit_bytes

    @property
    def scale_offset(self) -> int:
        """Start of the scale region (== data_bytes rounded up to 64; unused unless int8)."""
        return -(-self.data_bytes // SCALE_ALIGN) * SCALE_ALIGN

    @property
    def total_bytes(self) -> int:
        if not self.shape.dtype.is_quantized:
            return self.data_bytes
        return self.scale_offset + self.num_units * self.scale_unit_elements * SCALE_BYTES

    @property
    def bytes_per_block(self) -> int:
        return self.shape.bytes_per_block

    @property
    def parts(self) -> tuple[KVPart, ...]:
        """The parts each (block, layer) holds: K and V, or K alone (a latent layout)."""
        return tuple(KVPart)[:self.shape.num_parts]

    # ---- unit arithmetic -------------------------------------------------------------------
    def unit_strides(self) -> tuple[int, int, int]:
        """(block, layer, part) strides counted in units."""
        num_layers, num_blocks, parts = self.shape.num_layers, self.num_blocks, self.shape.num_parts
        if self.kind is LayoutKind.BLOCK_MAJOR:
            return parts * num_layers, parts, 1
        return 1, parts * num_blocks, num_blocks

    def unit_index(self, block_id: BlockId, layer: int, part: KVPart) -> int:
        """Position of (block, layer, part) among the units of the data region."""
        self.check_block_id(block_id)
        self.check_layer(layer)
        if int(part) >= self.shape.num_parts:
            raise LayoutError(f"a latent layout (num_parts=1) holds K only; got part {part!r}")
        block_stride, layer_stride, part_stride = self.unit_strides()
        return block_id * block_stride + layer * layer_stride + int(part) * part_stride

    def segment(self, block_id: BlockId, layer: int, part: KVPart) -> ByteRange:
        """Bytes of one block's K or V elements for one layer."""
        index = self.unit_index(block_id, layer, part)
        return ByteRange(index * self.unit_bytes, self.unit_bytes)

    def scale_segment(self, block_id: BlockId, layer: int, part: KVPart) -> ByteRange:
        """Bytes of one block's K or V float32 scales for one layer (int8 only).

        Raises:
            TypeError: when the layout is not int8 (it has no scales).
        """
        if not self.shape.dtype.is_quantized:
            raise TypeError(f"a {self.shape.dtype.value} layout has no scales; only int8 does")
        index = self.unit_index(block_id, layer, part)
        length = self.scale_unit_elements * SCALE_BYTES
        return ByteRange(self.scale_offset + index * length, length)

    def pieces(self) -> tuple[tuple[int, int], ...]:
        """(base, stride) pairs: block b covers [base + b*stride, base + (b+1)*stride) in each."""
        unit, scale_unit = self.unit_bytes, self.scale_unit_elements * SCALE_BYTES
        rows_per_block = self.shape.num_parts * self.shape.num_layers
        if self.kind is LayoutKind.BLOCK_MAJOR:
            data = [(0, rows_per_block * unit)]
            scales = [(self.scale_offset, rows_per_block * scale_unit)]
        else:
            rows = [row * self.num_blocks for row in range(rows_per_block)]
            data = [(row * unit, unit) for row in rows]
            scales = [(self.scale_offset + row * scale_unit, scale_unit) for row in rows]
        return tuple(data + (scales if scale_unit else []))

    # ---- ranges for transfer ----------------------------------------------------------------
    def block_ranges(self, block_id: BlockId) -> tuple[ByteRange, ...]:
        """The ranges one block occupies, fewest possible (block-major: 1, or 2 with int8)."""
        return self.batch_ranges((block_id,))

    def batch_ranges(self, block_ids: Iterable[BlockId]) -> tuple[ByteRange, ...]:
        """Coalesced ranges covering exactly the given blocks (order and repeats ignored).

        Consecutive ids share ranges: a run of m blocks costs one range per piece, however
        large m is. Ranges are sorted by offset and never overlap.
        """
        runs = _runs(sorted(set(self._checked(block_ids))))
        spans = sorted(
            (base + start * stride, count * stride)
            for start, count in runs
            for base, stride in self.pieces()
        )
        return tuple(ByteRange(offset, length) for offset, length in _merge(spans))

    def pair_ranges(
        self,
        src_block_ids: Sequence[BlockId],
        dst_block_ids: Sequence[BlockId],
        dst: KVLayout | None = None,
        *,
        layer: int | None = None,
    ) -> tuple[RangePair, ...]:
        """Copies that move src blocks (in this layout) into dst blocks (in `dst`, default self).

        The i-th source block lands in the i-th destination block. Runs that are consecutive
        on both sides coalesce, so a PD handoff of freshly allocated blocks is a few ranges.
        With ``layer``, only that layer's K and V (and scales) move: what a layer-wise push
        sends as soon as the layer has run (per-layer order: 2 ranges per run of blocks).

        Raises:
            LayoutMismatchError: lists of different length, or `dst` of another shape/order.
            BlockIdError: an id out of range, or an id repeated on either side.
            LayerIndexError: ``layer`` is not a layer of this layout.
        """
        dst = self if dst is None else dst
        self._check_compatible(dst, len(src_block_ids), len(dst_block_ids))
        pairs = sorted(zip(self._distinct(src_block_ids), dst._distinct(dst_block_ids), strict=True))
        if layer is not None:
            self.check_layer(layer)
        pieces = list(zip(self._pieces(layer), dst._pieces(layer), strict=True))
        spans = sorted(
            span
            for s, d, count in _pair_runs(pairs)
            for (src_base, stride, length), (dst_base, _, _) in pieces
            for span in _piece_spans(src_base, dst_base, stride, length, s, d, count)
        )
        return tuple(RangePair(*span) for span in _merge_pairs(spans))

    def head_pair_ranges(
        self,
        src_block_ids: Sequence[BlockId],
        dst_block_ids: Sequence[BlockId],
        dst: KVLayout,
        *,
        src_head: int,
        dst_head: int,
        num_heads: int,
    ) -> tuple[RangePair, ...]:
        """Copies that move heads ``[src_head, +num_heads)`` of src blocks (this layout) into
        heads ``[dst_head, +num_heads)`` of dst blocks (``dst``: a pool of the same model with
        its own head count, as two TP ranks hold): a re-sharding hand-off's byte ranges.

        A unit is ``[token][head][dim]``, so a slice of its heads is one range per token::

            unit (3 heads)   | t0: h0 h1 h2 | t1: h0 h1 h2 | ...     heads [1, 3) of it:
                                  '--.--'        '--.--'           one range per token

        int8 scales (``[token][head]`` per unit) move the same way. A slice that is every head
        on both sides is whole units: ``pair_ranges``' coalesced ranges.

        Raises:
            LayoutMismatchError: lists of different length, or layouts that differ in more
                than their head count and block count (layers, head size, block size, dtype,
                parts, order).
            BlockIdError: an id out of range, or an id repeated on either side.
            ValueError: a head slice outside either layout's heads.
        """
        src_shape, dst_shape = self.shape, dst.shape
        if attrs.evolve(src_shape, num_kv_heads=dst_shape.num_kv_heads) != dst_shape or (
                dst.kind is not self.kind):
            raise LayoutMismatchError(
                f"cannot move heads of {src_shape.fingerprint()}/{self.kind.value} blocks into "
                f"{dst_shape.fingerprint()}/{dst.kind.value}; only the head counts may differ"
            )
        for name, start, layout in (("source", src_head, self), ("destination", dst_head, dst)):
            if num_heads < 1 or start < 0 or start + num_heads > layout.shape.num_kv_heads:
                raise ValueError(
                    f"{name} heads [{start}, {start + num_heads}) are not within its "
                    f"{layout.shape.num_kv_heads} heads; give a slice of at least one head"
                )
        if num_heads == src_shape.num_kv_heads == dst_shape.num_kv_heads:
            return self.pair_ranges(src_block_ids, dst_block_ids, dst)
        if len(src_block_ids) != len(dst_block_ids):
            raise LayoutMismatchError(f"{len(src_block_ids)} source blocks but "
                                      f"{len(dst_block_ids)} destination blocks; give one each")
        pairs = list(zip(self._distinct(src_block_ids), dst._distinct(dst_block_ids), strict=True))
        spans = []
        for src_region, dst_region, head_bytes in self._head_regions(dst):
            length = num_heads * head_bytes
            src_first, dst_first = src_head * head_bytes, dst_head * head_bytes
            for s, d in pairs:
                for layer in range(src_shape.num_layers):
                    for part in self.parts:
                        src_at = (src_region.base + self.unit_index(s, layer, part) * src_region.unit
                                  + src_first)
                        dst_at = (dst_region.base + dst.unit_index(d, layer, part) * dst_region.unit
                                  + dst_first)
                        spans.extend((src_at + t * src_region.token, dst_at + t * dst_region.token,
                                      length)
                                     for t in range(src_shape.block_size))
        return tuple(RangePair(*span) for span in _merge_pairs(sorted(spans)))

    def _head_regions(self, dst: KVLayout) -> list[tuple[_Region, _Region, int]]:
        """(this layout's region, ``dst``'s, bytes of one head of one token) for the data and,
        with int8, the scales."""
        elem = self.shape.dtype.element_bytes
        out = [(_Region(0, self.unit_bytes, self.shape.num_kv_heads * self.shape.head_dim * elem),
                _Region(0, dst.unit_bytes, dst.shape.num_kv_heads * dst.shape.head_dim * elem),
                self.shape.head_dim * elem)]
        if self.shape.dtype.is_quantized:
            out.append((_Region(self.scale_offset, self.scale_unit_elements * SCALE_BYTES,
                                self.shape.num_kv_heads * SCALE_BYTES),
                        _Region(dst.scale_offset, dst.scale_unit_elements * SCALE_BYTES,
                                dst.shape.num_kv_heads * SCALE_BYTES),
                        SCALE_BYTES))
        return out

    def _pieces(self, layer: int | None) -> list[tuple[int, int, int]]:
        """(base, stride, length): block b holds [base + b*stride, + length) of each piece;
        all layers (length == stride) or one layer's K, V and scale parts."""
        if layer is None:
            return [(base, stride, stride) for base, stride in self.pieces()]
        unit, scale_unit = self.unit_bytes, self.scale_unit_elements * SCALE_BYTES
        block_stride, layer_stride, part_stride = self.unit_strides()
        out = []
        for size, origin in ((unit, 0), (scale_unit, self.scale_offset)):
            if not size:
                continue
            if self.kind is LayoutKind.BLOCK_MAJOR:  # K and V of a layer are adjacent in a block
                out.append((origin + layer * layer_stride * size, block_stride * size,
                            self.shape.num_parts * size))
            else:
                out.extend((origin + (layer * layer_stride + part * part_stride) * size, size,
                            size) for part in range(self.shape.num_parts))
        return out

    def layer_ranges(self, block_ids: Iterable[BlockId], layer: int) -> tuple[ByteRange, ...]:
        """Coalesced ranges of one layer's K and V (and scales) for the blocks.

        For layer-by-layer transfer that starts sending layer 0 while later layers compute.
        """
        self.check_layer(layer)
        spans = []
        for block_id in sorted(set(self._checked(block_ids))):
            for part in self.parts:
                segments = [self.segment(block_id, layer, part)]
                if self.shape.dtype.is_quantized:
                    segments.append(self.scale_segment(block_id, layer, part))
                spans.extend((seg.offset, seg.length) for seg in segments)
        return tuple(ByteRange(offset, length) for offset, length in _merge(sorted(spans)))

    # ---- validation ---------------------------------------------------------------------------
    def check_block_id(self, block_id: BlockId) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise BlockIdError(
                f"block id {block_id!r} is outside this pool; valid ids are "
                f"0..{self.num_blocks - 1}"
            )

    def check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.shape.num_layers:
            raise LayerIndexError(
                f"layer {layer!r} does not exist; valid layers are 0..{self.shape.num_layers - 1}"
            )

    def _checked(self, block_ids: Iterable[BlockId]) -> Iterable[BlockId]:
        for block_id in block_ids:
            self.check_block_id(block_id)
            yield block_id

    def _distinct(self, block_ids: Sequence[BlockId]) -> list[BlockId]:
        checked = list(self._checked(block_ids))
        if len(set(checked)) != len(checked):
            raise BlockIdError(
                f"block ids {list(block_ids)} repeat an id; each block may be copied only once"
            )
        return checked

    def _check_compatible(self, dst: KVLayout, num_src: int, num_dst: int) -> None:
        if num_src != num_dst:
            raise LayoutMismatchError(
                f"{num_src} source blocks but {num_dst} destination blocks; give one each"
            )
        if dst.shape != self.shape or dst.kind is not self.kind:
            raise LayoutMismatchError(
                f"cannot copy {self.shape.fingerprint()}/{self.kind.value} blocks into "
                f"{dst.shape.fingerprint()}/{dst.kind.value}; shapes and orders must match"
            )


@attrs.frozen
class _Region:
    """Where a layout's units lie: ``base`` + unit index x ``unit``; ``token`` bytes a token."""

    base: int
    unit: int
    token: int


def _runs(sorted_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) for each run of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for block_id in sorted_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def _pair_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, count) for each run consecutive on both sides; pairs sorted by src."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _piece_spans(src_base: int, dst_base: int, stride: int, length: int, src: int, dst: int,
                 count: int) -> list[tuple[int, int, int]]:
    """(src, dst, length) spans of a run of ``count`` blocks in one piece."""
    if length == stride:  # the run is contiguous in this piece
        return [(src_base + src * stride, dst_base + dst * stride, count * stride)]
    return [(src_base + (src + i) * stride, dst_base + (dst + i) * stride, length)
            for i in range(count)]


def _merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Join sorted (offset, length) spans that touch."""
    merged: list[tuple[int, int]] = []
    for offset, length in spans:
        if merged and sum(merged[-1]) == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((offset, length))
    return merged


def _merge_pairs(spans: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join sorted (src, dst, length) spans that touch on both sides."""
    merged: list[tuple[int, int, int]] = []
    for src, dst, length in spans:
        last = merged[-1] if merged else None
        if last and last[0] + last[2] == src and last[1] + last[2] == dst:
            merged[-1] = (last[0], last[1], last[2] + length)
        else:
            merged.append((src, dst, length))
    return merged
