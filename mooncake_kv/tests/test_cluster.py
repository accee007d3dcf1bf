"""ClusterPrefixIndex: per-instance leading-block counts from KV events."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mooncake_kv import (
    AllCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    ClusterPrefixIndex,
    ExtraKeys,
    KVCacheManager,
    UnknownInstanceError,
)

BS = 4


def stored(hashes: list[bytes], start: int) -> BlockStored:
    count = len(hashes) - start
    return BlockStored(
        tuple(hashes[start:]),
        hashes[start - 1] if start else None,
        tuple(range(count * BS)),
        BS,
        tuple(range(count)),
    )


def test_counts_leading_blocks_and_stops_at_a_gap() -> None:
    cluster = ClusterPrefixIndex(BS)
    tokens = list(range(16))
    h = BlockHasher(BS).hash_tokens(tokens)
    cluster.apply("a", stored(h[:3], 0))
    cluster.apply("b", stored(h, 0))
    cluster.apply("b", BlockRemoved((h[1],), (1,)))
    cluster.add_instance("c")
    assert cluster.match(tokens) == {"a": 3, "b": 1, "c": 0}
    assert cluster.match(list(range(100, 116))) == {"a": 0, "b": 0, "c": 0}
    assert cluster.num_blocks("b") == 3


def test_follows_real_managers_through_subscriptions() -> None:
    cluster = ClusterPrefixIndex(BS)
    managers = {name: KVCacheManager(8, BS) for name in ("x", "y")}
    for name, mgr in managers.items():
        mgr.subscribe(cluster.subscriber(name))
    system = list(range(12))
    for name, extra in (("x", [50] * 5), ("y", [60] * 5)):
        mgr = managers[name]
        mgr.match_prefix("r", system + extra)
        mgr.try_allocate("r", 17)
        mgr.commit("r", system + extra)
        mgr.free("r")
    assert cluster.match(system + [50] * 5) == {"x": 4, "y": 3}
    # eviction on x is reflected
    managers["x"].evict(8)
    assert cluster.match(system + [50] * 5) == {"x": 0, "y": 3}
    assert managers["y"].reset_prefix_cache()
    assert cluster.match(system) == {"x": 0, "y": 0}


def test_queue_drain_feeds_the_index_too() -> None:
    cluster = ClusterPrefixIndex(BS)
    mgr = KVCacheManager(8, BS)
    queue = mgr.open_event_queue()
    mgr.match_prefix("r", list(range(9)))
    mgr.try_allocate("r", 9)
    mgr.commit("r", list(range(9)))
    cluster.apply_all("q", queue.drain())
    assert cluster.match(list(range(9))) == {"q": 2}


def test_salts_must_match_the_requests() -> None:
    cluster = ClusterPrefixIndex(BS)
    salt = ExtraKeys(cache_salt="t1")
    h = BlockHasher(BS).hash_tokens(list(range(8)), salt)
    cluster.apply("a", stored(h, 0))
    assert cluster.match(list(range(8)), salt) == {"a": 2}
    assert cluster.match(list(range(8))) == {"a": 0}


def test_all_cleared_and_remove_instance() -> None:
    cluster = ClusterPrefixIndex(BS)
    h = BlockHasher(BS).hash_tokens(list(range(8)))
    cluster.apply("a", stored(h, 0))
    cluster.apply("b", stored(h, 0))
    cluster.apply("a", AllCleared())
    assert cluster.match(list(range(8))) == {"a": 0, "b": 2}
    cluster.remove_instance("b")
    assert cluster.instances() == ("a",)
    assert cluster.match(list(range(8))) == {"a": 0}
    with pytest.raises(UnknownInstanceError, match="known instances: a"):
        cluster.remove_instance("b")


def test_bad_events_are_rejected() -> None:
    cluster = ClusterPrefixIndex(BS)
    with pytest.raises(ValueError, match="blocks of 8 tokens"):
        cluster.apply("a", BlockStored((b"h",), None, tuple(range(8)), 8, (0,)))
    with pytest.raises(TypeError, match="BlockStored"):
        cluster.apply("a", "not an event")  # type: ignore[arg-type]


# ---- the bound: announced evictions, then least recently used -----------------------------------
def chain(start: int, num_blocks: int) -> list[bytes]:
    return BlockHasher(BS).hash_tokens(list(range(start, start + num_blocks * BS)))


def test_removed_events_take_entries_out() -> None:
    cluster = ClusterPrefixIndex(BS, max_entries=100)
    h = chain(0, 4)
    cluster.apply("a", stored(h, 0))
    cluster.apply("b", stored(h[:2], 0))
    assert cluster.num_entries == 6
    cluster.apply("a", BlockRemoved(tuple(h[2:]), (2, 3)))  # a evicted its tail
    assert cluster.num_entries == 4 and cluster.num_dropped == 0
    assert cluster.match_hashes(h) == {"a": 2, "b": 2}
    cluster.apply("b", AllCleared())
    assert cluster.num_entries == 2 and cluster.match_hashes(h) == {"a": 2, "b": 0}


def test_the_bound_drops_the_least_recent_tail_first() -> None:
    cluster = ClusterPrefixIndex(BS, max_entries=5)
    a, b = chain(0, 4), chain(1000, 1)
    cluster.apply("b", stored(b, 0))
    cluster.apply("a", stored(a, 0))
    assert cluster.num_entries == 5
    cluster.match_hashes(a)  # a's chain is now the most recent, its head last
    cluster.apply("c", stored(chain(2000, 1), 0))  # one over: b's block goes
    cluster.apply("c", stored(chain(3000, 1), 0))  # then a's tail, not its head
    assert cluster.num_entries == 5 and cluster.num_dropped == 2
    assert cluster.num_blocks("b") == 0 and cluster.num_blocks("c") == 2
    assert cluster.match_hashes(a) == {"a": 3, "b": 0, "c": 0}


def test_unconfirmed_prompts_stay_within_the_bound() -> None:
    # a router records each prompt's blocks; the instance never confirms nor evicts them
    cluster = ClusterPrefixIndex(BS, max_entries=64)
    for prompt in range(500):
        cluster.apply("a", stored(chain(prompt * 100, 3), 0))
        assert cluster.num_entries <= 64
    assert cluster.num_entries == 64 and cluster.num_blocks("a") == 64
    assert cluster.match_hashes(chain(499 * 100, 3)) == {"a": 3}  # the newest is kept
    assert cluster.match_hashes(chain(0, 3)) == {"a": 0}


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_entries must be at least 1, got 0"):
        ClusterPrefixIndex(BS, max_entries=0)


class BoundedIndexMachine(RuleBasedStateMachine):
    """The index against a model: an ordered list of (instance, hash) entries, oldest first."""

    MAX = 6

    def __init__(self) -> None:
        super().__init__()
        self.cluster = ClusterPrefixIndex(BS, max_entries=self.MAX)
        self.entries: list[tuple[str, bytes]] = []
        self.chains = [chain(1000 * i, 3) for i in range(4)]

    def _touch(self, instance: str, hashes: list[bytes]) -> None:
        for h in reversed(hashes):  # the head ends most recent
            if (instance, h) in self.entries:
                self.entries.remove((instance, h))
            self.entries.append((instance, h))

    def _expected(self, hashes: list[bytes]) -> dict[str, int]:
        held = set(self.entries)
        counts = {}
        for instance in self.cluster.instances():
            depth = 0
            while depth < len(hashes) and (instance, hashes[depth]) in held:
                depth += 1
            counts[instance] = depth
        return counts

    @rule(instance=st.sampled_from("ab"), which=st.integers(0, 3), start=st.integers(0, 2))
    def store(self, instance: str, which: int, start: int) -> None:
        hashes = self.chains[which]
        self.cluster.apply(instance, stored(hashes, start))
        self._touch(instance, hashes[start:])
        while len(self.entries) > self.MAX:
            self.entries.pop(0)

    @rule(instance=st.sampled_from("ab"), which=st.integers(0, 3), depth=st.integers(0, 2))
    def remove(self, instance: str, which: int, depth: int) -> None:
        gone = self.chains[which][depth:]
        self.cluster.apply(instance, BlockRemoved(tuple(gone), ()))
        self.entries = [e for e in self.entries if e[0] != instance or e[1] not in gone]

    @rule(which=st.integers(0, 3))
    def match(self, which: int) -> None:
        hashes = self.chains[which]
        expected = self._expected(hashes)
        assert self.cluster.match_hashes(hashes) == expected
        for instance, count in expected.items():
            self._touch(instance, hashes[:count])

    @invariant()
    def bounded_and_equal(self) -> None:
        assert self.cluster.num_entries == len(self.entries) <= self.MAX
        for instance in self.cluster.instances():
            assert self.cluster.num_blocks(instance) == sum(e[0] == instance for e in self.entries)


TestBoundedIndexMachine = BoundedIndexMachine.TestCase
