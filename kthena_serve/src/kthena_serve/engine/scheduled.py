"""What a scheduler step hands out, as plain data: ``ScheduledBatch`` (to the runner: each
sequence's token slice, start position, block table and whether it samples) and a PD decode
worker's ``Reservation``. Nothing live (no ``Request``) crosses to the runner.
"""

from __future__ import annotations

import attrs

__all__ = ["Reservation", "ScheduledBatch", "ScheduledSeq"]


@attrs.frozen
class ScheduledSeq:
    """One sequence's share of a step, as plain data (nothing live crosses to the runner).

    Attributes:
        request_id: whose tokens these are.
        token_ids: the tokens fed this step (a prefill chunk, or the one token to decode).
        start: position of ``token_ids[0]``; tokens before it already have KV in the cache.
        block_ids: the sequence's block table, covering ``start + len(token_ids)`` tokens.
        is_sampled: a token is sampled from this sequence's last position (its logits row is
            ``ScheduledBatch.sampled_rows.index(i)``).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_ids: tuple[int, ...]
    is_sampled: bool


@attrs.frozen
class ScheduledBatch:
    """One step's work: the sequences to run, and who was preempted or rejected.

    Attributes:
        seqs: the sequences, in batch order.
        preempted: request ids sent back to the queue this step.
        rejected: request ids that cannot fit in the pool even alone (finished with LENGTH).
    """

    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def sampled_rows(self) -> list[int]:
        """Indices in ``seqs`` that sample a token (the runner returns their logits, in order)."""
        return [i for i, s in enumerate(self.seqs) if s.is_sampled]


@attrs.frozen
class Reservation:
    """PD decode: the blocks reserved for a prompt and how much of it was already cached.

    ``num_promoting_blocks``: blocks after the cached prefix being copied in from the offload
    tiers (promotion.py); until ``Scheduler.settle_reserved`` they count in neither
    ``num_cached_tokens`` nor what anyone may write.
    """

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_promoting_blocks: int = 0
