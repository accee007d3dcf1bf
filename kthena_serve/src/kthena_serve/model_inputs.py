"""Model inputs for one step: packed tokens, positions and the paged-attention batch.

Sequence ``s`` feeds ``q_s`` new tokens after ``c_s`` cached ones; tokens are packed::

    input_ids   | s0: q0 tokens | s1: q1 tokens | ...            T = sum(q)
    positions   | c0 .. c0+q0-1 | c1 .. c1+q1-1 | ...
    slot        block_tables[s, pos // block_size] * block_size + pos % block_size
    logits_indices[s] = (q0 + ... + q_s) - 1                     last new token of s

A handful of tensor ops build all of it; the only Python loop is over sequences.
"""

from __future__ import annotations

import attrs
import torch

from kthena_serve.model import AttentionBatch
from kthena_serve.scheduler import ScheduledBatch

__all__ = ["ModelInputs", "build_inputs"]


@attrs.frozen
class ModelInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attention: AttentionBatch


def build_inputs(batch: ScheduledBatch, block_size: int,
                 device: torch.device | str | None = None) -> ModelInputs:
    """Tensors for ``batch`` (see module docs), on ``device`` (default: where torch builds them).

    Plain data in, tensors out: the engine, TP ranks, PD prefill workers and tests all feed it
    ``ScheduledSeq`` values.
    """
    seqs = batch.seqs
    tokens: list[int] = []
    width = max(len(s.block_ids) for s in seqs)
    table: list[int] = []
    for seq in seqs:
        tokens += seq.token_ids
        table += seq.block_ids
        table += [0] * (width - len(seq.block_ids))
    query_lens = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.int64)
    cached_lens = torch.tensor([s.start for s in seqs], dtype=torch.int64)
    block_tables = torch.tensor(table, dtype=torch.int32).view(len(seqs), width)
    decode_only = len(tokens) == len(seqs)
    if decode_only:
        seq_index = torch.arange(len(seqs))
        positions = cached_lens
    else:
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), query_lens)
        starts = query_lens.cumsum(0) - query_lens
        positions = torch.arange(len(tokens)) - starts[seq_index] + cached_lens[seq_index]
    blocks = block_tables[seq_index, positions // block_size].to(torch.int64)
    slot_mapping = blocks * block_size + positions % block_size
    attention = AttentionBatch(
        slot_mapping=_to(slot_mapping, device),
        block_tables=_to(block_tables, device),
        cached_lens=_to(cached_lens.to(torch.int32), device),
        query_lens=_to(query_lens.to(torch.int32), device),
        logits_indices=_to(query_lens.cumsum(0) - 1, device),
        is_decode_only=decode_only,
    )
    input_ids = torch.tensor(tokens, dtype=torch.int64)
    return ModelInputs(_to(input_ids, device), _to(positions, device), attention)


def _to(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return tensor if device is None else tensor.to(device, non_blocking=True)
