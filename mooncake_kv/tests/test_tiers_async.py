"""AsyncOffloader: a KV manager's block lifecycle with tiers on, threads and all.

A Hypothesis state machine serves prompts the way the engine's scheduler does (pool hit, then
promotion of the following blocks from the tiers, then compute the rest, commit, free), with
the copier stalled mid-read at times so blocks are evicted and reused under it. Every block's
KV is derived from its hash, so any copy that came back wrong shows. After every step: the
manager's own invariants; every offload is accounted for exactly once (queued, in flight,
offloaded, skipped or dropped); no key is in two tiers. After a drain: every value at rest is
its block's bytes. At the end: nothing queued, every block free, the threads gone.
"""

from __future__ import annotations

import threading

import attrs
import pytest
from _support import wait_until
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake_kv import KVCacheManager
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool
from mooncake_kv.sizing import KVShape
from mooncake_kv.tiers import AsyncOffloader, HostMemoryTier, frame_block, unframe_block

BS = 2
NUM_BLOCKS = 6
SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, dtype="fp32")
BASES = [list(range(100, 112)), list(range(200, 212)), [7] * 12]


def kv_of(block_hash: bytes, size: int) -> bytes:
    """The KV a block with this hash holds (the same whoever computes it)."""
    return (bytes(block_hash) * (size // len(block_hash) + 1))[:size]


class GatedPool:
    """The pool as the offloader sees it; reads can be held at a gate (a stalled copier)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.gate = threading.Event()
        self.gate.set()
        self.num_waiting = 0

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    def read_block(self, block_id: int) -> bytes:
        self.num_waiting += 1
        self.gate.wait()
        self.num_waiting -= 1
        return self.pool.read_block(block_id)

    def write_block(self, block_id: int, payload: bytes) -> None:
        self.pool.write_block(block_id, payload)


def frame_size() -> int:
    key = f"{SHAPE.fingerprint()}/{'0' * 32}"  # an xxh3_128 hash is 32 hex digits
    return len(frame_block(key, SHAPE.fingerprint(), bytes(SHAPE.bytes_per_block)))


@attrs.define
class Served:
    hits: int = 0
    promoted: int = 0


class TieredLifecycle(RuleBasedStateMachine):
    WRITE_THROUGH = False  # spills: each block in one tier

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BS, check_invariants=True)
        self.pool = KVPool.create(KVLayout(SHAPE, NUM_BLOCKS))
        self.storage = GatedPool(self.pool)
        size = frame_size()
        self.host = HostMemoryTier(2 * size, "host")
        self.lower = HostMemoryTier(4 * size, "lower")
        self.offloader = AsyncOffloader(self.manager, self.storage, [self.host, self.lower],
                                        queue_depth=3, write_through=self.WRITE_THROUGH)
        self.live: dict[str, list[int]] = {}
        self.served = Served()
        self.num_requests = 0

    # ---- rules ---------------------------------------------------------------------------------
    @rule(base=st.integers(0, len(BASES) - 1), length=st.integers(3, 12),
          tail=st.lists(st.integers(0, 2), max_size=3), keep=st.booleans())
    def serve(self, base: int, length: int, tail: list[int], keep: bool) -> None:
        prompt = BASES[base][:length] + tail
        rid = f"r{self.num_requests}"
        self.num_requests += 1
        hashes = self.manager.hasher.hash_tokens(prompt)
        match = self.manager.match_prefix(rid, prompt)
        self.check_blocks(match.block_ids, hashes)
        computed, reserved = self.promote(rid, prompt, hashes, match.num_cached_blocks)
        blocks = self.manager.try_allocate(rid, len(prompt) - reserved)
        if blocks is None:
            self.manager.free(rid)
            return
        for position in range(computed // BS, len(hashes)):  # compute the rest
            self.pool.write_block(blocks.block_ids[position],
                                  kv_of(hashes[position], SHAPE.bytes_per_block))
        self.manager.commit(rid, prompt)
        if keep:
            self.live[rid] = prompt
        else:
            self.manager.free(rid)

    def promote(self, rid: str, prompt: list[int], hashes: list, start: int) -> tuple[int, int]:
        """As the scheduler does: (tokens computed, tokens reserved) after promotion."""
        limit = (len(prompt) - 1) // BS
        if start >= limit or not self.offloader.may_hold(hashes[start]):
            return start * BS, start * BS
        blocks = self.manager.try_allocate(rid, (limit - start) * BS)
        if blocks is None:
            return start * BS, start * BS
        job = self.offloader.start_promotion(hashes[start:limit],
                                             blocks.block_ids[start:limit])
        assert job.wait(5.0), "a promotion did not end"
        done = start + job.num_promoted
        self.check_blocks(blocks.block_ids[start:done], hashes[start:done])
        if job.num_promoted:
            self.manager.commit(rid, prompt[: done * BS])
            self.served.promoted += job.num_promoted
        return done * BS, limit * BS

    def check_blocks(self, block_ids, hashes) -> None:  # noqa: ANN001
        for block_id, block_hash in zip(block_ids, hashes, strict=False):
            assert self.pool.read_block(block_id) == kv_of(block_hash, SHAPE.bytes_per_block)

    @rule(index=st.integers(0, 7))
    def free_one(self, index: int) -> None:
        # which requests are live depends on the threads' timing (a promotion that found less
        # leaves fewer blocks free): no precondition on it, so every replay draws alike
        if self.live:
            rid = sorted(self.live)[index % len(self.live)]
            del self.live[rid]
            self.manager.free(rid)

    @precondition(lambda self: self.storage.gate.is_set())
    @rule()
    def stall_copier(self) -> None:
        self.storage.gate.clear()

    @precondition(lambda self: not self.storage.gate.is_set())
    @rule()
    def release_copier(self) -> None:
        self.storage.gate.set()
        assert self.offloader.drain(5.0)

    @precondition(lambda self: self.storage.gate.is_set())
    @rule()
    def drain(self) -> None:
        assert self.offloader.drain(5.0)
        if self.WRITE_THROUGH:
            snap = self.offloader.snapshot()
            assert snap.tiers[1].num_stored_blocks == snap.num_offloaded
        for tier in (self.host, self.lower):  # quiet now: read the values at rest
            for key in tier.keys():
                payload = unframe_block(key, SHAPE.fingerprint(), tier.get(key))
                assert payload == kv_of(bytes.fromhex(key.rpartition("/")[2]),
                                        SHAPE.bytes_per_block)

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def every_offload_is_in_one_place(self) -> None:
        snap = self.offloader.snapshot(with_keys=True)
        assert snap.num_enqueued == (snap.num_offloaded + snap.num_skipped
                                     + snap.num_dropped_evicted + snap.num_failed
                                     + snap.queue_depth + snap.in_flight)
        assert 0 <= snap.in_flight <= 1 and snap.num_failed == 0
        host_keys, lower_keys = snap.tier_keys
        if not self.WRITE_THROUGH:
            assert not host_keys & lower_keys, "a block in two tiers"
        if self.WRITE_THROUGH:
            # every offload is put below as well, just after tier 0 and before the copier
            # counts its outcome: the one copy in flight may be below already
            assert snap.tiers[1].num_stored_blocks <= snap.num_offloaded + snap.in_flight

    def teardown(self) -> None:
        try:
            for rid in list(self.live):
                self.manager.free(rid)
            self.storage.gate.set()
            assert self.offloader.drain(5.0)
            snap = self.offloader.snapshot()
            assert (snap.queue_depth, snap.in_flight) == (0, 0)
            assert self.manager.num_free_blocks == NUM_BLOCKS  # no block leaked
        finally:
            self.storage.gate.set()
            self.offloader.close()
            self.pool.close()
        assert not any(t.is_alive() for t in self.offloader._threads)


TestTieredLifecycle = TieredLifecycle.TestCase


class TieredLifecycleWriteThrough(TieredLifecycle):
    WRITE_THROUGH = True  # every offload reaches the lower tier too


TestTieredLifecycleWriteThrough = TieredLifecycleWriteThrough.TestCase


# ---- golden tests ------------------------------------------------------------------------------

@pytest.fixture
def rig(request):
    num_blocks, depth = getattr(request, "param", (4, 1))
    manager = KVCacheManager(num_blocks, BS, check_invariants=True)
    pool = KVPool.create(KVLayout(SHAPE, num_blocks))
    storage = GatedPool(pool)
    offloader = AsyncOffloader(manager, storage, [HostMemoryTier(1 << 20)],
                               queue_depth=depth)
    yield manager, pool, storage, offloader
    storage.gate.set()
    offloader.close()
    pool.close()


def compute(manager, pool, rid, prompt, keep=False) -> None:  # noqa: ANN001
    match = manager.match_prefix(rid, prompt)
    blocks = manager.try_allocate(rid, len(prompt) - match.num_cached_tokens)
    for position, block_hash in enumerate(manager.hasher.hash_tokens(prompt)):
        pool.write_block(blocks.block_ids[position], kv_of(block_hash, SHAPE.bytes_per_block))
    manager.commit(rid, prompt)
    if not keep:
        manager.free(rid)


@pytest.mark.parametrize("rig", [(6, 1)], indirect=True)
def test_full_queue_drops_and_eviction_before_copy_drops(rig):
    manager, pool, storage, offloader = rig
    storage.gate.clear()
    compute(manager, pool, "a", [1, 2, 3], keep=True)  # its block: the copier takes it, stalls
    wait_until(lambda: storage.num_waiting == 1, 5.0, "the copier to stall in a read")
    compute(manager, pool, "b", [4, 5, 6, 7, 8])  # two blocks: one queued, one dropped (full)
    snap = offloader.snapshot()
    assert (snap.in_flight, snap.queue_depth, snap.num_dropped_full) == (1, 1, 1)
    compute(manager, pool, "c", [9, 10, 11, 12, 13, 14, 15])  # takes every free block: b's
    manager.free("a")  # queued copy dies; a's block, being copied, is still a's
    storage.gate.set()
    assert offloader.drain()
    snap = offloader.snapshot()
    assert (snap.num_offloaded, snap.num_dropped_evicted) == (1, 1)
    assert snap.tiers[0].num_stored_blocks == 1


def test_read_racing_a_reuse_is_thrown_away(rig):
    manager, pool, storage, offloader = rig
    storage.gate.clear()
    compute(manager, pool, "a", [1, 2, 3, 4, 5])  # copier stalls inside a's first read
    wait_until(lambda: storage.num_waiting == 1, 5.0, "the copier to stall in a read")
    compute(manager, pool, "b", [6, 7, 8, 9, 10, 11, 12, 13])  # evicts a's blocks, overwrites
    storage.gate.set()
    assert offloader.drain()
    snap = offloader.snapshot(with_keys=True)
    assert snap.num_dropped_evicted >= 1
    hashes_a = manager.hasher.hash_tokens([1, 2, 3, 4, 5])
    assert offloader.key(hashes_a[0]) not in snap.tier_keys[0]  # never stored torn bytes


@pytest.mark.parametrize("rig", [(4, 8)], indirect=True)
def test_promotion_restores_bytes_and_cancel_keeps_what_was_written(rig):
    manager, pool, storage, offloader = rig
    prompt = [1, 2, 3, 4, 5]
    compute(manager, pool, "a", prompt)
    assert offloader.drain()
    compute(manager, pool, "b", [6, 7, 8, 9, 10, 11, 12, 13])  # evicts every block of a
    hashes = manager.hasher.hash_tokens(prompt)
    assert manager.match_prefix("a2", prompt).num_cached_tokens == 0
    blocks = manager.try_allocate("a2", 4)
    job = offloader.start_promotion(hashes, blocks.block_ids[:2])
    assert job.wait(5.0) and job.num_promoted == 2 and job.cancel() == 2
    assert [pool.read_block(b) for b in blocks.block_ids[:2]] == [
        kv_of(h, SHAPE.bytes_per_block) for h in hashes]
    snap = offloader.snapshot()
    assert (snap.tiers[0].num_hits, snap.tiers[0].num_promoted_blocks) == (2, 2)
    assert snap.tiers[0].num_bytes_out == 2 * frame_size()
    manager.free("a2")


def test_refuses_no_tier_and_bad_depth():
    manager = KVCacheManager(2, BS)
    with KVPool.create(KVLayout(SHAPE, 2)) as pool:
        with pytest.raises(ValueError, match="at least one tier"):
            AsyncOffloader(manager, pool, [])
        with pytest.raises(ValueError, match="queue_depth"):
            AsyncOffloader(manager, pool, [HostMemoryTier(100)], queue_depth=0)
