"""ClusterPrefixIndex: per-instance leading-block counts from KV events."""

from __future__ import annotations

import pytest

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
