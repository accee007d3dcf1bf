"""Stateful test: a hash-index and a radix-index manager, in lockstep, against a model.

After every step both managers must equal each other and the model: ref counts match the
model's; the free queue is exactly the unreferenced blocks (none both free and
referenced; free + used = capacity); every index entry points at a block carrying that
hash and is what the model expects cached; radix evictable + protected = total. The
model learns which blocks were evicted from ``BlockRemoved`` events and checks each
eviction was legal (unreferenced, cached, a chain tail, only as many as needed). Misuse
rules raise their specific errors and the run continues.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake_kv import (
    AllCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    DoubleFreeError,
    DuplicateRequestError,
    KVCacheManager,
    KVEvent,
    RadixIndex,
    RequestFinishedError,
    RequestStateError,
    TokenCountError,
    UnknownRequestError,
)

BS = 2
NUM_BLOCKS = 10
HASHER = BlockHasher(BS)
BASES = [list(range(100, 116)), list(range(200, 216)), [7] * 16]
small_tokens = st.lists(st.integers(0, 3), max_size=6)


@attrs.define
class ModelRequest:
    tokens: list[int]  # prompt, then generated tokens as commits reveal them
    table: list[int]
    reserved: int
    committed: int  # full blocks offered to the index
    allocated: bool = False
    num_prompt: int = 0  # tokens given to match_prefix: try_allocate reserves no further


@attrs.define
class Model:
    refs: Counter = attrs.field(factory=Counter)
    cache: dict[bytes, int] = attrs.field(factory=dict)  # hash -> block
    parent: dict[bytes, bytes | None] = attrs.field(factory=dict)
    live: dict[str, ModelRequest] = attrs.field(factory=dict)
    finished: dict[str, list[int]] = attrs.field(factory=dict)  # id -> its tokens

    def num_free(self) -> int:
        return NUM_BLOCKS - sum(1 for c in self.refs.values() if c > 0)

    def num_free_uncached(self) -> int:
        cached = set(self.cache.values())
        return sum(1 for b in range(NUM_BLOCKS) if self.refs[b] == 0 and b not in cached)

    def expected_match(self, tokens: list[int]) -> list[int]:
        found = []
        for block_hash in HASHER.hash_tokens(tokens)[: max(0, (len(tokens) - 1) // BS)]:
            if block_hash not in self.cache:
                break
            found.append(self.cache[block_hash])
        return found

    def evict(self, block_hash: bytes, block_id: int) -> None:
        assert self.cache.get(block_hash) == block_id, "evicted a block the model lacks"
        assert self.refs[block_id] == 0, f"evicted referenced block {block_id}"
        assert block_hash not in self.parent.values(), "evicted a block with cached children"
        del self.cache[block_hash]
        del self.parent[block_hash]


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.managers = [
            KVCacheManager(NUM_BLOCKS, BS, index=name, check_invariants=True)
            for name in ("hash", "radix")
        ]
        self.events: list[list[KVEvent]] = [[], []]
        for manager, sink in zip(self.managers, self.events, strict=True):
            manager.subscribe(sink.append)
        self.model = Model()
        self.counter = 0

    # ---- helpers ------------------------------------------------------------------------
    def both(self, verb: Callable[[KVCacheManager], Any]) -> Any:
        results = [verb(m) for m in self.managers]
        assert results[0] == results[1], "hash and radix managers disagree"
        assert self.events[0] == self.events[1], "hash and radix managers emit differently"
        return results[0]

    def both_raise(self, verb: Callable[[KVCacheManager], Any], error: type, rid: str) -> None:
        for manager in self.managers:
            with pytest.raises(error) as info:
                verb(manager)
            assert info.value.request_id == rid and repr(rid) in str(info.value)

    def take_events(self) -> list[KVEvent]:
        events = list(self.events[0])
        for sink in self.events:
            sink.clear()
        return events

    def apply_removals(self, events: list[KVEvent]) -> int:
        removed = 0
        for event in events:
            if isinstance(event, BlockRemoved):
                for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                    self.model.evict(block_hash, block_id)
                    removed += 1
        return removed

    def pick(self, data: st.DataObject, ids: Any) -> str:
        return data.draw(st.sampled_from(sorted(ids)))

    def register(self, tokens: list[int]) -> None:
        rid = f"q{self.counter}"
        self.counter += 1
        match = self.both(lambda m: m.match_prefix(rid, tokens))
        expected = self.model.expected_match(tokens)
        assert list(match.block_ids) == expected
        assert match.num_cached_tokens == len(expected) * BS < max(1, len(tokens))
        self.model.refs.update(expected)
        self.model.live[rid] = ModelRequest(
            list(tokens), expected, len(expected) * BS, len(expected), num_prompt=len(tokens)
        )

    # ---- normal verbs ---------------------------------------------------------------------
    @rule(base=st.integers(0, 2), keep=st.integers(0, 16), suffix=small_tokens)
    def new_request(self, base: int, keep: int, suffix: list[int]) -> None:
        self.register(BASES[base][:keep] + suffix)

    @precondition(lambda self: self.model.finished)
    @rule(data=st.data(), more=small_tokens)
    def next_turn(self, data: st.DataObject, more: list[int]) -> None:
        """A follow-up prompt = a finished request's whole sequence + new tokens."""
        rid = self.pick(data, self.model.finished)
        self.register(self.model.finished[rid] + more)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def twin_request(self, data: st.DataObject) -> None:
        """Same prompt as a live request: both may compute and commit the same blocks."""
        self.register(list(self.model.live[self.pick(data, self.model.live)].tokens))

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), lookahead=st.integers(0, 3), generated=small_tokens)
    def prefill_and_commit(self, data: st.DataObject, lookahead: int, generated: list[int]) -> None:
        """The common path: reserve the rest of the prompt (+ decode slots), commit it all."""
        rid = self.pick(data, self.model.live)
        req = self.model.live[rid]
        rest = max(0, req.num_prompt - req.reserved)
        if self.try_grow(rid, rest, False) and self.try_grow(rid, lookahead, True):
            self.do_commit(rid, req.reserved, generated)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), num_tokens=st.integers(0, 7), append=st.booleans())
    def allocate(self, data: st.DataObject, num_tokens: int, append: bool) -> None:
        self.try_grow(self.pick(data, self.model.live), num_tokens, append)

    def try_grow(self, rid: str, num_tokens: int, append: bool) -> bool:
        req = self.model.live[rid]
        if append and not req.allocated:
            self.both_raise(lambda m: m.try_append(rid, num_tokens), RequestStateError, rid)
            return False
        if not append and num_tokens > 0 and req.reserved + num_tokens > req.num_prompt:
            self.both_raise(lambda m: m.try_allocate(rid, num_tokens), TokenCountError, rid)
            return False  # prefill slots end with the prompt; decode ones come from try_append
        verb = "try_append" if append else "try_allocate"
        needed = -(-(req.reserved + num_tokens) // BS) - len(req.table)
        uncached_free = self.model.num_free_uncached()
        out = self.both(lambda m: getattr(m, verb)(rid, num_tokens))
        events = self.take_events()
        if out is None:
            assert needed > self.model.num_free() and not events
            return False
        assert self.apply_removals(events) == max(0, needed - uncached_free)
        new = list(out.new_block_ids)
        assert len(new) == max(0, needed) and all(self.model.refs[b] == 0 for b in new)
        self.model.refs.update(new)
        req.table += new
        req.reserved += num_tokens
        req.allocated = True
        assert list(out.block_ids) == req.table
        return True

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), generated=small_tokens)
    def commit(self, data: st.DataObject, generated: list[int]) -> None:
        rid = self.pick(data, self.model.live)
        self.do_commit(rid, data.draw(st.integers(0, self.model.live[rid].reserved)), generated)

    def do_commit(self, rid: str, num: int, generated: list[int]) -> None:
        req = self.model.live[rid]
        if len(req.tokens) < req.reserved:  # decoding reveals tokens beyond the prompt
            req.tokens += (generated + [0] * req.reserved)[: req.reserved - len(req.tokens)]
        sequence = req.tokens[:num]
        stored = self.both(lambda m: m.commit(rid, sequence))
        assert stored == self.model_commit(req, sequence)
        # a block computed twice is swapped for its cached twin: one block per position
        assert [list(m.block_ids(rid)) for m in self.managers] == [req.table, req.table]
        events = self.take_events()
        assert all(isinstance(e, BlockStored) for e in events)
        assert sum(len(e.block_hashes) for e in events) == stored

    def model_commit(self, req: ModelRequest, sequence: list[int]) -> int:
        full = len(sequence) // BS
        hashes = HASHER.hash_tokens(sequence)
        stored = 0
        for position in range(req.committed, full):
            block_hash, own = hashes[position], req.table[position]
            parent = hashes[position - 1] if position else None
            assert parent is None or parent in self.model.cache, "cached under an uncached parent"
            if block_hash in self.model.cache:
                holder = self.model.cache[block_hash]
                assert holder != own
                req.table[position] = holder  # the request swaps its block for the twin
                self.model.refs[holder] += 1
                self.model.refs[own] -= 1
            else:
                self.model.cache[block_hash] = own
                self.model.parent[block_hash] = parent
                stored += 1
        req.committed = max(req.committed, full)
        return stored

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = self.pick(data, self.model.live)
        self.both(lambda m: m.free(rid))
        req = self.model.live.pop(rid)
        self.model.refs.subtract(req.table)
        self.model.finished[rid] = req.tokens

    @rule(num_blocks=st.integers(0, 4))
    def evict(self, num_blocks: int) -> None:
        evictable = sum(1 for b in self.model.cache.values() if self.model.refs[b] == 0)
        count = self.both(lambda m: m.evict(num_blocks))
        assert count == min(num_blocks, evictable)
        assert self.apply_removals(self.take_events()) == count

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = self.model.num_free() == NUM_BLOCKS
        assert self.both(lambda m: m.reset_prefix_cache()) is idle
        events = self.take_events()
        if idle:
            assert events == ([AllCleared()] if self.model.cache else events)
            self.model.cache.clear()
            self.model.parent.clear()

    # ---- misuse: raises, names the request, changes nothing -----------------------------
    @precondition(lambda self: self.model.finished)
    @rule(data=st.data())
    def misuse_finished(self, data: st.DataObject) -> None:
        rid = self.pick(data, self.model.finished)
        if rid in self.model.live:
            return
        self.both_raise(lambda m: m.free(rid), DoubleFreeError, rid)
        self.both_raise(lambda m: m.try_append(rid), RequestFinishedError, rid)
        self.both_raise(lambda m: m.commit(rid, []), RequestFinishedError, rid)

    @rule()
    def misuse_unknown(self) -> None:
        self.both_raise(lambda m: m.free("ghost"), UnknownRequestError, "ghost")
        self.both_raise(lambda m: m.try_allocate("ghost", 1), UnknownRequestError, "ghost")

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def misuse_live(self, data: st.DataObject) -> None:
        rid = self.pick(data, self.model.live)
        req = self.model.live[rid]
        self.both_raise(lambda m: m.match_prefix(rid, [1]), DuplicateRequestError, rid)
        too_many = [0] * (req.reserved + 1)
        self.both_raise(lambda m: m.commit(rid, too_many), TokenCountError, rid)

    # ---- checked after every step ---------------------------------------------------------
    @invariant()
    def matches_model(self) -> None:
        snaps = [m.snapshot() for m in self.managers]
        assert snaps[0] == snaps[1]
        snap = snaps[0]
        assert list(snap.ref_counts) == [self.model.refs[b] for b in range(NUM_BLOCKS)]
        free = set(snap.free_queue)
        assert free == {b for b in range(NUM_BLOCKS) if self.model.refs[b] == 0}
        assert len(free) == len(snap.free_queue) == self.managers[0].num_free_blocks
        assert len(free) + sum(c > 0 for c in snap.ref_counts) == NUM_BLOCKS
        assert dict(snap.cached) == self.model.cache
        radix = self.managers[1].index
        assert isinstance(radix, RadixIndex)
        assert radix.evictable_size + radix.protected_size == radix.total_size
        locked = sum(1 for b in self.model.cache.values() if self.model.refs[b] > 0)
        assert radix.protected_size == locked
        stats = self.managers[0].stats()
        assert stats.num_used_blocks + stats.num_free_blocks == NUM_BLOCKS
        assert stats.num_cached_blocks == len(self.model.cache)


KVCacheMachine.TestCase.settings = settings(
    KVCacheMachine.TestCase.settings, stateful_step_count=40
)
TestKVCacheMachine = KVCacheMachine.TestCase
