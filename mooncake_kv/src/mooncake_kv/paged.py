"""PagedBatch: one step's block tables and slot mapping, in the form the paged ops take.

It is the one batch-metadata type: ``paged_batch`` builds it from the block ids
``KVCacheManager`` hands out, and the engine's model reads it as is (attention, KV writes,
RoPE positions, the logits rows).

Sequence ``s`` has ``c_s`` tokens already in the cache and ``q_s`` new ones; its new tokens
are packed after the previous sequence's::

    packed token   | s0: q0 tokens | s1: q1 tokens | ...              T = sum(q)
    positions      | c0 .. c0+q0-1 | c1 .. c1+q1-1 | ...
    slot_mapping   block_tables[s, pos // block_size] * block_size + pos % block_size
    logits_indices[s] = (q0 + ... + q_s) - 1                          last new token of s

    block_tables[s] = [ 7 | 2 | 9 | 0 0 ]     s's blocks in token order, padded with 0
                        │   │   └─ positions 2B .. 3B-1 (B = block_size)
                        │   └───── positions  B .. 2B-1
                        └───────── positions  0 .. B-1

``paged_batch`` turns what ``KVCacheManager`` hands out (block ids per request) into these
tensors with one Python loop over sequences; the rest is tensor ops. A decode-only step (every
sequence has one new token) runs paged decode attention over ``context_lens``; any other step
runs varlen paged prefill attention. A ``PagedBatch`` built by hand is checked (dtypes,
per-sequence shapes) and refused with ``PagedBatchError``. Imports torch: load it
through ``mooncake_kv.paged_batch`` (the ``[pool]`` extra), never from the ``mooncake_kv``
core modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import attrs
import numpy as np
import torch

from mooncake_kv.results import KVCacheBlocks
from mooncake_kv.types import KVCacheError

__all__ = ["PagedBatch", "PagedBatchError", "paged_batch"]

SeqBlocks = tuple[Sequence[int] | KVCacheBlocks, int, int]
"""One sequence of a batch: ``(block_ids, num_cached, num_new)``."""

_FIELD_DTYPES = {
    "block_tables": torch.int32, "slot_mapping": torch.int64, "positions": torch.int64,
    "cached_lens": torch.int32, "query_lens": torch.int32, "context_lens": torch.int32,
    "logits_indices": torch.int64,
}
_PER_SEQ = ("cached_lens", "query_lens", "context_lens", "logits_indices")


class PagedBatchError(KVCacheError, ValueError):
    """A ``PagedBatch`` whose tensors disagree: a wrong dtype or rank, or per-sequence lengths
    that do not match its block tables."""


def _check_dtype(_inst: object, attribute: attrs.Attribute, value: torch.Tensor) -> None:
    want = _FIELD_DTYPES[attribute.name]
    if not isinstance(value, torch.Tensor) or value.dtype != want:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise PagedBatchError(f"PagedBatch.{attribute.name} must be a {want} tensor, got {got}")


@attrs.frozen(eq=False)
class PagedBatch:
    """The paged-attention inputs of one step (tensors on the CPU until ``to``).

    Attributes:
        block_tables: int32 [num_seqs, max_blocks]; each sequence's block ids, rows padded
            with 0.
        slot_mapping: int64 [num_tokens]; the cache slot of each new token's K/V
            (``write_kv``; a slot < 0 is not written).
        positions: int64 [num_tokens]; each new token's position in its sequence (RoPE).
        cached_lens: int32 [num_seqs]; tokens already in the cache.
        query_lens: int32 [num_seqs]; new tokens per sequence.
        context_lens: int32 [num_seqs]; ``cached_lens + query_lens``.
        logits_indices: int64 [num_seqs]; index in the packed tokens of each sequence's last
            new token.
        is_decode_only: every sequence has exactly one new token (paged decode attention).

    Raises:
        PagedBatchError: a dtype or rank is wrong, or the per-sequence lengths disagree.
    """

    block_tables: torch.Tensor = attrs.field(validator=_check_dtype)
    slot_mapping: torch.Tensor = attrs.field(validator=_check_dtype)
    positions: torch.Tensor = attrs.field(validator=_check_dtype)
    cached_lens: torch.Tensor = attrs.field(validator=_check_dtype)
    query_lens: torch.Tensor = attrs.field(validator=_check_dtype)
    context_lens: torch.Tensor = attrs.field(validator=_check_dtype)
    logits_indices: torch.Tensor = attrs.field(validator=_check_dtype)
    is_decode_only: bool

    def __attrs_post_init__(self) -> None:
        if self.block_tables.dim() != 2:
            raise PagedBatchError(f"block_tables must be 2-D [num_seqs, max_blocks], got shape "
                                  f"{tuple(self.block_tables.shape)}")
        num_seqs = self.block_tables.shape[0]
        for name in _PER_SEQ:
            if tuple(getattr(self, name).shape) != (num_seqs,):
                raise PagedBatchError(f"{name} must have shape ({num_seqs},) like block_tables' "
                                      f"rows, got {tuple(getattr(self, name).shape)}")
        if self.slot_mapping.dim() != 1 or self.positions.shape != self.slot_mapping.shape:
            raise PagedBatchError(f"slot_mapping and positions must both be [num_tokens], got "
                                  f"{tuple(self.slot_mapping.shape)} and "
                                  f"{tuple(self.positions.shape)}")
        if self.is_decode_only and self.slot_mapping.shape[0] != num_seqs:
            raise PagedBatchError(f"a decode-only batch has one token per sequence: slot_mapping "
                                  f"has {self.slot_mapping.shape[0]} tokens for {num_seqs} "
                                  "sequences")

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_tokens(self) -> int:
        """New tokens in the batch (``sum(query_lens)``)."""
        return self.slot_mapping.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PagedBatch:
        """The same batch with every tensor on ``device``."""
        moved = {
            field.name: getattr(self, field.name).to(device, non_blocking=non_blocking)
            for field in attrs.fields(PagedBatch)
            if field.name != "is_decode_only"
        }
        return PagedBatch(**moved, is_decode_only=self.is_decode_only)


def paged_batch(seqs: Iterable[SeqBlocks], block_size: int) -> PagedBatch:
    """Block tables, slot mapping, positions and lengths for a batch of sequences.

    Args:
        seqs: one ``(block_ids, num_cached, num_new)`` per sequence, in batch order:
            ``block_ids`` (ints, or the ``KVCacheBlocks`` that ``try_allocate`` /
            ``try_append`` returned) cover at least ``num_cached + num_new`` tokens;
            ``num_cached`` tokens are in the cache, ``num_new >= 1`` are computed now.
        block_size: tokens per block.

    Returns:
        A ``PagedBatch`` (see the module docs for the index arithmetic).

    Raises:
        ValueError: ``block_size < 1``, a negative ``num_cached``, ``num_new < 1``, blocks
            too few for a sequence's tokens, or a negative block id; the message names the
            sequence index and the values.
        TypeError: an entry is not a ``(block_ids, num_cached, num_new)`` triple.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 (got {block_size!r})")
    tables: list[Sequence[int]] = []
    widths: list[int] = []
    cached: list[int] = []
    new: list[int] = []
    for index, entry in enumerate(seqs):
        block_ids, num_cached, num_new = _unpack(index, entry)
        _check_seq(index, block_ids, num_cached, num_new, block_size)
        tables.append(block_ids)
        widths.append(len(block_ids))
        cached.append(num_cached)
        new.append(num_new)
    if new and all(n == 1 for n in new):
        return _build_decode(tables, widths, cached, block_size)
    return _build(_pad_tables(tables, widths), cached, new, block_size)


def _unpack(index: int, entry: object) -> tuple[Sequence[int], int, int]:
    try:
        blocks, num_cached, num_new = entry  # type: ignore[misc]
    except (TypeError, ValueError):
        raise TypeError(
            f"sequence {index} must be a (block_ids, num_cached, num_new) triple, got {entry!r}"
        ) from None
    block_ids = blocks.block_ids if isinstance(blocks, KVCacheBlocks) else blocks
    return block_ids, num_cached, num_new


def _check_seq(
    index: int, block_ids: Sequence[int], num_cached: int, num_new: int, block_size: int
) -> None:
    if isinstance(num_cached, bool) or not isinstance(num_cached, int) or num_cached < 0:
        raise ValueError(f"sequence {index}: num_cached must be an int >= 0 (got {num_cached!r})")
    if isinstance(num_new, bool) or not isinstance(num_new, int) or num_new < 1:
        raise ValueError(
            f"sequence {index}: num_new must be an int >= 1 (got {num_new!r}); a sequence "
            "with no new token has nothing to compute, so leave it out of the batch"
        )
    capacity = len(block_ids) * block_size
    if capacity < num_cached + num_new:
        raise ValueError(
            f"sequence {index}: {len(block_ids)} blocks x block_size {block_size} = {capacity} "
            f"slots cannot hold num_cached + num_new = {num_cached} + {num_new} = "
            f"{num_cached + num_new} tokens; reserve the slots first "
            "(KVCacheManager.try_allocate / try_append) and pass the block ids they return"
        )


def _negative_block(index: int, block_id: int) -> ValueError:
    return ValueError(f"sequence {index}: block id {block_id} is negative; block ids are "
                      "0 .. num_blocks-1 as KVCacheManager hands them out")


def _build_decode(tables: list[Sequence[int]], widths: list[int], cached: list[int],
                  block_size: int) -> PagedBatch:
    """`_build`'s batch for one new token per sequence, from Python lists: a decode step's
    batch is built every step, right after the forward has streamed the weights through the
    caches, where each torch call costs tens of microseconds. So the values go into two numpy
    buffers (int32, int64) and every tensor is a ``torch.from_numpy`` view of one: no torch
    operator runs (tests/test_paged.py checks both builds against the definition)."""
    num_seqs, width = len(cached), max(widths)
    base = num_seqs * width  # int32: block tables | cached | query (1) | context lengths
    ints = np.zeros(base + 3 * num_seqs, dtype=np.int32)
    longs = np.empty(3 * num_seqs, dtype=np.int64)  # positions | slots | logits indices
    for index, table in enumerate(tables):
        row = list(table)
        if row and min(row) < 0:
            raise _negative_block(index, next(b for b in row if b < 0))
        ints[index * width:index * width + len(row)] = row
        position = cached[index]
        longs[num_seqs + index] = row[position // block_size] * block_size + position % block_size
    lens = ints[base:]
    lens[:num_seqs] = cached
    lens[num_seqs:2 * num_seqs] = 1
    lens[2 * num_seqs:] = lens[:num_seqs] + 1
    longs[:num_seqs] = cached
    longs[2 * num_seqs:] = np.arange(num_seqs)
    view = torch.from_numpy
    return PagedBatch(
        block_tables=view(ints[:base].reshape(num_seqs, width)),
        slot_mapping=view(longs[num_seqs:2 * num_seqs]),
        positions=view(longs[:num_seqs]),
        cached_lens=view(lens[:num_seqs]),
        query_lens=view(lens[num_seqs:2 * num_seqs]),
        context_lens=view(lens[2 * num_seqs:]),
        logits_indices=view(longs[2 * num_seqs:]),
        is_decode_only=True,
    )


def _pad_tables(tables: list[Sequence[int]], widths: list[int]) -> torch.Tensor:
    """int32 [num_seqs, max_blocks]: row ``s`` is ``tables[s]`` then zeros."""
    num_blocks = torch.tensor(widths, dtype=torch.int64)
    width = max(widths, default=0)
    block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
    flat = torch.tensor(list(chain.from_iterable(tables)), dtype=torch.int64)
    if flat.numel() and int(flat.min()) < 0:
        first = int((flat < 0).nonzero()[0])
        owner = int((num_blocks.cumsum(0) <= first).sum())
        raise _negative_block(owner, int(flat[first]))
    # row-major order of the mask is the order of ``flat``
    block_tables[torch.arange(width) < num_blocks[:, None]] = flat.to(torch.int32)
    return block_tables


def _build(block_tables: torch.Tensor, cached: list[int], new: list[int],
           block_size: int) -> PagedBatch:
    num_seqs = len(new)
    query_lens = torch.tensor(new, dtype=torch.int64)
    cached_lens = torch.tensor(cached, dtype=torch.int64)
    num_tokens = sum(new)
    is_decode_only = num_tokens == num_seqs
    if is_decode_only:  # one token per sequence: no packing to undo
        seq_index = torch.arange(num_seqs)
        positions = cached_lens
    else:
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), query_lens)
        starts = query_lens.cumsum(0) - query_lens
        positions = torch.arange(num_tokens) - starts[seq_index] + cached_lens[seq_index]
    blocks = block_tables[seq_index, positions // block_size].to(torch.int64)
    return PagedBatch(
        block_tables=block_tables,
        slot_mapping=blocks * block_size + positions % block_size,
        positions=positions,
        cached_lens=cached_lens.to(torch.int32),
        query_lens=query_lens.to(torch.int32),
        context_lens=(cached_lens + query_lens).to(torch.int32),
        logits_indices=query_lens.cumsum(0) - 1,
        is_decode_only=is_decode_only,
    )
