"""Scheduler invariants under random traffic (Hypothesis state machine, no model needed).

A fake "model" samples a token for every request whose prompt is fully computed. After every
step: blocks in use never exceed the pool, only running requests hold blocks, every running
request's block table covers its computed tokens. At the end every request finishes or is
aborted and no block is left referenced.

``DecodeProtectingMachine`` runs the same traffic with a ``prefill_budget`` of ``cap - slope *
rows`` tokens: every decode the step's tokens allow is picked, and with decodes in a step its
prefill tokens stay within what the budget answered (at least 1); every prompt still finishes.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kthena_serve.engine.request import FinishReason, Request, RequestStatus
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.scheduled import ScheduledBatch
from kthena_serve.engine.scheduler import Scheduler
from mooncake_kv import KVCacheManager

BLOCK_SIZE = 4
SYSTEM = list(range(100, 124))  # a shared 24-token prefix


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(12, 48), budget=st.integers(1, 40),
                seats=st.integers(1, 6), caching=st.booleans())
    def setup(self, num_blocks: int, budget: int, seats: int, caching: bool) -> None:
        self._start(num_blocks, budget, seats, caching, None)

    def _start(self, num_blocks: int, budget: int, seats: int, caching: bool,
               prefill_budget: Callable[[int], int] | None) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching,
                                 check_invariants=True)
        self.answers: list[int] = []  # what the prefill budget answered this step
        self.scheduler = Scheduler(self.kv, max_num_seqs=seats, max_num_batched_tokens=budget,
                                   enable_prefix_caching=caching, prefill_budget=prefill_budget)
        self.capacity = num_blocks * BLOCK_SIZE
        self.requests: dict[str, Request] = {}
        self.max_tokens: dict[str, int] = {}
        self.next_id = 0
        self.rng = random.Random(0)

    @rule(length=st.integers(1, 30), max_tokens=st.integers(1, 12), shared=st.booleans(),
          salt=st.sampled_from([None, "a"]))
    def add(self, length: int, max_tokens: int, shared: bool, salt: str | None) -> None:
        prompt = (SYSTEM if shared else []) + [self.rng.randrange(1000) for _ in range(length)]
        if len(prompt) + max_tokens > self.capacity:  # the engine refuses these up front
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt)
        self.requests[rid] = request
        self.max_tokens[rid] = max_tokens
        self.scheduler.add(request)

    @precondition(lambda self: self.scheduler.has_work())
    @rule()
    def step(self) -> None:
        self.answers.clear()
        decoding = {r.request_id for r in self.scheduler.running if not r.is_prefill}
        batch = self.scheduler.schedule()
        assert batch.num_tokens <= self.scheduler.max_num_batched_tokens
        if self.scheduler.prefill_budget is not None:
            self._check_decode_protection(batch, decoding)
        assert len(self.scheduler.running) <= self.scheduler.max_num_seqs
        for seq in batch.seqs:  # plain data that agrees with the live request
            request = self.requests[seq.request_id]
            assert len(seq.token_ids) >= 1
            assert seq.start == request.num_computed_tokens
            assert list(seq.token_ids) == request.token_ids[seq.start : seq.start + len(seq.token_ids)]
            assert seq.block_ids == request.block_ids
            assert seq.start + len(seq.token_ids) <= len(seq.block_ids) * BLOCK_SIZE
            assert seq.is_sampled == (seq.start + len(seq.token_ids) == request.num_tokens)
        self.scheduler.update(batch)
        for seq in batch.seqs:
            if not seq.is_sampled:
                continue
            request = self.requests[seq.request_id]
            request.token_ids.append(self.rng.randrange(1000))
            if request.num_output_tokens >= self.max_tokens[request.request_id]:
                self.scheduler.finish(request, FinishReason.LENGTH)

    def _check_decode_protection(self, batch: ScheduledBatch, decoding: set[str]) -> None:
        """Decodes (``decoding``: running ones before the step) first; with any, the prefill
        within the budget's answer (at least 1)."""
        picked = {s.request_id for s in batch.seqs}
        rows = [s for s in batch.seqs if s.request_id in decoding]
        prefill = batch.num_tokens - len(rows)
        left_out = [r for r in self.scheduler.running
                    if r.request_id in decoding and r.request_id not in picked]
        assert not left_out or len(rows) == self.scheduler.max_num_batched_tokens
        if rows:
            (answer,) = self.answers
            assert prefill <= max(1, answer)

    @rule(length=st.integers(1, 40), admit=st.booleans(), salt=st.sampled_from([None, "a"]))
    def pd_handoff(self, length: int, admit: bool, salt: str | None) -> None:
        """PD decode: reserve blocks for a prompt, then admit it prefilled or release it."""
        prompt = SYSTEM + [self.rng.randrange(1000) for _ in range(length)]
        if len(prompt) + 4 > self.capacity:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Request(rid, prompt, SamplingParams(max_tokens=4), cache_salt=salt)
        reservation = self.scheduler.reserve(request)
        if reservation is None:
            assert rid not in self.scheduler.reserved
            return
        assert len(reservation.block_ids) * BLOCK_SIZE >= len(prompt)
        assert reservation.num_cached_tokens % BLOCK_SIZE == 0
        if not admit:
            assert self.scheduler.release(rid)
            return
        self.scheduler.admit_prefilled(rid)
        request.token_ids.append(self.rng.randrange(1000))  # the prefill worker's first token
        self.requests[rid] = request
        self.max_tokens[rid] = 4
        assert not request.is_prefill

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.scheduler.abort(rid)

    @invariant()
    def blocks_within_capacity(self) -> None:
        if not hasattr(self, "kv"):
            return
        stats = self.kv.stats()
        assert stats.num_used_blocks <= stats.num_blocks
        assert stats.num_running_requests == len(self.scheduler.running)
        held = {b for r in self.scheduler.running for b in r.block_ids}  # shared prefixes once
        assert len(held) <= stats.num_used_blocks
        for request in self.scheduler.waiting:
            assert request.status is RequestStatus.WAITING and not request.block_ids

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for _ in range(2000):  # everything admitted must finish: no livelock
            if not self.scheduler.has_work():
                break
            self.step()
        assert not self.scheduler.has_work()
        for request in self.requests.values():
            assert request.status is RequestStatus.FINISHED
            if request.finish_reason is FinishReason.LENGTH:
                assert request.num_output_tokens in (0, self.max_tokens[request.request_id])
        stats = self.kv.stats()
        assert stats.num_used_blocks == 0 and stats.num_running_requests == 0
        self.kv.check_invariants()


class DecodeProtectingMachine(SchedulerMachine):
    """The same traffic with a prefill budget of ``cap - slope * rows`` tokens."""

    @initialize(num_blocks=st.integers(12, 48), budget=st.integers(1, 40),
                seats=st.integers(1, 6), caching=st.booleans(), cap=st.integers(0, 12),
                slope=st.integers(0, 3))
    def setup(self, num_blocks: int, budget: int, seats: int, caching: bool, cap: int,
              slope: int) -> None:
        def prefill_budget(rows: int, burst: int) -> int:
            self.answers.append(max(0, cap - slope * rows))
            return self.answers[-1]

        self._start(num_blocks, budget, seats, caching, prefill_budget)


TestScheduler = SchedulerMachine.TestCase
TestDecodeProtectingScheduler = DecodeProtectingMachine.TestCase
