"""Scheduler: which requests run this step and how many of their tokens (continuous batching).

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, oldest
first: a decoding request takes one token, a prefilling one the next chunk of its prompt.
Then waiting requests are admitted while budget and seats (``max_num_seqs``) last: their
cached prefix comes from the KV manager and only the rest is scheduled, chunked to the budget.

When the KV pool has no block for a running request, the newest running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
later (mostly from the prefix cache). Nothing ever fails for lack of blocks.

The scheduler talks to the KV layer only through the manager's verbs: match_prefix,
try_allocate, try_append, commit, free.
"""

from __future__ import annotations

import time
from collections import deque

import attrs

from kthena_serve.request import FinishReason, Request, RequestStatus
from mooncake_kv import ExtraKeys, KVCacheManager

__all__ = ["ScheduledBatch", "Scheduler"]

_Picked = list[tuple[Request, int]]  # (request, tokens it feeds this step)


@attrs.frozen
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``requests[i]``, from its computed ones.

    Attributes:
        requests: running requests, in batch order.
        num_new_tokens: tokens fed for each.
        is_sampled: whether a token is sampled for each (its last token is fed this step).
        preempted: requests sent back to the queue this step.
        rejected: requests that cannot fit in the pool even alone (finished with LENGTH).
    """

    requests: tuple[Request, ...]
    num_new_tokens: tuple[int, ...]
    is_sampled: tuple[bool, ...]
    preempted: tuple[Request, ...] = ()
    rejected: tuple[Request, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix reuse and recompute preemption.

    Args:
        kv: the KV cache manager (this scheduler is its owner thread's only caller).
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens per step at most.
        enable_prefix_caching: whether the manager caches prefixes (admission waits a step
            for a prefix another request is computing only then).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.kv = kv
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- queue ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        """Drop a waiting or running request; None if it is not here (finished or unknown)."""
        for request in self.running:
            if request.request_id == request_id:
                self.finish(request, FinishReason.ABORT)
                return request
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                _mark_finished(request, FinishReason.ABORT)
                return request
        return None

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Finish a running request: its blocks go back (cached ones stay matchable)."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        _mark_finished(request, reason)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and token counts, reserving their KV slots."""
        picked: _Picked = []
        preempted: list[Request] = []
        rejected: list[Request] = []
        budget = self._schedule_running(picked, preempted, rejected)
        if not preempted:
            self._admit_waiting(picked, budget, rejected)
        return ScheduledBatch(
            requests=tuple(r for r, _ in picked),
            num_new_tokens=tuple(n for _, n in picked),
            is_sampled=tuple(r.num_computed_tokens + n == r.num_tokens for r, n in picked),
            preempted=tuple(preempted),
            rejected=tuple(rejected),
        )

    def update(self, batch: ScheduledBatch) -> None:
        """After the model ran: advance computed counts and cache the blocks that filled."""
        size = self.block_size
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            request.num_computed_tokens += num_new
            num_full = request.num_computed_tokens // size
            if num_full > request.num_committed_blocks:
                self.kv.commit(request.request_id,
                               request.token_ids[: request.num_computed_tokens])
                request.num_committed_blocks = num_full

    # ---- internals ---------------------------------------------------------------------------
    def _schedule_running(self, picked: _Picked, preempted: list[Request],
                          rejected: list[Request]) -> int:
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._reserve(request, num_new, preempted, rejected):
                picked.append((request, num_new))
                budget -= num_new
                index += 1
        return budget

    def _reserve(self, request: Request, num_new: int, preempted: list[Request],
                 rejected: list[Request]) -> bool:
        """Reserve slots, preempting the newest running requests; False if ``request`` lost."""
        rid = request.request_id
        while True:
            if request.is_prefill:
                blocks = self.kv.try_allocate(rid, num_new)
            else:
                blocks = self.kv.try_append(rid, num_new)
            if blocks is not None:
                request.block_ids = blocks.block_ids
                return True
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                self.finish(request, FinishReason.LENGTH)  # cannot fit even alone
                rejected.append(request)
                return False
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_committed_blocks = 0
        request.block_ids = ()
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _admit_waiting(self, picked: _Picked, budget: int, rejected: list[Request]) -> None:
        prefilling = [r for r, _ in picked if r.is_prefill]
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if self._should_wait_for_prefix(request, prefilling):
                continue
            num_new = self._try_admit(request, budget)
            if num_new is None:
                if not self.running:  # too long for the whole pool
                    self.waiting.remove(request)
                    _mark_finished(request, FinishReason.LENGTH)
                    rejected.append(request)
                    continue
                return
            self.waiting.remove(request)
            self.running.append(request)
            picked.append((request, num_new))
            prefilling.append(request)
            budget -= num_new

    def _try_admit(self, request: Request, budget: int) -> int | None:
        rid = request.request_id
        salt = ExtraKeys(cache_salt=request.cache_salt) if request.cache_salt else None
        match = self.kv.match_prefix(rid, request.token_ids, salt)
        num_new = min(request.num_tokens - match.num_cached_tokens, budget)
        blocks = self.kv.try_allocate(rid, num_new)
        if blocks is None:
            self.kv.free(rid)
            return None
        request.num_computed_tokens = match.num_cached_tokens
        request.num_committed_blocks = match.num_cached_blocks
        if request.num_cached_tokens is None:
            request.num_cached_tokens = match.num_cached_tokens
        request.block_ids = blocks.block_ids
        request.status = RequestStatus.RUNNING
        return num_new

    def _should_wait_for_prefix(self, request: Request, prefilling: list[Request]) -> bool:
        """Wait a step if most of the prompt is being prefilled right now by another request.

        Admitting it now would compute the shared prefix twice; next step it is cached.
        Only a prefix covering at least half of the prompt counts, so chat requests that
        merely share a short system prompt are not serialised.
        """
        if not self.enable_prefix_caching:
            return False
        size = self.block_size
        for other in prefilling:
            if other.cache_salt != request.cache_salt:
                continue
            shared = _shared_blocks(request.token_ids, other.token_ids, size) * size
            if shared * 2 >= request.num_tokens and other.num_computed_tokens < shared:
                return True
        return False


def _shared_blocks(a: list[int], b: list[int], size: int) -> int:
    """Leading full blocks two token lists have in common."""
    count = 0
    limit = min(len(a), len(b)) // size
    while count < limit and a[count * size : (count + 1) * size] == b[count * size : (count + 1) * size]:
        count += 1
    return count


def _mark_finished(request: Request, reason: FinishReason) -> None:
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    request.finish_time = time.perf_counter()
    request.block_ids = ()
