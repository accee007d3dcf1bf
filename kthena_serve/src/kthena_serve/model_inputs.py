"""Model inputs for one step: packed tokens, positions and the paged-attention batch.

Sequence ``s`` feeds ``q_s`` new tokens after ``c_s`` cached ones; tokens are packed::

    input_ids   | s0: q0 tokens | s1: q1 tokens | ...            T = sum(q)
    positions   | c0 .. c0+q0-1 | c1 .. c1+q1-1 | ...

Positions, slot mapping, block tables and lengths are ``mooncake_kv.paged_batch``'s (the
index arithmetic has one home, in the KV layer); this module adds the token ids.
"""

from __future__ import annotations

import attrs
import torch

from kthena_serve.model import AttentionBatch
from kthena_serve.scheduler import ScheduledBatch
from mooncake_kv import paged_batch

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
    tokens: list[int] = []
    seqs = []
    for seq in batch.seqs:
        tokens += seq.token_ids
        seqs.append((seq.block_ids, seq.start, len(seq.token_ids)))
    paged = paged_batch(seqs, block_size=block_size)
    attention = AttentionBatch(
        slot_mapping=_to(paged.slot_mapping, device),
        block_tables=_to(paged.block_tables, device),
        cached_lens=_to(paged.cached_lens, device),
        query_lens=_to(paged.query_lens, device),
        logits_indices=_to(paged.logits_indices, device),
        is_decode_only=paged.is_decode_only,
    )
    input_ids = torch.tensor(tokens, dtype=torch.int64)
    return ModelInputs(_to(input_ids, device), _to(paged.positions, device), attention)


def _to(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return tensor if device is None else tensor.to(device, non_blocking=True)
