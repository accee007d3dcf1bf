"""The engine's block lifecycle with tiers on: the real Scheduler, KV manager, pool and
AsyncOffloader (host memory over a second, smaller-than-needed tier), random traffic.

The "model" writes, into every block a step fills, bytes derived from the block's chain hash,
so the KV any request reads is checkable: before each scheduled chunk, every full block ahead
of it (pool hit, promoted from a tier, or computed earlier) must hold its hash's bytes. After
every step: each request is in exactly one place (waiting, promoting, running or finished) and
the KV manager knows exactly the promoting and running ones; every offload is accounted for
once; no key sits in two tiers. At the end everything finishes, no block is held, nothing is
queued and the offloader's threads are gone.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kthena_serve.engine.request import FinishReason, Request, RequestStatus
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.scheduler import Scheduler
from mooncake_kv import ExtraKeys, KVCacheManager
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool
from mooncake_kv.sizing import KVShape
from mooncake_kv.tiers import AsyncOffloader, HostMemoryTier

BS = 4
SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, dtype="fp32")
SYSTEMS = [list(range(100, 124)), list(range(300, 316))]


def kv_of(block_hash: bytes) -> bytes:
    size = SHAPE.bytes_per_block
    return (bytes(block_hash) * (size // len(block_hash) + 1))[:size]


class TieredScheduler(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(10, 24), budget=st.integers(4, 40),
                seats=st.integers(1, 4), host_blocks=st.integers(1, 6))
    def setup(self, num_blocks: int, budget: int, seats: int, host_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BS, check_invariants=True)
        self.pool = KVPool.create(KVLayout(SHAPE, num_blocks))
        frame = SHAPE.bytes_per_block + 200  # payload and frame header, key and fingerprint
        self.offloader = AsyncOffloader(
            self.kv, self.pool, [HostMemoryTier(host_blocks * frame, "host"),
                                 HostMemoryTier(8 * frame, "lower")], queue_depth=8)
        self.scheduler = Scheduler(self.kv, max_num_seqs=seats, max_num_batched_tokens=budget,
                                   offloader=self.offloader, promote_timeout_s=5.0)
        self.capacity = num_blocks * BS
        self.requests: dict[str, Request] = {}
        self.max_tokens: dict[str, int] = {}
        self.next_id = 0
        self.rng = random.Random(0)

    @rule(system=st.sampled_from([0, 1, None]), length=st.integers(1, 12),
          max_tokens=st.integers(1, 6), salt=st.sampled_from([None, "a"]))
    def add(self, system: int | None, length: int, max_tokens: int, salt: str | None) -> None:
        prompt = (SYSTEMS[system] if system is not None else []) + [
            self.rng.randrange(4) for _ in range(length)]  # few tokens: tails repeat too
        if len(prompt) + max_tokens > self.capacity:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt)
        self.requests[rid] = request
        self.max_tokens[rid] = max_tokens
        self.scheduler.add(request)

    def hashes(self, request: Request, num_blocks: int) -> list:
        salt = ExtraKeys(cache_salt=request.cache_salt) if request.cache_salt else None
        return self.kv.hasher.hash_tokens(request.token_ids[: num_blocks * BS], salt)

    @precondition(lambda self: hasattr(self, "kv") and self.scheduler.has_work())
    @rule()
    def step(self) -> None:
        batch = self.scheduler.schedule()
        for seq in batch.seqs:
            request = self.requests[seq.request_id]
            ahead = seq.start // BS  # the KV this chunk reads must be its blocks' own
            for position, block_hash in enumerate(self.hashes(request, ahead)):
                assert self.pool.read_block(seq.block_ids[position]) == kv_of(block_hash)
        for seq in batch.seqs:  # the "model" writes the blocks this chunk fills (before commit)
            request = self.requests[seq.request_id]
            full = (seq.start + len(seq.token_ids)) // BS
            hashes = self.hashes(request, full)
            for position in range(seq.start // BS, full):
                self.pool.write_block(seq.block_ids[position], kv_of(hashes[position]))
        self.scheduler.update(batch)
        for seq in batch.seqs:
            if not seq.is_sampled:
                continue
            request = self.requests[seq.request_id]
            request.token_ids.append(self.rng.randrange(4))
            if request.num_output_tokens >= self.max_tokens[request.request_id]:
                self.scheduler.finish(request, FinishReason.LENGTH)
        # The copier and promoter run while the step does; letting them finish before the next
        # rule makes the next step see the same state on every replay (Hypothesis needs that).
        # The engine never waits like this; mooncake_kv's test_tiers_async races them freely.
        assert self.offloader.drain(10.0)

    @precondition(lambda self: hasattr(self, "kv") and self.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.scheduler.abort(data.draw(st.sampled_from(sorted(self.requests))))

    @invariant()
    def each_request_in_one_place(self) -> None:
        if not hasattr(self, "kv"):
            return
        sched = self.scheduler
        places = [{r.request_id for r in sched.waiting}, set(sched.promoting),
                  {r.request_id for r in sched.running}]
        assert sum(len(p) for p in places) == len(set().union(*places))
        for request in self.requests.values():
            inside = sum(request.request_id in p for p in places)
            assert inside == (request.status is not RequestStatus.FINISHED)
        stats = self.kv.stats()
        assert stats.num_running_requests == len(sched.running) + len(sched.promoting)
        assert len(sched.running) + len(sched.promoting) <= sched.max_num_seqs

    @invariant()
    def every_offload_in_one_place(self) -> None:
        if not hasattr(self, "kv"):
            return
        snap = self.offloader.snapshot(with_keys=True)
        assert snap.num_enqueued == (snap.num_offloaded + snap.num_skipped
                                     + snap.num_dropped_evicted + snap.num_failed
                                     + snap.queue_depth + snap.in_flight)
        assert not snap.tier_keys[0] & snap.tier_keys[1]

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        try:
            for _ in range(2000):  # everything admitted must finish: no livelock
                if not self.scheduler.has_work():
                    break
                self.step()
            assert not self.scheduler.has_work()
            for request in self.requests.values():
                assert request.status is RequestStatus.FINISHED
            assert self.offloader.drain(10.0)
            stats = self.kv.stats()
            assert stats.num_used_blocks == 0 and stats.num_running_requests == 0
            snap = self.offloader.snapshot()
            assert (snap.queue_depth, snap.in_flight) == (0, 0)
        finally:
            self.offloader.close()
            self.pool.close()
        assert not any(t.is_alive() for t in self.offloader._threads)


TestTieredScheduler = TieredScheduler.TestCase
