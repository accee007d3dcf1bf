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


def build_inputs(batch: ScheduledBatch, block_size: int) -> ModelInputs:
    """Tensors for ``batch`` (see module docs); requests must not have advanced yet."""
    tokens: list[int] = []
    cached: list[int] = []
    width = max(len(r.block_ids) for r in batch.requests)
    table: list[int] = []
    for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
        start = request.num_computed_tokens
        tokens += request.token_ids[start : start + num_new]
        cached.append(start)
        table += request.block_ids
        table += [0] * (width - len(request.block_ids))
    query_lens = torch.tensor(batch.num_new_tokens, dtype=torch.int64)
    cached_lens = torch.tensor(cached, dtype=torch.int64)
    block_tables = torch.tensor(table, dtype=torch.int32).view(len(cached), width)
    decode_only = len(tokens) == len(cached)
    if decode_only:
        seq_index = torch.arange(len(cached))
        positions = cached_lens
    else:
        seq_index = torch.repeat_interleave(torch.arange(len(cached)), query_lens)
        starts = query_lens.cumsum(0) - query_lens
        positions = torch.arange(len(tokens)) - starts[seq_index] + cached_lens[seq_index]
    blocks = block_tables[seq_index, positions // block_size].to(torch.int64)
    slot_mapping = blocks * block_size + positions % block_size
    attention = AttentionBatch(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        cached_lens=cached_lens.to(torch.int32),
        query_lens=query_lens.to(torch.int32),
        logits_indices=query_lens.cumsum(0) - 1,
        is_decode_only=decode_only,
    )
    return ModelInputs(torch.tensor(tokens, dtype=torch.int64), positions, attention)
