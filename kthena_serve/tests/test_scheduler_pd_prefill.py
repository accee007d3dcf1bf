"""The scheduler's PD prefill policy, without a model: prompts over a block table given from
outside (external), one pool per step (``batch_key``), a sampled prompt set aside with its
blocks held, and a prompt that finds the pool full waiting only while blocks will come back.

Golden tests pin exact block counts and step contents; a Hypothesis state machine runs random
mixes of own and external prompts and checks after every step that external prompts never
touch the KV manager, a step never mixes pools, and every block is back at the end.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kthena_serve.engine.request import FinishReason, Request
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.scheduler import Scheduler
from mooncake_kv import KVCacheManager

BLOCK = 4
PARAMS = SamplingParams(max_tokens=1)


def _scheduler(num_blocks: int, budget: int, pools: dict[str, str] | None = None,
               seats: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, check_invariants=True)
    key = None if pools is None else (lambda request: pools.get(request.request_id, "own"))
    return Scheduler(kv, max_num_seqs=seats, max_num_batched_tokens=budget, batch_key=key)


def _prompt(rid: str, length: int, seed: int = 0) -> Request:
    rng = random.Random(f"{rid}-{seed}")
    return Request(rid, [rng.randrange(1000) for _ in range(length)], PARAMS)


def _run(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One step as a prefill worker runs it: schedule, 'forward', update; sampled prompts are
    set aside. Returns (request id, tokens) of the step."""
    batch = scheduler.schedule()
    scheduler.update(batch)
    for seq in batch.seqs:
        if seq.is_sampled:
            scheduler.set_aside(seq.request_id, returning=False)
    return [(seq.request_id, len(seq.token_ids)) for seq in batch.seqs]


def test_an_external_prompt_runs_over_its_given_blocks_without_kv_verbs():
    scheduler = _scheduler(num_blocks=4, budget=64)
    request = _prompt("ext", 10)
    request.num_computed_tokens = 4  # the decode worker's cached prefix
    scheduler.add_external(request, (40, 41, 42))  # block ids of another pool: out of this range
    batch = scheduler.schedule()
    (seq,) = batch.seqs
    assert (seq.start, len(seq.token_ids), seq.block_ids, seq.is_sampled) == (4, 6, (40, 41, 42),
                                                                              True)
    scheduler.update(batch)
    assert scheduler.kv.stats().num_used_blocks == 0  # nothing allocated, committed or freed
    scheduler.set_aside("ext", returning=True)  # external: nothing held here to return
    assert not scheduler.running and not scheduler.returning and not scheduler.external


def test_a_step_holds_one_pool_oldest_first():
    pools = {"a1": "A", "b1": "B", "a2": "A"}
    scheduler = _scheduler(num_blocks=16, budget=64, pools=pools)
    for rid in ("a1", "b1", "a2"):
        scheduler.add_external(_prompt(rid, 8), tuple(range(2)))
    assert _run(scheduler) == [("a1", 8), ("a2", 8)]
    assert _run(scheduler) == [("b1", 8)]
    assert _run(scheduler) == []


def test_an_external_prompt_is_never_preempted_for_an_own_one():
    scheduler = _scheduler(num_blocks=3, budget=8)  # 12 own slots
    scheduler.add_external(_prompt("ext", 12), (7, 8, 9))
    scheduler.add(_prompt("own", 12))
    first = _run(scheduler)  # ext takes the whole budget: 8 of its 12 tokens
    assert first == [("ext", 8)]
    assert _run(scheduler) == [("ext", 4), ("own", 4)]
    assert _run(scheduler) == [("own", 8)]
    assert "ext" not in {r.request_id for r in scheduler.running}
    assert scheduler.kv.stats().num_used_blocks == 3  # own is set aside with its 3 blocks
    scheduler.free_set_aside("own")
    assert scheduler.kv.stats().num_used_blocks == 0


def test_a_full_pool_waits_for_returning_blocks_and_rejects_otherwise():
    scheduler = _scheduler(num_blocks=4, budget=64)
    scheduler.add(_prompt("first", 12))  # 3 of the 4 blocks
    assert _run(scheduler) == [("first", 12)]
    scheduler.running.clear()  # (set aside already by _run)
    scheduler.returning.add("first")  # its handoff is running: the blocks come back
    scheduler.add(_prompt("second", 12))
    batch = scheduler.schedule()
    assert not batch.seqs and not batch.rejected  # waits, not rejected
    scheduler.free_set_aside("first")
    assert _run(scheduler) == [("second", 12)]
    scheduler.free_set_aside("second")
    pinned = _prompt("pinned", 12)
    scheduler.add(pinned)
    assert _run(scheduler) == [("pinned", 12)]  # set aside without returning: a pin
    scheduler.add(_prompt("third", 12))
    batch = scheduler.schedule()
    assert batch.rejected == ("third",)  # nothing will come back soon: refused now
    scheduler.free_set_aside("pinned")
    assert scheduler.kv.stats().num_used_blocks == 0


def test_set_aside_of_a_request_that_is_not_running_is_a_key_error():
    scheduler = _scheduler(num_blocks=4, budget=8)
    with pytest.raises(KeyError, match="is not running"):
        scheduler.set_aside("nobody", returning=False)


class PrefillPolicyMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), budget=st.integers(1, 40),
                seats=st.integers(1, 5))
    def setup(self, num_blocks: int, budget: int, seats: int) -> None:
        self.pools: dict[str, str] = {}
        self.scheduler = _scheduler(num_blocks, budget, self.pools, seats)
        self.capacity = num_blocks * BLOCK
        self.held: set[str] = set()  # own prompts set aside, blocks not yet freed
        self.next_id = 0

    @rule(length=st.integers(1, 30), pool=st.sampled_from(["own", "A", "B"]))
    def add(self, length: int, pool: str) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = _prompt(rid, length, self.next_id)
        self.pools[rid] = pool
        if pool == "own":
            if length > self.capacity:
                return
            self.scheduler.add(request)
        else:
            self.scheduler.add_external(request, tuple(range(1000, 1000 + -(-length // BLOCK))))

    @precondition(lambda self: self.scheduler.has_work())
    @rule(returning=st.booleans())
    def step(self, returning: bool) -> None:
        used_before = self.scheduler.kv.stats().num_used_blocks
        batch = self.scheduler.schedule()
        assert len({self.pools[s.request_id] for s in batch.seqs}) <= 1  # one pool per step
        external = [s for s in batch.seqs if self.pools[s.request_id] != "own"]
        for seq in external:
            assert all(b >= 1000 for b in seq.block_ids)  # the given table, untouched
        for rid in batch.rejected:
            assert self.pools[rid] == "own"
        self.scheduler.update(batch)
        if not [s for s in batch.seqs if self.pools[s.request_id] == "own"] \
                and not batch.preempted and not batch.rejected:
            assert self.scheduler.kv.stats().num_used_blocks == used_before  # externals only
        for seq in batch.seqs:
            if seq.is_sampled:
                self.scheduler.set_aside(seq.request_id, returning=returning)
                if self.pools[seq.request_id] == "own":
                    self.held.add(seq.request_id)

    @precondition(lambda self: self.held)
    @rule()
    def free_one(self) -> None:
        rid = sorted(self.held)[0]
        self.held.discard(rid)
        self.scheduler.free_set_aside(rid)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [r.request_id for r in self.scheduler.running] + \
            [r.request_id for r in self.scheduler.waiting]
        if live:
            rid = data.draw(st.sampled_from(live))
            assert self.scheduler.abort(rid).finish_reason is FinishReason.ABORT

    @invariant()
    def external_requests_are_running_ones(self) -> None:
        if hasattr(self, "scheduler"):
            running = {r.request_id for r in self.scheduler.running}
            assert self.scheduler.external <= running
            assert self.scheduler.returning <= self.held

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(request.request_id)
        for rid in self.held:
            self.scheduler.free_set_aside(rid)
        assert self.scheduler.kv.stats().num_used_blocks == 0
        assert not self.scheduler.external and not self.scheduler.returning


TestPrefillPolicyMachine = PrefillPolicyMachine.TestCase
