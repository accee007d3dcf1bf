"""Threading contract: one owner thread mutates; stats, snapshots and events from any thread."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator

import pytest

from mooncake_kv import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    KVEvent,
    OwnerThreadError,
)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every few bytecodes so races would show up."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(old)


def run_in_thread(fn: object) -> list[BaseException]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return errors


def test_only_the_owner_thread_may_mutate() -> None:
    mgr = KVCacheManager(16, 4)
    mgr.match_prefix("a", list(range(9)))  # this thread becomes the owner
    errors = run_in_thread(lambda: mgr.free("a"))
    assert len(errors) == 1 and isinstance(errors[0], OwnerThreadError)
    assert "release_owner" in str(errors[0])
    assert mgr.stats().num_running_requests == 1  # nothing changed
    assert run_in_thread(lambda: mgr.stats()) == []  # reads are fine from anywhere

    mgr.release_owner()

    def take_over() -> None:
        mgr.free("a")
        mgr.release_owner()

    assert run_in_thread(take_over) == []
    mgr.match_prefix("b", [1])  # back on this thread


def test_stats_snapshots_and_events_from_other_threads(fast_switching: None) -> None:
    mgr = KVCacheManager(48, 4)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000) for _ in range(24)] for _ in range(4)]
    stop = threading.Event()
    problems: list[str] = []
    queue = mgr.open_event_queue()
    drained: list[KVEvent] = []

    def read_stats() -> None:
        last_queries = 0
        while not stop.is_set():
            s = mgr.stats()
            if s.num_used_blocks + s.num_free_blocks != s.num_blocks:
                problems.append(f"used + free != capacity: {s}")
            if s.num_hit_tokens > s.num_query_tokens or s.num_queries < last_queries:
                problems.append(f"counters inconsistent: {s}")
            last_queries = s.num_queries
            snap = mgr.snapshot()
            unreferenced = {b for b, c in enumerate(snap.ref_counts) if c == 0}
            if set(snap.free_queue) != unreferenced:
                problems.append("free queue is not the unreferenced blocks")

    def churn_subscriptions() -> None:
        def noop(event: KVEvent) -> None:
            pass

        while not stop.is_set():
            mgr.subscribe(noop)
            mgr.unsubscribe(noop)

    def drain() -> None:
        while not stop.is_set():
            drained.extend(queue.drain())

    helpers = [
        threading.Thread(target=f) for f in (read_stats, read_stats, churn_subscriptions, drain)
    ]
    for thread in helpers:
        thread.start()
    try:
        for i in range(250):  # the owner: this thread
            prompt = rng.choice(prefixes) + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 9))
            ]
            rid = f"r{i}"
            match = mgr.match_prefix(rid, prompt)
            if (mgr.try_allocate(rid, len(prompt) - match.num_cached_tokens) is not None
                    and mgr.try_append(rid, 4) is not None):
                mgr.commit(rid, prompt + [1, 2, 3, 4])
            mgr.free(rid)
    finally:
        stop.set()
        for thread in helpers:
            thread.join()
    drained.extend(queue.drain())
    assert problems == []
    # replaying the drained events in order reproduces exactly what is cached
    cached: set[bytes] = set()
    for event in drained:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        elif isinstance(event, AllCleared):
            cached.clear()
    assert cached == {h for h, _ in mgr.snapshot().cached}
    assert mgr.stats().num_evicted_blocks > 0  # the run did exercise eviction
