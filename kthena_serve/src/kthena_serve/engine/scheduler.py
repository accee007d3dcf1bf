"""Scheduler: which requests run this step and how many of their tokens (continuous batching).

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, oldest
first: a decoding request takes one token, a prefilling one the next chunk of its prompt.
Then waiting requests are admitted while budget and seats (``max_num_seqs``) last: their
cached prefix comes from the KV manager and only the rest is scheduled, chunked to the budget.

When the KV pool has no block for a running request, the newest running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
later (mostly from the prefix cache). Nothing ever fails for lack of blocks.

A decoding request can be paused (its client is not reading what it already got): it keeps
its seat and blocks but takes no token until resumed.

With tiered offload (an ``AsyncOffloader``), a waiting request whose next blocks after its
pool hit may sit in a tier is admitted as *promoting* (promotion.py): it takes its seat and
blocks at once, and runs once they were copied in (or ``promote_timeout_s`` passed).

A PD prefill worker runs its prompts through the same scheduler, as a policy: a prompt whose
blocks the decode worker's scheduler gave is added as *external* (``add_external``: its block
table is used as given, no KV verb touches it, it is never a preemption victim); a step holds
prompts of one pool only (``batch_key``); a prompt whose first token was sampled is *set aside*
(``set_aside``) with its blocks still held, for its handoff, and freed after
(``free_set_aside``). A prompt that finds the pool full waits while blocks that will come back
are held (running, promoting, or set aside with ``returning``), and is rejected otherwise.

Decode protection (``prefill_budget``, the engine's ``target_step_ms``): a step's time grows
with its prefill tokens, and every running decode waits for the whole step, so a prompt
arriving while others decode would stretch their inter-token time to that of a full prefill
chunk. With a ``prefill_budget``, running decodes are picked first (one row each), and when
there is at least one, the step's prefill chunks (running prompts, then admissions) share at
most ``prefill_budget(num_decode_rows, num_burst_tokens)`` tokens (at least 1 while the step
has tokens left, so prompts always progress); a long prompt is split over steps.
``num_burst_tokens`` is the prompt tokens still to compute of the requests, running or waiting,
that arrived within ``burst_window_s`` of the newest running decode: the decodes are protected
from prompts that arrived after them, not from the rest of their own burst. A decode picked this step can
still be preempted for an older prompt's chunk; it then leaves the step. A step with no decode takes the whole
``max_num_batched_tokens``. The budget comes from outside (``step_cost.py``): this class stays
a pure function of what it is given.

The scheduler talks to the KV layer only through the manager's verbs: match_prefix,
try_allocate, try_append, commit, free (and, through ``Promotions``, the offloader's
start_promotion).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from kthena_serve.engine.promotion import Promotions
from kthena_serve.engine.request import FinishReason, Request, RequestStatus
from kthena_serve.engine.scheduled import Reservation, ScheduledBatch, ScheduledSeq
from mooncake_kv import ExtraKeys, KVCacheManager

if TYPE_CHECKING:
    from mooncake_kv.tiers import AsyncOffloader

__all__ = ["Scheduler"]

_Picked = list[tuple[Request, int]]  # (request, tokens it feeds this step)
_PROMOTING = -1  # _try_admit: the request waits for its promotion, nothing scheduled


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix reuse and recompute preemption.

    Args:
        kv: the KV cache manager (this scheduler is its owner thread's only caller).
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens per step at most.
        enable_prefix_caching: whether the manager caches prefixes (admission waits a step
            for a prefix another request is computing only then).
        offloader: tiers to promote evicted prefixes from (promotion.py), or None.
        promote_timeout_s: how long a request waits for its promotion at most.
        batch_key: requests whose keys differ never share a step (a PD prefill worker's
            prompts over different decode pools); None: any requests may.
        prefill_budget: decode protection (see module docs): given a step's decode rows (at
            least 1) and its burst's prompt tokens still to compute, the most prefill tokens
            it may also carry; None: off (running requests oldest first, prefill and decode
            alike, up to ``max_num_batched_tokens``).
        burst_window_s: requests whose arrivals are at most this far apart are one burst
            (``Request.arrival_time``; the engine passes its ``target_step_ms``).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        offloader: AsyncOffloader | None = None,
        promote_timeout_s: float = 5.0,
        batch_key: Callable[[Request], Hashable] | None = None,
        prefill_budget: Callable[[int, int], int] | None = None,
        burst_window_s: float = 0.0,
    ) -> None:
        self.kv = kv
        self.promoting = Promotions(kv, offloader, promote_timeout_s)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}  # PD: blocks held while a prefill fills them
        self.paused: set[str] = set()  # decoding requests skipped until resumed
        self.external: set[str] = set()  # block tables given from outside: no KV verbs
        self.returning: set[str] = set()  # set aside; their blocks come back soon
        self._batch_key = batch_key
        self.prefill_budget = prefill_budget
        self.burst_window_s = burst_window_s
        self._step_key: Hashable | None = None  # this step's batch key, once one is picked
        # blocks finished running requests gave back, and their output tokens (admission's
        # KV outlook: the engine's ``kv_outlook``)
        self.num_released_blocks = 0
        self.num_finished = 0
        self.num_finished_output_tokens = 0

    # ---- queue ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.promoting)

    def has_runnable_work(self) -> bool:
        """Whether ``schedule()`` can pick anything (False when every running request is
        paused and none waits)."""
        return bool(self.waiting or self.promoting) or any(
            r.request_id not in self.paused or r.is_prefill for r in self.running)

    def pause(self, request_id: str) -> None:
        """Skip a request's decode steps until ``resume``; it keeps its seat and blocks."""
        self.paused.add(request_id)

    def resume(self, request_id: str) -> None:
        self.paused.discard(request_id)

    def abort(self, request_id: str) -> Request | None:
        """Drop a waiting, reserved or running request; None if it is not here."""
        if request_id in self.reserved:
            request = self.reserved.pop(request_id)
            self.promoting.settle_reserved(request_id)  # no promotion write after the free
            self.kv.free(request_id)
            _mark_finished(request, FinishReason.ABORT)
            return request
        if (request := self.promoting.cancel(request_id)) is not None:
            self.kv.free(request_id)
            _mark_finished(request, FinishReason.ABORT)
            return request
        for request in self.running:
            if request.request_id == request_id:
                self.finish(request, FinishReason.ABORT)
                return request
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.paused.discard(request_id)
                _mark_finished(request, FinishReason.ABORT)
                return request
        return None

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Finish a running request: its blocks go back (cached ones stay matchable)."""
        self._leave(request)
        if request.request_id in self.external:
            self.external.discard(request.request_id)  # the blocks are another scheduler's
        else:
            self.num_released_blocks += len(request.block_ids)
            self.num_finished += 1
            self.num_finished_output_tokens += request.num_output_tokens
            self.kv.free(request.request_id)
        _mark_finished(request, reason)

    def _leave(self, request: Request) -> None:
        self.running.remove(request)
        self.paused.discard(request.request_id)
        self.promoting.forget(request.request_id)

    # ---- PD prefill: prompts only, some over blocks another worker's scheduler gave ----------
    def add_external(self, request: Request, block_ids: tuple[int, ...]) -> None:
        """Run ``request``'s prompt over ``block_ids``, a block table from outside that covers
        it (its ``num_computed_tokens`` already has KV there): no KV verb touches the request,
        and it is never preempted."""
        request.block_ids = tuple(block_ids)
        request.status = RequestStatus.RUNNING
        self.external.add(request.request_id)
        self.running.append(request)

    def set_aside(self, request_id: str, *, returning: bool) -> Request:
        """Take a running request off the schedule with its blocks still held (a PD prefill
        whose first token is sampled: its blocks are handed off or pinned).

        Args:
            returning: its blocks come back soon (``free_set_aside`` after a handoff): a
                prompt that finds the pool full waits for them instead of being rejected.

        Raises:
            KeyError: ``request_id`` is not running.
        """
        request = next((r for r in self.running if r.request_id == request_id), None)
        if request is None:
            raise KeyError(f"request {request_id!r} is not running")
        self._leave(request)
        if request_id in self.external:
            self.external.discard(request_id)
        elif returning:
            self.returning.add(request_id)
        request.status = RequestStatus.FINISHED
        return request

    def free_set_aside(self, request_id: str) -> None:
        """Give back the blocks of a request ``set_aside`` left held."""
        self.returning.discard(request_id)
        self.kv.free(request_id)

    # ---- PD admission: a prompt whose KV another worker computes ------------------------------
    def reserve(self, request: Request) -> Reservation | None:
        """Hold a seat and blocks for the whole prompt (its cached prefix matched).

        The request waits outside the queue until ``admit_prefilled`` or ``release``. Returns
        None when no seat (``max_num_seqs``, reservations included) or no blocks are free now;
        the caller then queues the request as an ordinary one. With offload tiers, the blocks
        after the pool hit that a tier may hold start promoting (``num_promoting_blocks``):
        the caller waits for them (``promoting.wait_reserved``, off this thread) and calls
        ``settle_reserved`` before anyone writes the prompt's KV.
        """
        if self._num_seated() >= self.max_num_seqs:
            return None
        rid = request.request_id
        salt = ExtraKeys(cache_salt=request.cache_salt) if request.cache_salt else None
        match = self.kv.match_prefix(rid, request.token_ids, salt)
        blocks = self.kv.try_allocate(rid, request.num_tokens - match.num_cached_tokens)
        if blocks is None:
            self.kv.free(rid)
            return None
        request.block_ids = blocks.block_ids
        request.num_cached_tokens = match.num_cached_tokens
        request.status = RequestStatus.RESERVED
        self.reserved[rid] = request
        promoting = (self.promoting.try_start_reserved(request, match.num_cached_blocks, salt)
                     if self.enable_prefix_caching else 0)
        return Reservation(blocks.block_ids, match.num_cached_tokens, promoting)

    def settle_reserved(self, request_id: str) -> Reservation:
        """End a reservation's promotion (``reserve``): the blocks that arrived count as
        cached, the rest is the prefill worker's to compute.

        Raises:
            KeyError: ``request_id`` holds no reservation.
        """
        request = self.reserved[request_id]
        num_promoted = self.promoting.settle_reserved(request_id)
        request.num_cached_tokens = (request.num_cached_tokens or 0) \
            + num_promoted * self.block_size
        return Reservation(request.block_ids, request.num_cached_tokens)

    def admit_prefilled(self, request_id: str) -> Request:
        """A reserved request's prompt KV is written: cache its blocks and start decoding.

        Raises:
            KeyError: ``request_id`` holds no reservation.
        """
        request = self.reserved.pop(request_id)
        request.num_computed_tokens = request.num_tokens
        self.kv.commit(request_id, request.token_ids)
        request.num_committed_blocks = request.num_tokens // self.block_size
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def release(self, request_id: str) -> bool:
        """Give back a reservation that will not be admitted; False if there is none."""
        request = self.reserved.pop(request_id, None)
        if request is None:
            return False
        self.promoting.settle_reserved(request_id)  # no promotion write after the free
        self.kv.free(request_id)
        _mark_finished(request, FinishReason.ABORT)
        return True

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts, reserving their KV slots."""
        self._step_key = None
        picked: _Picked = []
        preempted: list[Request] = []
        rejected: list[Request] = []
        self.running += self.promoting.collect()
        budget = self._schedule_running(picked, preempted, rejected)
        if not preempted:
            self._admit_waiting(picked, budget, rejected)
        if not picked and self.promoting:  # nothing to run but promotions: wait, do not spin
            self.promoting.wait_oldest()
        return ScheduledBatch(
            seqs=tuple(_scheduled(r, n) for r, n in picked),
            preempted=tuple(r.request_id for r in preempted),
            rejected=tuple(r.request_id for r in rejected),
        )

    def update(self, batch: ScheduledBatch) -> None:
        """After the model ran: advance computed counts and cache the blocks that filled."""
        size = self.block_size
        running = {r.request_id: r for r in self.running}
        for seq in batch.seqs:
            request = running[seq.request_id]
            request.num_computed_tokens += len(seq.token_ids)
            if request.request_id in self.external:
                continue  # another scheduler's blocks: nothing to cache here
            num_full = request.num_computed_tokens // size
            if num_full > request.num_committed_blocks:
                self.kv.commit(request.request_id,
                               request.token_ids[: request.num_computed_tokens])
                request.num_committed_blocks = num_full
                # a block computed twice (another request cached it meanwhile) is swapped
                # for the cached twin at commit
                request.block_ids = self.kv.block_ids(request.request_id)

    # ---- internals ---------------------------------------------------------------------------
    def _schedule_running(self, picked: _Picked, preempted: list[Request],
                          rejected: list[Request]) -> int:
        """Pick running requests; returns the token budget left for admissions."""
        budget = self.max_num_batched_tokens
        if self.prefill_budget is None:
            return self._pick_running(picked, preempted, rejected, budget, None)
        budget = self._pick_running(picked, preempted, rejected, budget, False)
        if picked:  # decodes run: cap the prefill so their step stays short
            newest = max(r.arrival_time for r, _ in picked)
            burst = sum(r.num_tokens - r.num_computed_tokens
                        for r in (*self.waiting, *self.running)
                        if r.is_prefill and abs(r.arrival_time - newest) <= self.burst_window_s)
            budget = min(budget, max(1, self.prefill_budget(len(picked), burst)))
        return self._pick_running(picked, preempted, rejected, budget, True)

    def _pick_running(self, picked: _Picked, preempted: list[Request],
                      rejected: list[Request], budget: int, prefill: bool | None) -> int:
        """Pick running requests oldest first within ``budget``: prefilling ones (``prefill``
        True), decoding ones (False) or both (None); returns the budget left."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if (request.request_id in self.paused and not request.is_prefill) \
                    or (prefill is not None and request.is_prefill is not prefill) \
                    or not self._in_step(request):
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._reserve(request, num_new, picked, preempted, rejected):
                picked.append((request, num_new))
                budget -= num_new
                index += 1
        return budget

    def _reserve(self, request: Request, num_new: int, picked: _Picked,
                 preempted: list[Request], rejected: list[Request]) -> bool:
        """Reserve slots, preempting the newest running requests; False if ``request`` lost.

        A victim already picked this step (a decode, when prefills are picked after decodes)
        leaves ``picked`` too.
        """
        rid = request.request_id
        if rid in self.external:
            return True  # its block table covers the prompt already
        while True:
            if request.is_prefill:
                blocks = self.promoting.allocate_prefill(rid, num_new)
            else:
                blocks = self.kv.try_append(rid, num_new)
            if blocks is not None:
                request.block_ids = blocks.block_ids
                return True
            victim = next(r for r in reversed(self.running) if r.request_id not in self.external)
            if victim is request and not self._holds_blocks(besides=request):
                self.finish(request, FinishReason.LENGTH)  # cannot fit even alone
                rejected.append(request)
                return False
            self._preempt(victim)
            preempted.append(victim)
            picked[:] = [(r, n) for r, n in picked if r is not victim]
            if victim is request:
                return False

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.promoting.forget(request.request_id)
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
            if budget <= 0 or self._num_seated() >= self.max_num_seqs:
                return
            if self._should_wait_for_prefix(request, prefilling) or not self._in_step(request):
                continue
            num_new = self._try_admit(request, budget)
            if num_new == _PROMOTING:
                self.waiting.remove(request)
                continue
            if num_new is None:
                if not self._holds_blocks():  # too long for the whole pool
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
        lookup = request.params.prompt_logprobs is None  # cached blocks have no logits
        match = self.kv.match_prefix(rid, request.token_ids, salt, lookup=lookup)
        if lookup and self.promoting.try_start(request, match.num_cached_blocks, salt):
            return _PROMOTING
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

    def _in_step(self, request: Request) -> bool:
        """Whether ``request`` may join this step (the first picked sets the batch key)."""
        if self._batch_key is None:
            return True
        key = self._batch_key(request)
        if self._step_key is None:
            self._step_key = key
        return key == self._step_key

    def _holds_blocks(self, besides: Request | None = None) -> bool:
        """Whether blocks of this pool will come back: held by a running request (other than
        ``besides``; not external), a promotion, or a request set aside with ``returning``."""
        return bool(self.promoting or self.returning) or any(
            r is not besides and r.request_id not in self.external for r in self.running)

    def _num_seated(self) -> int:
        return len(self.running) + len(self.reserved) + len(self.promoting)

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


def _scheduled(request: Request, num_new: int) -> ScheduledSeq:
    start = request.num_computed_tokens
    return ScheduledSeq(request.request_id, tuple(request.token_ids[start : start + num_new]),
                        start, request.block_ids, start + num_new == request.num_tokens)


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
