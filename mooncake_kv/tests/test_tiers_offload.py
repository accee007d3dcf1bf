"""TieredKVCache with host tiers: evict -> offload -> match again -> identical bytes restored;
failing and lying tiers degrade to recompute."""

import logging
import random

import pytest

torch = pytest.importorskip("torch")

from mooncake_kv.layout import KVLayout  # noqa: E402
from mooncake_kv.manager import KVCacheManager  # noqa: E402
from mooncake_kv.pool import KVPool  # noqa: E402
from mooncake_kv.sizing import KVShape  # noqa: E402
from mooncake_kv.tiers import (  # noqa: E402
    HostMemoryTier,
    HostTierConfig,
    StoreTierConfig,
    TieredKVCache,
    frame_block,
)

torch.set_num_threads(1)
BLOCK = 4
SHAPE = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, block_size=BLOCK, dtype="int8")


class Harness:
    """A manager over `num_blocks`, its pool, and a `serve` that writes recognisable KV."""

    def __init__(self, num_blocks: int, tiers, **options) -> None:
        self.manager = KVCacheManager(num_blocks, BLOCK, check_invariants=True)
        self.pool = KVPool.create(KVLayout(SHAPE, num_blocks))
        self.cache = TieredKVCache(self.manager, self.pool, tiers, **options)
        self.rng = random.Random(0)
        self.written: dict[bytes, bytes] = {}  # block hash -> payload the "model" computed

    def serve(self, request_id: str, tokens: list[int]) -> tuple[int, list[bytes]]:
        """Match through the tiers, compute the rest, commit, free. Returns (cached, KV)."""
        match = self.cache.match_prefix(request_id, tokens)
        table = self.manager.try_allocate(request_id, len(tokens) - match.num_cached_tokens)
        assert table is not None
        hashes = self.manager.hasher.hash_tokens(tokens)
        for position in range(match.num_cached_blocks, len(table.block_ids)):
            payload = self.rng.randbytes(self.pool.layout.bytes_per_block)
            self.pool.write_block(table.block_ids[position], payload)
            if position < len(hashes):
                self.written[hashes[position]] = payload
        seen = [self.pool.read_block(b) for b in table.block_ids[: len(hashes)]]
        self.manager.commit(request_id, tokens)
        self.manager.free(request_id)
        return match.num_cached_tokens, seen

    def expected(self, tokens: list[int]) -> list[bytes]:
        return [self.written[h] for h in self.manager.hasher.hash_tokens(tokens)]


PROMPT_A = list(range(100, 113))  # 3 full blocks + 1 token
PROMPT_B = list(range(200, 216))  # 4 full blocks: evicts everything of A from a 4-block pool


def test_evicted_blocks_come_back_byte_identical():
    h = Harness(4, [HostMemoryTier(capacity_bytes=1 << 20)])
    assert h.serve("a1", PROMPT_A)[0] == 0
    assert h.serve("b1", PROMPT_B)[0] == 0  # evicts A's 3 cached blocks -> host tier
    assert h.cache.stats().num_offloaded_blocks == 3
    cached, seen = h.serve("a2", PROMPT_A)
    assert cached == 12
    assert seen == h.expected(PROMPT_A)  # identical bytes, not recomputed ones
    host = h.cache.stats().tiers[0]
    # a1 and b1 each missed on their first block; a2 found all three
    assert (host.num_lookups, host.num_hits, host.hit_rate) == (5, 3, 0.6)
    assert h.cache.stats().num_restored_blocks == 3
    # restored blocks were committed: the pool itself matches them now
    assert h.manager.match_prefix("a3", PROMPT_A).num_cached_tokens == 12


def test_host_lru_demotes_to_the_next_tier_and_restores_from_it():
    payload_size = len(frame_block("x" * 52, SHAPE.fingerprint(), bytes(SHAPE.bytes_per_block)))
    small = HostMemoryTier(capacity_bytes=2 * payload_size, name="host")
    big = HostMemoryTier(capacity_bytes=1 << 20, name="host2")
    h = Harness(4, [small, big])
    h.serve("a1", PROMPT_A)
    h.serve("b1", PROMPT_B)  # A's 3 blocks offloaded: host keeps 2, 1 demoted to host2
    assert len(small) == 2 and len(big) == 1
    cached, seen = h.serve("a2", PROMPT_A)
    assert cached == 12 and seen == h.expected(PROMPT_A)
    host, host2 = h.cache.stats().tiers
    assert host.num_demoted >= 1 and host2.num_hits >= 1


def test_run_stops_at_the_first_block_no_tier_holds():
    tier = HostMemoryTier(capacity_bytes=1 << 20)
    h = Harness(4, [tier])
    h.serve("a1", PROMPT_A)
    h.serve("b1", PROMPT_B)
    second = h.manager.hasher.hash_tokens(PROMPT_A)[1]
    tier.remove(f"{SHAPE.fingerprint()}/{second.hex()}")
    cached, seen = h.serve("a2", PROMPT_A)
    assert cached == 4
    assert seen[0] == h.expected(PROMPT_A)[0]


def test_too_few_free_blocks_restores_fewer():
    h = Harness(4, [HostMemoryTier(capacity_bytes=1 << 20)])
    h.serve("a1", PROMPT_A)
    h.serve("b1", PROMPT_B)
    h.manager.match_prefix("hog", PROMPT_B[:9])  # refs B's first 2 blocks
    assert h.manager.try_allocate("hog", 1) is not None  # and takes a third: 1 block free
    match = h.cache.match_prefix("a2", PROMPT_A)
    assert match.num_cached_tokens == 4  # one of A's three blocks fit; the rest is computed
    assert h.pool.read_block(match.block_ids[0]) == h.expected(PROMPT_A)[0]


def test_no_free_blocks_restores_none():
    h = Harness(4, [HostMemoryTier(capacity_bytes=1 << 20)])
    h.serve("a1", PROMPT_A)
    h.serve("b1", PROMPT_B)
    h.manager.match_prefix("hog", PROMPT_B)
    assert h.manager.try_allocate("hog", 4) is not None  # every block referenced
    assert h.cache.match_prefix("a2", PROMPT_A).num_cached_tokens == 0


class ExplodingTier:
    name = "exploding"

    def __init__(self) -> None:
        self.calls = 0

    def _boom(self, *args):
        self.calls += 1
        raise ConnectionError("store unreachable")

    contains = get = put = remove = _boom

    def close(self) -> None:
        pass


def test_a_failing_tier_degrades_to_recompute_and_is_skipped_for_a_while(caplog):
    tier, now = ExplodingTier(), [0.0]
    h = Harness(4, [tier], retry_after_s=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="mooncake_kv.tiers.offload"):
        h.serve("a1", PROMPT_A)
        h.serve("b1", PROMPT_B)
        cached, seen = h.serve("a2", PROMPT_A)
        assert cached == 0 and seen == h.expected(PROMPT_A)  # recomputed
        assert tier.calls == 1  # skipped after the first failure
        now[0] = 6.0
        h.serve("b2", PROMPT_B)  # B was evicted by a2: looked up below again
    assert tier.calls == 2  # tried again once the pause was over, failed, paused again
    warnings = [r for r in caplog.records if "exploding failed" in r.getMessage()]
    assert len(warnings) == 1  # logged once while it keeps failing
    tier_stats = h.cache.stats().tiers[0]
    assert tier_stats.num_errors == 2 and tier_stats.num_skipped > 0


def test_a_tier_that_recovers_is_used_again(caplog):
    inner, now = HostMemoryTier(capacity_bytes=1 << 20), [0.0]
    flaky = FlakyTier(inner)
    h = Harness(4, [flaky], retry_after_s=5.0, clock=lambda: now[0])
    flaky.is_down = True
    h.serve("a1", PROMPT_A)
    h.serve("b1", PROMPT_B)  # offload fails: A's blocks are gone for good
    flaky.is_down = False
    now[0] = 10.0
    with caplog.at_level(logging.WARNING, logger="mooncake_kv.tiers.offload"):
        assert h.serve("a2", PROMPT_A)[0] == 0
        h.serve("b2", PROMPT_B)  # B matched in the pool; A's blocks offloaded now
        cached, seen = h.serve("a3", PROMPT_A)
    assert "works again" in caplog.text
    assert cached == 12 and seen == h.expected(PROMPT_A)


class FlakyTier:
    name = "flaky"

    def __init__(self, inner) -> None:
        self.inner, self.is_down = inner, False

    def __getattr__(self, op):
        def call(*args):
            if self.is_down:
                raise TimeoutError("store unreachable")
            return getattr(self.inner, op)(*args)

        return call


def test_a_lying_tier_is_caught_by_the_frame(caplog):
    tier = HostMemoryTier(capacity_bytes=1 << 20)
    h = Harness(4, [tier])
    h.serve("a1", PROMPT_A)
    h.serve("b1", PROMPT_B)
    first = f"{SHAPE.fingerprint()}/{h.manager.hasher.hash_tokens(PROMPT_A)[0].hex()}"
    blob = bytearray(tier.get(first))
    blob[-1] ^= 0xFF  # one flipped bit of KV
    tier.put(first, bytes(blob))
    with caplog.at_level(logging.WARNING, logger="mooncake_kv.tiers.offload"):
        cached, _ = h.serve("a2", PROMPT_A)
    assert cached == 0
    assert h.cache.stats().tiers[0].num_corrupt == 1
    assert "checksum" in caplog.text and not tier.contains(first)


def test_unreachable_store_is_left_out_at_open(caplog):
    manager = KVCacheManager(4, BLOCK)
    with KVPool.create(KVLayout(SHAPE, 4)) as pool, caplog.at_level(logging.WARNING):
        cache = TieredKVCache.open(manager, pool, [
            HostTierConfig(capacity_bytes=1 << 20),
            StoreTierConfig(master_address="127.0.0.1:9", connect_timeout_s=0.2),
        ])
        assert [t.name for t in cache.tiers] == ["host"]
        assert "mooncake_store left out" in caplog.text
        cache.close()
        cache.close()


def test_no_tiers_is_plain_matching():
    h = Harness(4, [])
    h.serve("a1", PROMPT_A)
    assert h.serve("a2", PROMPT_A)[0] == 12
    assert h.cache.stats().hit_rate == 0.0
