"""The KV outlook meter: what the pool holds in store for the admission queue, read on the
engine thread (``LLMEngine.kv_outlook``; admission.py turns the ``KVOutlook`` into a wait).

It follows the scheduler's counters between reads: the blocks finished requests gave back, as
a decayed per-second rate (``ServiceRate``), and the mean output length of the requests that
finished since the last read, decayed (nine parts the old mean, one part the new). From them,
the blocks the waiting prompts and the running requests' outputs will still take.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from kthena_serve.engine.admission import KVOutlook, ServiceRate

if TYPE_CHECKING:
    from kthena_serve.engine.request import Request
    from kthena_serve.engine.scheduler import Scheduler

__all__ = ["KVOutlookMeter"]


class KVOutlookMeter:
    """The release rate and mean output length behind each ``KVOutlook`` (see the module docs);
    one per engine, read on its thread only."""

    def __init__(self) -> None:
        self._released = ServiceRate()
        self._released_seen = 0
        self._finished_seen = self._finished_tokens_seen = 0
        self._mean_output: float | None = None

    def read(self, scheduler: Scheduler, num_free_blocks: int) -> KVOutlook:
        """The outlook now, with ``num_free_blocks`` free in the scheduler's pool. Outputs count
        at the mean length of the last finished ones, at most their ``max_tokens``; prefix hits
        are not subtracted, so the demand errs high."""
        self._released.advance(time.monotonic(), True)
        self._released.credit(scheduler.num_released_blocks - self._released_seen)
        self._released_seen = scheduler.num_released_blocks
        finished = scheduler.num_finished - self._finished_seen
        if finished:
            mean = (scheduler.num_finished_output_tokens - self._finished_tokens_seen) / finished
            self._mean_output = mean if self._mean_output is None else (
                0.9 * self._mean_output + 0.1 * mean)
            self._finished_seen = scheduler.num_finished
            self._finished_tokens_seen = scheduler.num_finished_output_tokens
        size = scheduler.block_size
        demand = sum(self._blocks(r, size) for r in scheduler.waiting) + sum(
            max(0, self._blocks(r, size) - len(r.block_ids)) for r in scheduler.running
            if r.request_id not in scheduler.external)
        out_blocks = 0 if self._mean_output is None else math.ceil(self._mean_output / size)
        return KVOutlook(num_free_blocks, demand, self._released.rate(None), size, out_blocks)

    def _blocks(self, request: Request, size: int) -> int:
        """The blocks ``request`` takes in all: its prompt and its expected output."""
        out = request.stream.max_tokens if request.stream is not None else 0
        if self._mean_output is not None:
            out = min(out, math.ceil(self._mean_output))
        return -(-(request.num_prompt_tokens + out) // size)
