"""Model inputs for one step: packed token ids and the step's `PagedBatch`.

Sequence ``s`` feeds ``q_s`` new tokens after ``c_s`` cached ones; tokens are packed::

    input_ids   | s0: q0 tokens | s1: q1 tokens | ...            T = sum(q)
    positions   | c0 .. c0+q0-1 | c1 .. c1+q1-1 | ...

Positions, slot mapping, block tables and lengths are ``mooncake_kv.paged_batch``'s (the
index arithmetic and the batch type have one home, in the KV layer); this module adds the token
ids.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from kthena_serve.engine.scheduled import ScheduledBatch
from mooncake_kv.paged import PagedBatch, paged_batch

__all__ = ["ModelInputs", "build_inputs"]


@attrs.frozen
class ModelInputs:
    """One step's forward inputs: ``input_ids`` int64 [T] and the paged-attention ``attention``
    batch (positions, slots, block tables, lengths)."""

    input_ids: torch.Tensor
    attention: PagedBatch

    @property
    def positions(self) -> torch.Tensor:
        """int64 [T]: each new token's position in its sequence."""
        return self.attention.positions

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ModelInputs:
        """The same inputs with every tensor on ``device`` (these very tensors if there)."""
        return ModelInputs(self.input_ids.to(device, non_blocking=non_blocking),
                           self.attention.to(device, non_blocking=non_blocking))


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
    # numpy's conversion and a view: fewer torch calls on a cache-cold decode step
    inputs = ModelInputs(torch.from_numpy(np.array(tokens, dtype=np.int64)), paged)
    if device is None or torch.device(device).type == "cpu":
        return inputs  # built there: each .to() would be a torch call that returns its tensor
    return inputs.to(device, non_blocking=True)
