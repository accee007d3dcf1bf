"""GGUF quantized blocks as mooncake_ops holds them, and their pure-PyTorch dequantisation.

A GGUF file stores a 2-D ``[N, K]`` weight row by row, each row ``K / block_size`` blocks of
``block_bytes`` bytes. Every block holds fp16 scales and small integers; per type (``d``, ``m``,
``dmin``: fp16; ``q``: the integers; ``sc``, ``mn``: 6-bit; values in their order in the row)::

    Q8_0  32 values,  34 B  [d | q int8 x32]                       w = d * q
    Q4_0  32 values,  18 B  [d | 16 B nibbles]                     w = d * (q - 8)
    Q4_1  32 values,  20 B  [d | m | 16 B nibbles]                 w = d * q + m
          nibbles: byte j holds element j (low 4 bits) and element j + 16 (high 4 bits)
    Q4_K 256 values, 144 B  [d | dmin | 12 B sc,mn | 128 B nibbles]
          8 sub-blocks of 32; sub-block s: w = (d * sc[s]) * q - dmin * mn[s]; its q are the
          low (s even) or high (s odd) nibbles of bytes 32 * (s // 2) .. + 31
    Q5_K 256 values, 176 B  [d | dmin | 12 B sc,mn | 32 B high bits | 128 B nibbles]
          as Q4_K, q = nibble + 16 * bit s of high-bit byte l (l: the element in its sub-block)
    Q6_K 256 values, 210 B  [128 B low nibbles | 64 B high 2-bit pairs | 16 x int8 sc | d]
          16 groups of 16: w = (d * sc[g]) * (q - 32), q 6-bit (layout in `_q6_k`)

`pack_gguf_weight` keeps those bytes, in one of two layouts of the same size (uint8, 3-D; the
last dim names the type and the layout, every size below being unique):

* **rows** ``[N, K / block_size, block_bytes]``: the file's bytes as they are (every type).
* **16 rows side by side** ``[N / 16, K / 32, 16 * block_bytes]``, for Q8_0, Q4_0 and Q4_1 when
  N is a multiple of 16: per 16-row group and block, the 16 rows' ``d``, then (Q4_1) their
  ``m``, then the quant bytes across the 16 rows (r0..r15; Q4's bytes in position pairs)::

      Q4_1  [d r0..r15 | m r0..r15 | bytes 0,1 of r0, bytes 0,1 of r1, ..., bytes 0,1 of r15 |
             bytes 2,3 of r0 ... r15 | ... | bytes 14,15 of r0 ... r15]
      Q4_0  the same without m;   Q8_0  [d r0..r15 | q0 of r0..r15 | ... | q31 of r0..r15]

  A 16-lane vector then holds one value of 16 output rows: the native kernel keeps one output
  per lane (no horizontal sums) and loads 16 scales in one instruction; a byte pair per row
  is one 32-bit lane, the pair of values bf16's dot product instruction takes.

Each product of an fp16 scale and the integers is exact in float32 (at most 23 significant
bits), so every dequantised value is one float32 rounding of its exact formula, as the gguf
package's numpy ``gguf.quants.dequantize`` computes it (the tests check bit equality).
`dequantize_gguf` is the reference the native kernels (``mooncake_ops.gguf_linear``) are tested
against.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from mooncake_ops.errors import OpsDTypeError, OpsShapeError

__all__ = ["GGUF_TYPES", "GROUP_ROWS", "GGUFType", "dequantize_gguf", "gguf_out_features",
           "gguf_type", "gguf_type_of", "is_grouped", "pack_gguf_weight", "raw_blocks"]

GROUP_ROWS = 16  # rows side by side in the grouped layout


@attrs.frozen
class GGUFType:
    """One GGUF block format.

    Attributes:
        name: GGUF's name (``Q4_1``).
        type_id: ggml's number for it (``GGMLQuantizationType``), what the native kernels take.
        block_size: values per block.
        block_bytes: bytes per block.
        header_bytes: the fp16 scale bytes at a block's start that the grouped layout gathers
            (0: the type has no grouped layout).
    """

    name: str
    type_id: int
    block_size: int
    block_bytes: int
    header_bytes: int = 0

    @property
    def is_groupable(self) -> bool:
        return self.header_bytes > 0

    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_size


GGUF_TYPES = {t.name: t for t in (
    GGUFType("Q4_0", 2, 32, 18, 2), GGUFType("Q4_1", 3, 32, 20, 4), GGUFType("Q8_0", 8, 32, 34, 2),
    GGUFType("Q4_K", 12, 256, 144), GGUFType("Q5_K", 13, 256, 176),
    GGUFType("Q6_K", 14, 256, 210))}
# last dim of a packed weight -> (type, grouped)
_BY_LAST = {t.block_bytes: (t, False) for t in GGUF_TYPES.values()} | {
    GROUP_ROWS * t.block_bytes: (t, True) for t in GGUF_TYPES.values() if t.is_groupable}
_BY_ID = {t.type_id: t for t in GGUF_TYPES.values()}
assert len(_BY_LAST) == len(GGUF_TYPES) + 3, "a packed weight's last dim names type and layout"


def gguf_type(name_or_id: str | int) -> GGUFType:
    """The block format named ``Q4_1`` (or ggml's number for it, or an enum with ``.name``).

    Raises:
        OpsDTypeError: not one of `GGUF_TYPES` (the message lists them).
    """
    key = getattr(name_or_id, "name", name_or_id)
    found = _BY_ID.get(key) if isinstance(key, int) else GGUF_TYPES.get(str(key).upper())
    if found is None:
        raise OpsDTypeError(f"GGUF type {name_or_id!r} has no quantized matmul here; allowed: "
                            f"{', '.join(GGUF_TYPES)} (F16 / BF16 / F32 tensors stay dense)")
    return found


def _layout(packed: torch.Tensor) -> tuple[GGUFType, bool]:
    found = _BY_LAST.get(packed.shape[-1]) if packed.dim() == 3 else None
    if packed.dtype != torch.uint8 or found is None:
        raise OpsShapeError(f"a GGUF weight is packed by pack_gguf_weight: uint8 [N, K / "
                            f"block_size, bytes] with bytes one of {sorted(_BY_LAST)}; got "
                            f"{packed.dtype} {tuple(packed.shape)}")
    return found


def gguf_type_of(packed: torch.Tensor) -> GGUFType:
    """The block format of a packed weight (either layout).

    Raises:
        OpsShapeError: ``packed`` is not a packed GGUF weight.
    """
    return _layout(packed)[0]


def is_grouped(packed: torch.Tensor) -> bool:
    """Whether a packed weight has the 16-rows-side-by-side layout."""
    return _layout(packed)[1]


def gguf_out_features(packed: torch.Tensor) -> int:
    """N, the packed weight's output rows."""
    return packed.shape[0] * (GROUP_ROWS if is_grouped(packed) else 1)


def pack_gguf_weight(blocks: torch.Tensor, kind: str | int | GGUFType,
                     in_features: int | None = None, *, grouped: bool = True) -> torch.Tensor:
    """A GGUF tensor's bytes -> its packed weight (see the module docstring for the layouts).

    Args:
        blocks: the bytes as the file stores them: uint8 ``[N, K / block_size * block_bytes]``
            (gguf's ``ReaderTensor.data``) or ``[N, K / block_size, block_bytes]``.
        kind: the GGUF type (``"Q4_1"``, ggml's number, or a `GGUFType`).
        in_features: K, checked against the bytes when given.
        grouped: lay Q8_0 / Q4_0 / Q4_1 out 16 rows side by side where N allows (the layout
            the native kernel runs fastest); False keeps the file's rows.

    Raises:
        OpsDTypeError: an unsupported type, or bytes that are not uint8.
        OpsShapeError: the bytes do not split into whole blocks of that type (or of K).
    """
    kind = kind if isinstance(kind, GGUFType) else gguf_type(kind)
    if blocks.dtype != torch.uint8:
        raise OpsDTypeError(f"GGUF blocks are raw bytes (uint8); got {blocks.dtype}")
    row_bytes = blocks.shape[-1] * (blocks.shape[-2] if blocks.dim() == 3 else 1)
    if blocks.dim() not in (2, 3) or row_bytes % kind.block_bytes or (
            blocks.dim() == 3 and blocks.shape[-1] != kind.block_bytes):
        raise OpsShapeError(f"{kind.name} rows are whole blocks of {kind.block_bytes} bytes "
                            f"([N, bytes] or [N, blocks, {kind.block_bytes}]); got "
                            f"{tuple(blocks.shape)}")
    num_blocks = row_bytes // kind.block_bytes
    if in_features is not None and in_features != num_blocks * kind.block_size:
        raise OpsShapeError(f"{kind.name} rows of {row_bytes} bytes hold "
                            f"{num_blocks * kind.block_size} values; expected {in_features}")
    rows = blocks.reshape(blocks.shape[0], num_blocks, kind.block_bytes)
    if grouped and kind.is_groupable and rows.shape[0] % GROUP_ROWS == 0:
        return _group(rows, kind)
    return rows.contiguous()


def _pair_width(kind: GGUFType) -> int:
    """Quant bytes per row side by side in the grouped layout: Q4's in pairs, Q8_0's alone."""
    return 2 if kind.name in ("Q4_0", "Q4_1") else 1


def _group(rows: torch.Tensor, kind: GGUFType) -> torch.Tensor:
    """[N, nb, bb] -> [N / 16, nb, 16 * bb]: scales of the 16 rows, then quant bytes by position."""
    g = rows.unflatten(0, (-1, GROUP_ROWS)).transpose(1, 2)  # [G, nb, 16, bb]
    parts = [g[..., h:h + 2].flatten(-2) for h in range(0, kind.header_bytes, 2)]
    quants = g[..., kind.header_bytes:].unflatten(-1, (-1, _pair_width(kind)))  # [.., r, p, w]
    parts.append(quants.transpose(-3, -2).flatten(-3))
    return torch.cat(parts, dim=-1).contiguous()


def raw_blocks(packed: torch.Tensor) -> torch.Tensor:
    """The file's rows ``[N, K / block_size, block_bytes]`` of a packed weight (either layout).

    Raises:
        OpsShapeError: ``packed`` is not a packed GGUF weight.
    """
    kind, grouped = _layout(packed)
    if not grouped:
        return packed
    head = GROUP_ROWS * kind.header_bytes
    parts = [packed[..., h:h + 2 * GROUP_ROWS].unflatten(-1, (GROUP_ROWS, 2))
             for h in range(0, head, 2 * GROUP_ROWS)]
    quants = packed[..., head:].unflatten(-1, (-1, GROUP_ROWS, _pair_width(kind)))  # [.., p, r, w]
    parts.append(quants.transpose(-3, -2).flatten(-2))
    return torch.cat(parts, dim=-1).transpose(1, 2).flatten(0, 1)  # [G, 16, nb, bb] -> rows


def dequantize_gguf(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``[N, K]`` weight a packed GGUF weight stands for (float32 values, exactly the
    gguf package's; then cast to ``dtype``).

    Raises:
        OpsShapeError: ``packed`` is not a packed GGUF weight.
    """
    blocks = raw_blocks(packed)
    values = _DEQUANTIZE[gguf_type_of(packed).name](blocks)
    return values.reshape(blocks.shape[0], -1).to(dtype)


def _f16(bytes_: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian fp16 bytes -> float32 [..., 1]."""
    return bytes_.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2, n]: their low nibbles, then their high ones."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 2:]).flatten(-2)
    return _f16(b[..., :2]) * (q.float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 4:]).flatten(-2)
    return _f16(b[..., :2]) * q.float() + _f16(b[..., 2:4])


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (d * sc, dmin * mn), float32 [..., 8, 1], from d, dmin and the 12 bytes
    that pack eight 6-bit scales and eight 6-bit mins::

        bytes 0-3   sc[0..3] (low 6 bits), sc[4..7] bits 4-5 (top 2 bits)
        bytes 4-7   mn[0..3] (low 6 bits), mn[4..7] bits 4-5 (top 2 bits)
        bytes 8-11  sc[4..7] bits 0-3 (low nibble), mn[4..7] bits 0-3 (high nibble)
    """
    s = b[..., 4:16]
    a, m, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (c >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return ((_f16(b[..., 0:2]) * sc.float()).unsqueeze(-1),
            (_f16(b[..., 2:4]) * mn.float()).unsqueeze(-1))


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [..., 8, 32]: sub-block s is the low (even s) / high (odd s) nibbles of bytes
    32 * (s // 2) .. + 31."""
    return _nibbles(qs.unflatten(-1, (4, 32))).flatten(-3, -2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_scales(b)
    return scale * _k_nibbles(b[..., 16:]).float() - offset


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_scales(b)
    bits = torch.stack([(b[..., 16:48] >> s) & 1 for s in range(8)], dim=-2)  # [..., 8, 32]
    q = _k_nibbles(b[..., 48:]) | (bits << 4)
    return scale * q.float() - offset


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Two halves of 128 values. Half h, its rows of 32 t = 0..3: low nibbles of bytes
    64h + 32 (t % 2) .. + 31, shifted by 4 (t // 2); high 2 bits of bytes 128 + 32h .. + 31,
    shifted by 2t. Groups of 16 values in that order take sc[0..15]."""
    low = _nibbles(b[..., :128].unflatten(-1, (2, 2, 32)))  # [..., h, j, shift, 32]
    low = low.transpose(-3, -2).flatten(-4, -2)  # [..., 8, 32]: h, shift, j
    high = torch.stack([(b[..., 128:192].unflatten(-1, (2, 32)) >> (2 * t)) & 3
                        for t in range(4)], dim=-2).flatten(-3, -2)  # [..., 8, 32]: h, t
    q = (low | (high << 4)).to(torch.int8) - 32
    scale = _f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()
    return scale.unsqueeze(-1) * q.float().flatten(-2).unflatten(-1, (16, 16))


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
