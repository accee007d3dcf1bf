"""Columnar transfer batches: many ranges between one local and one remote handle, as arrays.

A ``TransferBatch`` is the vectorised form of a list of ``TransferOp``: one local handle, one
remote handle and three int64 columns. Engines turn whatever they are given into batches once
(``batches_of``), validate them with whole-array comparisons and copy them with ``copy_ranges``,
which first merges ranges that are adjacent on both sides::

    ops (submission order)          coalesced
    src 0..4K  → dst 8K..12K        src 0..8K  → dst 8K..16K   (one memmove)
    src 4K..8K → dst 12K..16K
    src 8K..12K → dst 0..4K         src 8K..12K → dst 0..4K

KV blocks arrive as block ids, so ``TransferBatch.from_blocks`` builds the columns from two id
arrays without a Python loop; building a list of ``TransferOp`` costs ~1 µs per range.

Small batches (up to ``SMALL_BATCH`` ops, e.g. one call per token) are kept as plain int lists:
for them a handful of numpy calls would cost more than the whole Python loop. The helpers here
(``first_overflow``, ``copy_batch``) accept either kind.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import attrs
import numpy as np

from kthena_comm.transfer.handle import MemoryHandle, TransferOp

_COLUMNS = ("local_offsets", "remote_offsets", "lengths")
SMALL_BATCH = 8
"""Op lists up to this long stay plain Python ints (see the module docstring)."""

Column = np.ndarray | list[int]


def _int64_column(value: Any) -> np.ndarray:
    array = np.ascontiguousarray(np.asarray(value, dtype=np.int64).reshape(-1))
    array.flags.writeable = False
    return array


def _check_columns(batch: TransferBatch, attribute: attrs.Attribute, value: np.ndarray) -> None:
    if len(batch.local_offsets) != len(value) or len(batch.remote_offsets) != len(value):
        raise ValueError(f"columns differ in length: {len(batch.local_offsets)} local offsets, "
                         f"{len(batch.remote_offsets)} remote offsets, {len(value)} lengths")
    if len(value) and (value.min() <= 0 or batch.local_offsets.min() < 0
                       or batch.remote_offsets.min() < 0):
        raise ValueError("lengths must be > 0 and offsets >= 0")


@attrs.frozen(eq=False)
class TransferBatch:
    """``lengths[i]`` bytes between ``local`` at ``local_offsets[i]`` and ``remote`` at
    ``remote_offsets[i]``, for every i (columns are read-only int64 arrays)."""

    local: MemoryHandle
    remote: MemoryHandle
    local_offsets: np.ndarray = attrs.field(converter=_int64_column)
    remote_offsets: np.ndarray = attrs.field(converter=_int64_column)
    lengths: np.ndarray = attrs.field(converter=_int64_column, validator=_check_columns)

    @classmethod
    def from_blocks(cls, local: MemoryHandle, remote: MemoryHandle, local_block_ids: Any,
                    remote_block_ids: Any, block_bytes: int) -> TransferBatch:
        """Whole blocks ``local_block_ids[i]`` → ``remote_block_ids[i]`` of ``block_bytes`` each."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        local_ids = np.asarray(local_block_ids, dtype=np.int64)
        lengths = np.full(len(local_ids), block_bytes, dtype=np.int64)
        return cls(local, remote, local_ids * block_bytes,
                   np.asarray(remote_block_ids, dtype=np.int64) * block_bytes, lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def to_ops(self) -> list[TransferOp]:
        """The same ranges as ``TransferOp`` values."""
        return [TransferOp(self.local, lo, self.remote, ro, n) for lo, ro, n in
                zip(*(getattr(self, c).tolist() for c in _COLUMNS), strict=True)]



class SmallBatch:
    """A few ranges as plain int lists: the same attributes as ``TransferBatch``, built without
    numpy (the ops' own validators already checked the fields). Internal to the engines."""

    __slots__ = ("local", "remote", "local_offsets", "remote_offsets", "lengths")

    def __init__(self, local: MemoryHandle, remote: MemoryHandle, local_offsets: list[int],
                 remote_offsets: list[int], lengths: list[int]) -> None:
        self.local, self.remote = local, remote
        self.local_offsets, self.remote_offsets, self.lengths = local_offsets, remote_offsets, lengths

    def __len__(self) -> int:
        return len(self.lengths)


Ranges = TransferBatch | SmallBatch
"""What engines work on after validation: a columnar batch or a small one."""


_LOCAL, _REMOTE = attrgetter("local"), attrgetter("remote")
_FIELDS = {c: attrgetter(f) for c, f in zip(_COLUMNS, ("local_offset", "remote_offset", "length"),
                                              strict=True)}


def batches_of(ops: Sequence[TransferOp] | TransferBatch) -> list[Ranges]:
    """Group ops by (local, remote) handle into columnar batches, keeping submission order."""
    if isinstance(ops, TransferBatch):
        return [ops] if len(ops) else []
    ops = ops if isinstance(ops, list) else list(ops)
    if not ops:
        return []
    first = ops[0]
    if len(ops) == 1:
        return [SmallBatch(first.local, first.remote, [first.local_offset],
                           [first.remote_offset], [first.length])]
    locals_, remotes = list(map(_LOCAL, ops)), list(map(_REMOTE, ops))
    if locals_.count(first.local) == len(ops) and remotes.count(first.remote) == len(ops):
        return [_columns_of(first.local, first.remote, ops)]  # the common case: C-speed checks
    groups: dict[tuple[MemoryHandle, MemoryHandle], list[TransferOp]] = {}  # mixed handles
    for item in ops:
        groups.setdefault((item.local, item.remote), []).append(item)
    return [_columns_of(local, remote, group) for (local, remote), group in groups.items()]


def _columns_of(local: MemoryHandle, remote: MemoryHandle, ops: list[TransferOp]) -> Ranges:
    n = len(ops)
    if n <= SMALL_BATCH:
        return SmallBatch(local, remote, *(list(map(_FIELDS[c], ops)) for c in _COLUMNS))
    columns = [np.fromiter(map(_FIELDS[c], ops), np.int64, n) for c in _COLUMNS]
    return TransferBatch(local, remote, *columns)


def first_overflow(offsets: Column, lengths: Column, limit: int) -> int | None:
    """Index of the first range ``[offset, offset + length)`` that ends past ``limit``."""
    if isinstance(offsets, list):
        for i in range(len(offsets)):
            if offsets[i] + lengths[i] > limit:
                return i
        return None
    over = offsets + lengths > limit
    return int(over.argmax()) if over.any() else None


def coalesce(dst: np.ndarray, src: np.ndarray,
             lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive ranges that continue each other on both sides (order is kept)."""
    if len(lengths) < 2:
        return dst, src, lengths
    breaks = (dst[1:] != dst[:-1] + lengths[:-1]) | (src[1:] != src[:-1] + lengths[:-1])
    if breaks.all():
        return dst, src, lengths
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    return dst[starts], src[starts], np.add.reduceat(lengths, starts)


_memmove = ctypes.memmove  # a foreign call: ctypes releases the GIL for each copy


def copy_ranges(dst: Column, src: Column, lengths: Column) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every i.

    Adjacent ranges are merged first, so a batch of contiguous blocks is one memmove; the
    remaining ranges are copied in one tight loop over plain ints.
    """
    if isinstance(lengths, list):  # a small batch: the loop is all there is
        for d, s, n in zip(dst, src, lengths):  # noqa: B905 (equal by construction)
            _memmove(d, s, n)
        return
    dst, src, lengths = coalesce(dst, src, lengths)
    if len(lengths) == 1:
        _memmove(int(dst[0]), int(src[0]), int(lengths[0]))
        return
    for d, s, n in zip(dst.tolist(), src.tolist(), lengths.tolist(), strict=True):
        _memmove(d, s, n)


def copy_batch(op: str, batch: Ranges, local_base: int, remote_base: int) -> None:
    """Run a validated batch between two mapped bases: put copies local → remote, get back."""
    if type(batch) is SmallBatch:  # the per-call path: nothing but the loop
        put = op == "put"
        for lo, ro, n in zip(batch.local_offsets, batch.remote_offsets, batch.lengths):  # noqa: B905
            if put:
                _memmove(remote_base + ro, local_base + lo, n)
            else:
                _memmove(local_base + lo, remote_base + ro, n)
        return
    local = local_base + batch.local_offsets
    remote = remote_base + batch.remote_offsets
    copy_ranges(*put_or_get(op, local, remote), batch.lengths)


def put_or_get(op: str, local: Column, remote: Column) -> tuple[Column, Column]:
    """(dst, src) address columns of a put (local → remote) or a get (remote → local)."""
    return (remote, local) if op == "put" else (local, remote)
