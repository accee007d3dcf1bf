"""`AttentionBatch`: where one step's new tokens go in the paged KV cache and what they attend to.

The engine packs the new tokens of every sequence one after another::

    tokens        | seq 0: query_lens[0] | seq 1: query_lens[1] | ...      T = sum(query_lens)
    positions     cached_lens[s] .. cached_lens[s] + query_lens[s] - 1   (per sequence)
    slot_mapping  block_tables[s, pos // block_size] * block_size + pos % block_size  (< 0: skip)
    logits_indices[s] = query_lens[0] + ... + query_lens[s] - 1          (last new token of s)

A decode-only step (every query_len is 1) uses paged decode attention over
``context_lens = cached_lens + 1`` (the new token's K/V is written first); any other step uses
varlen paged prefill attention, which reads the cached prefix from the cache and the new K/V
from the step itself.
"""

from __future__ import annotations

import attrs
import torch

from kthena_serve.model.errors import BatchError

_INT_DTYPES = {
    "slot_mapping": (torch.int64,), "block_tables": (torch.int32,), "cached_lens": (torch.int32,),
    "query_lens": (torch.int32,), "logits_indices": (torch.int64,),
}


def _check_dtype(_inst: object, attribute: attrs.Attribute, value: torch.Tensor) -> None:
    allowed = _INT_DTYPES[attribute.name]
    if not isinstance(value, torch.Tensor) or value.dtype not in allowed:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise BatchError(f"AttentionBatch.{attribute.name} must be a {allowed[0]} tensor, got {got}")


@attrs.frozen
class AttentionBatch:
    """Per-step paged-attention metadata, built by the engine; tensors on the model's device.

    Attributes:
        slot_mapping: int64 [num_tokens], the cache slot of each new token's K/V (< 0: not written).
        block_tables: int32 [num_seqs, max_blocks], each sequence's block ids (padding unused).
        cached_lens: int32 [num_seqs], tokens already in the cache before this step.
        query_lens: int32 [num_seqs], new tokens this step (1 for decode), packed seq by seq.
        logits_indices: int64 [num_seqs], index in the packed tokens of each last new token.
        is_decode_only: every query_len is 1 (selects paged decode attention).

    Raises:
        BatchError: a dtype or rank is wrong, or the per-sequence lengths disagree.
    """

    slot_mapping: torch.Tensor = attrs.field(validator=_check_dtype)
    block_tables: torch.Tensor = attrs.field(validator=_check_dtype)
    cached_lens: torch.Tensor = attrs.field(validator=_check_dtype)
    query_lens: torch.Tensor = attrs.field(validator=_check_dtype)
    logits_indices: torch.Tensor = attrs.field(validator=_check_dtype)
    is_decode_only: bool = False

    def __attrs_post_init__(self) -> None:
        num_seqs = self.block_tables.shape[0] if self.block_tables.dim() == 2 else -1
        if num_seqs < 0:
            raise BatchError(f"block_tables must be 2-D [num_seqs, max_blocks], got shape "
                             f"{tuple(self.block_tables.shape)}")
        for name in ("cached_lens", "query_lens", "logits_indices"):
            if tuple(getattr(self, name).shape) != (num_seqs,):
                raise BatchError(f"{name} must have shape ({num_seqs},) like block_tables' rows, "
                                 f"got {tuple(getattr(self, name).shape)}")
        if self.is_decode_only and self.slot_mapping.shape[0] != num_seqs:
            raise BatchError(f"a decode-only batch has one token per sequence: slot_mapping has "
                             f"{self.slot_mapping.shape[0]} tokens for {num_seqs} sequences")

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
