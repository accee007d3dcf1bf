"""KVCacheManager: verb flow, golden ids and eviction order, misuse, events, stats."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from mooncake_kv import (
    AllCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    DoubleFreeError,
    DuplicateRequestError,
    ExtraKeys,
    KVCacheBlocks,
    KVCacheManager,
    KVEvent,
    PrefixMatch,
    RequestFinishedError,
    RequestStateError,
    TokenCountError,
    TokenIdError,
    UnknownRequestError,
)

INDEXES = ["hash", "radix"]


@pytest.fixture(params=INDEXES)
def make(request: pytest.FixtureRequest) -> Callable[..., KVCacheManager]:
    def build(num_blocks: int = 6, block_size: int = 4, **kwargs: object) -> KVCacheManager:
        return KVCacheManager(
            num_blocks, block_size, index=request.param, check_invariants=True, **kwargs
        )

    return build


def serve(mgr: KVCacheManager, rid: str, prompt: list[int], gen: list[int]) -> PrefixMatch:
    """One whole request: match, allocate the prompt, append gen, commit, free."""
    match = mgr.match_prefix(rid, prompt)
    assert mgr.try_allocate(rid, len(prompt) - match.num_cached_tokens) is not None
    assert mgr.try_append(rid, len(gen)) is not None
    mgr.commit(rid, prompt + gen)
    mgr.free(rid)
    return match


def test_golden_walkthrough(make: Callable[..., KVCacheManager]) -> None:
    mgr = make()
    events: list[KVEvent] = []
    mgr.subscribe(events.append)
    hashes = BlockHasher(4).hash_tokens(list(range(10)) + [100, 101])
    prompt = list(range(10))

    assert mgr.match_prefix("A", prompt) == PrefixMatch((), 0)
    assert mgr.try_allocate("A", 10) == KVCacheBlocks((0, 1, 2), 3)
    assert mgr.commit("A", prompt) == 2
    assert mgr.try_append("A") == KVCacheBlocks((0, 1, 2), 0)  # token 11 fits block 2
    assert mgr.try_append("A", 2) == KVCacheBlocks((0, 1, 2, 3), 1)
    assert mgr.commit("A", prompt + [100, 101, 102]) == 1  # a generated block fills
    assert events == [
        BlockStored((hashes[0], hashes[1]), None, tuple(range(8)), 4, (0, 1)),
        BlockStored((hashes[2],), hashes[1], (8, 9, 100, 101), 4, (2,)),
    ]
    mgr.free("A")
    assert mgr.snapshot().free_queue == (3, 4, 5, 2, 1, 0)  # uncached, then tail-first LRU

    # next turn reuses the previous answer's block; never the whole prompt
    turn2 = prompt + [100, 101, 102, 7, 7, 7]
    assert mgr.match_prefix("B", turn2) == PrefixMatch((0, 1, 2), 12)
    assert mgr.match_prefix("C", list(range(50, 62))).block_ids == ()
    assert mgr.try_allocate("C", 12) == KVCacheBlocks((3, 4, 5), 3)
    mgr.free("B")  # back to the LRU end: 2, 1, 0
    events.clear()
    mgr.match_prefix("D", list(range(80, 88)))
    assert mgr.try_allocate("D", 8) == KVCacheBlocks((2, 1), 2)  # chain tail evicted first
    assert events == [BlockRemoved((hashes[2], hashes[1]), (2, 1))]
    assert mgr.stats().num_evicted_blocks == 2
    assert mgr.match_prefix("E", turn2).block_ids == (0,)


def test_never_matches_the_whole_prompt(make: Callable[..., KVCacheManager]) -> None:
    mgr = make()
    serve(mgr, "a", list(range(8)), [])
    assert mgr.match_prefix("b", list(range(8))).num_cached_tokens == 4
    assert mgr.match_prefix("c", list(range(9))).num_cached_tokens == 8
    assert mgr.match_prefix("d", []).num_cached_tokens == 0


def test_chunked_prefill_caches_each_chunk(make: Callable[..., KVCacheManager]) -> None:
    mgr = make()
    prompt = list(range(10))
    mgr.match_prefix("a", prompt)
    for stop in (4, 8, 10):
        assert mgr.try_allocate("a", 4 if stop < 10 else 2) is not None
        mgr.commit("a", prompt[:stop])
    assert mgr.num_cached_blocks == 2
    assert mgr.match_prefix("b", prompt).num_cached_tokens == 8


def test_out_of_blocks_returns_none_without_side_effects(
    make: Callable[..., KVCacheManager],
) -> None:
    mgr = make(num_blocks=4)
    serve(mgr, "old", list(range(8)), [])  # two cached, free blocks
    mgr.match_prefix("a", list(range(100, 112)))
    assert mgr.try_allocate("a", 12) is not None  # takes 2 free + evicts 1
    mgr.match_prefix("b", list(range(200, 212)))
    before = (mgr.snapshot(), mgr.stats())
    assert mgr.try_allocate("b", 12) is None
    assert mgr.try_allocate("b", 0) is not None  # zero tokens need no block
    assert (mgr.snapshot(), mgr.stats()) == before
    mgr.free("a")
    assert mgr.try_allocate("b", 12) is not None


def test_concurrent_identical_prompts_share_one_cached_chain(
    make: Callable[..., KVCacheManager],
) -> None:
    mgr = make(num_blocks=10)
    prompt = list(range(8))
    for rid in ("a", "b"):
        assert mgr.match_prefix(rid, prompt).block_ids == ()
    for rid, num_decode in (("a", 1), ("b", 4)):
        mgr.try_allocate(rid, 8)
        mgr.try_append(rid, num_decode)
    assert mgr.commit("a", prompt) == 2
    assert mgr.commit("b", prompt) == 0  # b's blocks 3, 4 duplicate a's 0, 1
    assert mgr.block_ids("b") == (0, 1, 5)  # ... and are swapped for them
    assert mgr.num_free_blocks == 10 - 4  # a: 0, 1, 2; b: 5 (3 and 4 went back)
    assert mgr.commit("b", prompt + [9, 9, 9, 9]) == 1  # b's answer chains under a's blocks
    mgr.free("a")
    mgr.free("b")
    assert mgr.match_prefix("c", prompt + [9, 9, 9, 9, 1]).block_ids == (0, 1, 5)
    mgr.free("c")
    assert mgr.evict(10) == 3  # tails first: radix would assert otherwise


def test_a_prompt_computed_without_lookup_holds_one_block_per_position(
    make: Callable[..., KVCacheManager],
) -> None:
    """Prompt logprobs compute a prompt in full (``lookup=False``) though it is cached: at
    commit its blocks are swapped for the cached ones, so it never holds twice its size."""
    mgr = make(num_blocks=6)
    prompt = list(range(12))
    mgr.match_prefix("a", prompt)
    mgr.try_allocate("a", 12)
    mgr.commit("a", prompt)
    mgr.free("a")  # 0, 1, 2 cached and free
    assert mgr.match_prefix("b", prompt, lookup=False).block_ids == ()
    assert mgr.try_allocate("b", 12) is not None  # 3, 4, 5: the uncached free blocks
    assert mgr.commit("b", prompt) == 0
    assert mgr.block_ids("b") == (0, 1, 2)
    assert mgr.num_free_blocks == 3  # 3, 4, 5 are back
    assert mgr.try_append("b", 4) is not None  # room to decode
    mgr.free("b")
    assert mgr.num_free_blocks == 6


def test_salts_and_adapters_isolate_tenants(make: Callable[..., KVCacheManager]) -> None:
    mgr = make()
    prompt = list(range(9))
    mgr.match_prefix("a", prompt, ExtraKeys(cache_salt="tenant-a"))
    mgr.try_allocate("a", 9)
    mgr.commit("a", prompt)
    assert mgr.match_prefix("b", prompt, ExtraKeys(cache_salt="tenant-b")).block_ids == ()
    assert mgr.match_prefix("c", prompt).block_ids == ()
    assert mgr.match_prefix("d", prompt, ExtraKeys(cache_salt="tenant-a")).block_ids == (0, 1)


def test_prefix_caching_can_be_switched_off(make: Callable[..., KVCacheManager]) -> None:
    mgr = make(enable_prefix_caching=False)
    serve(mgr, "a", list(range(9)), [])
    assert mgr.match_prefix("b", list(range(9))).block_ids == ()
    assert mgr.num_cached_blocks == 0


def test_stats_count_hits_in_tokens(make: Callable[..., KVCacheManager]) -> None:
    mgr = make()
    serve(mgr, "a", list(range(10)), [])
    serve(mgr, "b", list(range(10)), [])
    stats = mgr.stats()
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.num_cached_blocks) == (0, 6, 2)
    mgr.match_prefix("c", list(range(10)))
    assert mgr.stats().num_used_blocks == 2 and mgr.stats().num_running_requests == 1


MISUSE = [
    ("free twice", lambda m: m.free("done"), DoubleFreeError),
    ("free unknown", lambda m: m.free("ghost"), UnknownRequestError),
    ("append finished", lambda m: m.try_append("done"), RequestFinishedError),
    ("allocate finished", lambda m: m.try_allocate("done", 1), RequestFinishedError),
    ("commit finished", lambda m: m.commit("done", [1]), RequestFinishedError),
    ("allocate unknown", lambda m: m.try_allocate("ghost", 1), UnknownRequestError),
    ("match live", lambda m: m.match_prefix("live", [1, 2]), DuplicateRequestError),
    ("append before prefill", lambda m: m.try_append("live"), RequestStateError),
    ("negative tokens", lambda m: m.try_allocate("live", -1), TokenCountError),
    ("commit beyond slots", lambda m: m.commit("live", list(range(9))), TokenCountError),
    ("allocate counting the hit twice", lambda m: m.try_allocate("live", 9), TokenCountError),
    ("negative token id", lambda m: m.match_prefix("new", [1, -1]), TokenIdError),
]


@pytest.mark.parametrize(("case", "verb", "error"), MISUSE, ids=[c[0] for c in MISUSE])
def test_misuse_raises_a_specific_error_naming_the_request(
    make: Callable[..., KVCacheManager], case: str, verb: Callable, error: type
) -> None:
    mgr = make()
    serve(mgr, "done", list(range(9)), [])
    mgr.match_prefix("live", list(range(9)))  # holds 2 cached blocks, no allocation
    before = (mgr.snapshot(), mgr.stats())
    with pytest.raises(error) as info:
        verb(mgr)
    assert info.value.request_id in str(info.value)
    assert (mgr.snapshot(), mgr.stats()) == before
    mgr.check_invariants()
    assert serve(mgr, "after", list(range(9)), []).num_cached_tokens == 8


def test_try_allocate_refuses_to_count_the_cached_prefix_twice(
    make: Callable[..., KVCacheManager],
) -> None:
    """After a 12-token hit, ``try_allocate(rid, len(prompt))`` used to book 7 blocks, not 4."""
    mgr = make()
    prompt = list(range(14))
    serve(mgr, "a", prompt, [])
    match = mgr.match_prefix("b", prompt)
    assert match.num_cached_tokens == 12
    with pytest.raises(TokenCountError) as info:
        mgr.try_allocate("b", len(prompt))
    assert str(info.value) == (
        "try_allocate('b', 14) would reserve 26 slots, but request 'b' was matched with 14 "
        "tokens and 12 are reserved already (the cached prefix counts); pass the tokens after "
        "those, at most 2 now (the first call takes len(prompt) - match.num_cached_tokens), "
        "and reserve decode slots with try_append"
    )
    blocks = mgr.try_allocate("b", len(prompt) - match.num_cached_tokens)
    assert blocks is not None and len(blocks.block_ids) == 4
    assert mgr.try_allocate("b", 0) is not None  # nothing more: allowed
    assert mgr.try_append("b", 3) is not None  # decode slots past the prompt
    with pytest.raises(TokenCountError, match="at most 0 now"):
        mgr.try_allocate("b", 1)


def test_a_bad_token_id_is_named_with_its_request_and_position(
    make: Callable[..., KVCacheManager],
) -> None:
    mgr = make()
    with pytest.raises(TokenIdError) as info:
        mgr.match_prefix("r", [5, 6, -1])
    assert str(info.value) == (
        "request 'r': token ids must be integers in [0, 2**32); got -1 at position 2"
    )
    assert info.value.request_id == "r" and isinstance(info.value, ValueError)
    mgr.match_prefix("s", [1, 2, 3])
    mgr.try_allocate("s", 3)
    mgr.try_append("s", 5)
    with pytest.raises(TokenIdError, match=r"request 's': .* got 4294967296 at position 4$"):
        mgr.commit("s", [1, 2, 3, 4, 2**32, 6, 7, 8])
    with pytest.raises(TokenIdError, match=r"got 'x' at position 5$"):
        mgr.commit("s", [1, 2, 3, 4, 5, "x", 7, 8])  # type: ignore[list-item]
    assert mgr.commit("s", [1, 2, 3, 4, 5, 6, 7, 8]) == 2  # nothing was half-done


def test_error_classes_subclass_builtins() -> None:
    assert issubclass(UnknownRequestError, KeyError)
    assert issubclass(DoubleFreeError, RuntimeError)
    assert issubclass(DuplicateRequestError, ValueError)
    assert str(UnknownRequestError("r", "unknown request 'r'")) == "unknown request 'r'"


def test_a_freed_request_can_be_registered_again(make: Callable[..., KVCacheManager]) -> None:
    """Preemption: free, then match again (recomputing what is no longer cached)."""
    mgr = make()
    mgr.match_prefix("r", list(range(9)))
    mgr.try_allocate("r", 9)
    mgr.commit("r", list(range(9)))
    mgr.free("r")
    assert mgr.match_prefix("r", list(range(9))).num_cached_tokens == 8
    mgr.free("r")


def test_removed_is_announced_before_the_block_is_handed_out(
    make: Callable[..., KVCacheManager],
) -> None:
    mgr = make(num_blocks=2)
    serve(mgr, "a", list(range(8)), [])
    log: list[tuple[str, tuple[int, ...]]] = []

    def on_event(event: KVEvent) -> None:
        if isinstance(event, BlockRemoved):
            log.append(("removed", event.block_ids))
            assert mgr.stats().num_cached_blocks == 2 - len(event.block_ids)

    mgr.subscribe(on_event)
    mgr.match_prefix("b", [9, 9, 9, 9])
    blocks = mgr.try_allocate("b", 4)
    assert blocks is not None
    log.append(("allocated", blocks.new_block_ids))
    assert log == [("removed", (1,)), ("allocated", (1,))]


def test_a_failing_subscriber_is_logged_and_skipped(
    make: Callable[..., KVCacheManager], caplog: pytest.LogCaptureFixture
) -> None:
    mgr = make()
    seen: list[KVEvent] = []

    def broken(event: KVEvent) -> None:
        raise RuntimeError("subscriber bug")

    mgr.subscribe(broken)
    mgr.subscribe(seen.append)
    with caplog.at_level(logging.ERROR, logger="mooncake_kv.events"):
        serve(mgr, "a", list(range(8)), [])
    assert "subscriber" in caplog.text and len(seen) == 1
    mgr.unsubscribe(broken)
    with pytest.raises(ValueError, match="not subscribed"):
        mgr.unsubscribe(broken)


def test_reset_prefix_cache(
    make: Callable[..., KVCacheManager], caplog: pytest.LogCaptureFixture
) -> None:
    mgr = make()
    queue = mgr.open_event_queue()
    serve(mgr, "a", list(range(8)), [])
    mgr.match_prefix("b", list(range(9)))  # holds cached blocks
    with caplog.at_level(logging.WARNING, logger="mooncake_kv.manager"):
        assert mgr.reset_prefix_cache() is False
    assert (
        "reset_prefix_cache() dropped nothing: 1 live request(s) hold 2 block(s) (e.g. 'b'); "
        "free them (finish or preempt) first, then reset again"
    ) in caplog.text
    mgr.free("b")
    assert mgr.reset_prefix_cache() is True
    assert mgr.num_cached_blocks == 0 and mgr.num_free_blocks == 6
    assert isinstance(queue.drain()[-1], AllCleared)
    queue.close()
    assert mgr.match_prefix("c", list(range(8))).block_ids == ()


def test_evict_trims_lru_blocks(make: Callable[..., KVCacheManager]) -> None:
    mgr = make()
    serve(mgr, "a", list(range(12)), [])
    assert mgr.evict(1) == 1
    assert mgr.match_prefix("b", list(range(13))).num_cached_tokens == 8
    mgr.free("b")
    assert mgr.evict(10) == 2 and mgr.num_cached_blocks == 0
