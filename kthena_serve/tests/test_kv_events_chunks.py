"""The router's chunk hash and ``RouterChunks`` (no Redis, no engine).

The hash is checked against an implementation written here from the plugin's documented rule;
``RouterChunks`` runs in a Hypothesis state machine against a brute-force model: after every
event, the chunks it holds are exactly the router chunks of the cached sequences.
"""

from __future__ import annotations

import argparse
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kthena_serve.kv_events import RouterChunks, chunk_hash, prompt_chunk_hashes, redis_key
from kthena_serve.serve_args import add_kv_events_args
from kthena_serve.spec import ServeSpec
from mooncake_kv import AllCleared, BlockRemoved, BlockStored, ExtraKeys, KVCacheManager


def doc_hash(chunk: list[int]) -> int:
    """kvcache_aware.go, computeStandardizedHash: SHA-256 over the ids as big-endian uint32,
    first 8 bytes as a big-endian uint64, top bit cleared."""
    digest = hashlib.sha256(b"".join(t.to_bytes(4, "big") for t in chunk)).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFFFFFFFFFFFFFF


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40))
def test_chunk_hash_is_the_documented_hash(tokens):
    assert chunk_hash(tokens) == doc_hash(tokens)


def test_chunk_hash_golden():
    # from coreutils: printf '\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00\x03' | sha256sum
    assert chunk_hash([1, 2, 3]) == 0x7B0B5EA3FF36958C == 8866284349863400844
    # printf '\x00\x00\xff\xff' | sha256sum -> b7d1b3a1104cc86b...: the top bit is cleared
    assert chunk_hash([65535]) == 0x37D1B3A1104CC86B
    assert chunk_hash([]) == 0
    assert redis_key("m/x", chunk_hash([7])) == f"matrix:kv:block:m/x@{doc_hash([7])}"


def test_prompt_chunks_follow_the_router():
    tokens = list(range(40))
    assert prompt_chunk_hashes(tokens) == [doc_hash(tokens[0:16]), doc_hash(tokens[16:32]),
                                           doc_hash(tokens[32:40])]  # last one partial
    assert len(prompt_chunk_hashes(list(range(16 * 200)))) == 128


def _stored(hashes, parent, tokens, size):
    return BlockStored(tuple(hashes), parent, tuple(tokens), size, tuple(range(len(hashes))))


def test_chunks_across_blocks_golden():
    """block_size 4, chunk_size 6: chunk 0 ends in block 1, chunk 1 in block 2."""
    chunks = RouterChunks(chunk_size=6, max_chunks=128)
    tokens = list(range(100, 112))
    chunks.apply(_stored([b"a", b"b"], None, tokens[:8], 4))
    assert chunks.held() == {doc_hash(tokens[0:6])}
    chunks.apply(_stored([b"c"], b"b", tokens[8:12], 4))
    assert chunks.held() == {doc_hash(tokens[0:6]), doc_hash(tokens[6:12])}
    assert chunks.take_changed() == chunks.held()
    chunks.apply(BlockRemoved((b"c",), (2,)))
    assert chunks.held() == {doc_hash(tokens[0:6])}
    assert chunks.take_changed() == {doc_hash(tokens[6:12])}


def test_same_chunk_twice_is_held_until_both_go():
    chunks = RouterChunks(chunk_size=4, max_chunks=8)
    chunks.apply(_stored([b"a"], None, [1, 2, 3, 4], 4))
    chunks.apply(_stored([b"x", b"y"], None, [9, 9, 9, 9, 1, 2, 3, 4], 4))  # same chunk later
    assert chunks.ref_counts[doc_hash([1, 2, 3, 4])] == 2
    chunks.apply(BlockRemoved((b"a",), (0,)))
    assert doc_hash([1, 2, 3, 4]) in chunks.held()
    chunks.apply(BlockRemoved((b"y", b"x"), (2, 1)))
    assert chunks.held() == set()


def test_unknown_parent_is_skipped_and_retain_forgets():
    chunks = RouterChunks(chunk_size=2, max_chunks=8)
    chunks.apply(_stored([b"b"], b"lost", [1, 2], 2))
    assert chunks.held() == set() and chunks.num_skipped_blocks == 1
    chunks.apply(_stored([b"a"], None, [1, 2], 2))
    assert chunks.retain({b"other"}) == 1 and chunks.held() == set()


def _cache(manager: KVCacheManager, request_id: str, tokens: list[int], **extra) -> None:
    """Run one request through the manager's verbs: its full blocks end up cached."""
    match = manager.match_prefix(request_id, tokens, ExtraKeys(**extra) if extra else None)
    assert manager.try_allocate(request_id, len(tokens) - match.num_cached_tokens) is not None
    manager.commit(request_id, tokens)
    manager.free(request_id)


def test_only_plain_token_blocks_are_announced():
    """A salted, adapter or image block's KV is not what the router's bare tokens name."""
    manager = KVCacheManager(64, 4)
    chunks = RouterChunks(chunk_size=8, max_chunks=128, hasher=manager.hasher)
    manager.subscribe(chunks.apply)
    tokens = list(range(1, 18))
    _cache(manager, "salted", tokens, cache_salt="tenant-a")
    _cache(manager, "adapter", tokens, adapter_id="lora-1")
    assert chunks.held() == set() and chunks.num_skipped_blocks == 8
    _cache(manager, "image", tokens, input_hashes=((9, b"img"),))  # image starts in block 2
    assert chunks.held() == {doc_hash(tokens[0:8])}  # blocks 0-1 are plain, 2-3 are not
    _cache(manager, "plain", tokens)  # blocks 0-1 cached already: 2-3 are new
    assert chunks.held() == {doc_hash(tokens[0:8]), doc_hash(tokens[8:16])}
    manager.evict(64)
    assert chunks.held() == set() and len(chunks) == 0


# ---- state machine: RouterChunks against a brute-force model ------------------------------------
class ChunksMachine(RuleBasedStateMachine):
    """A prefix-closed block tree (what the manager keeps) and the events it emits; some may be
    lost on the way, as a full queue loses them."""

    @initialize(block_size=st.integers(1, 5), chunk_size=st.integers(1, 7),
                max_chunks=st.integers(1, 6))
    def setup(self, block_size, chunk_size, max_chunks):
        self.block_size, self.chunk_size, self.max_chunks = block_size, chunk_size, max_chunks
        self.chunks = RouterChunks(chunk_size, max_chunks)
        self.blocks: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}  # hash -> parent, ids
        self.is_lossy = False  # an event was lost at some point
        self.is_dirty = False  # a removal was lost since the last retain
        self.last_held: set[int] = set()

    def _sequence(self, block_hash: bytes | None) -> list[int]:
        ids: list[int] = []
        while block_hash is not None:
            parent, tokens = self.blocks[block_hash]
            ids[:0] = tokens
            block_hash = parent
        return ids

    def expected(self) -> set[int]:
        held = set()
        for block_hash in self.blocks:
            ids = self._sequence(block_hash)
            for j in range(min(len(ids) // self.chunk_size, self.max_chunks)):
                held.add(doc_hash(ids[j * self.chunk_size : (j + 1) * self.chunk_size]))
        return held

    def _leaves(self) -> list[bytes]:
        parents = {parent for parent, _ in self.blocks.values()}
        return sorted(h for h in self.blocks if h not in parents)

    @rule(data=st.data(), num_blocks=st.integers(1, 3), lose=st.booleans())
    def store(self, data, num_blocks, lose):
        parent = data.draw(st.sampled_from([None, *sorted(self.blocks)]))
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=num_blocks * self.block_size,
                                    max_size=num_blocks * self.block_size))
        hashes, at = [], parent
        for i in range(num_blocks):
            ids = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hashlib.sha256(repr((at, ids)).encode()).digest()[:8]
            if block_hash in self.blocks:  # the manager caches a block once
                break
            self.blocks[block_hash] = (at, ids)
            hashes.append(block_hash)
            at = block_hash
        if not hashes:
            return
        event = _stored(hashes, parent, tokens[: len(hashes) * self.block_size], self.block_size)
        if lose and data.draw(st.integers(0, 9)) == 0:
            self.is_lossy = True
        else:
            self.chunks.apply(event)

    @precondition(lambda self: self.blocks)
    @rule(data=st.data(), lose=st.booleans())
    def evict_tail(self, data, lose):
        leaf = data.draw(st.sampled_from(self._leaves()))
        del self.blocks[leaf]
        if lose and data.draw(st.integers(0, 9)) == 0:
            self.is_lossy = self.is_dirty = True
        else:
            self.chunks.apply(BlockRemoved((leaf,), (0,)))

    @rule()
    def clear(self):
        self.blocks.clear()
        self.chunks.apply(AllCleared())

    @rule()
    def retain(self):
        self.chunks.retain(set(self.blocks))
        self.is_dirty = False

    @invariant()
    def held_chunks_match_the_model(self):
        held, expected = self.chunks.held(), self.expected()
        if not self.is_lossy:
            assert held == expected
        elif not self.is_dirty:
            assert held <= expected  # a lost store costs a claim, never makes a false one
        assert all(count > 0 for count in self.chunks.ref_counts.values())

    @invariant()
    def changes_are_reported(self):
        held = self.chunks.held()
        assert held ^ self.last_held <= self.chunks.take_changed()
        self.last_held = held


TestChunksMachine = ChunksMachine.TestCase
TestChunksMachine.settings = settings(stateful_step_count=30)


# ---- flags -----------------------------------------------------------------------------------------
def _kv_events(*argv: str):  # noqa: ANN202 - KVEventsConfig | None
    """What ``kthena serve ARGV --served-model-name m`` publishes with (ServeSpec.resolve)."""
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    add_kv_events_args(parser)
    parser.add_argument("--mode")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false")
    flags = vars(parser.parse_args(list(argv)))
    return ServeSpec.resolve({**flags, "served_model_name": "m"}).kv_events


def test_flags_build_the_config():
    assert _kv_events() is None
    config = _kv_events("--kv-events", "redis://10.0.0.7:6379", "--pod-name",
                        "vllm-0.abc.kthena", "--kv-events-chunk-size", "32")
    assert (config.redis_url, config.pod, config.model, config.chunk_size, config.max_chunks) \
        == ("redis://10.0.0.7:6379", "vllm-0.abc.kthena", "m", 32, 128)


@pytest.mark.parametrize(("argv", "message"), [
    (("--kv-events", "http://h:1", "--pod-name", "p.ns"), "--kv-events: "),
    (("--kv-events", "redis://h", "--pod-name", "p.ns"), "needs a host and a port"),
    (("--kv-events", "redis://:6379", "--pod-name", "p.ns"), "needs a host and a port"),
    (("--kv-events", "redis://h:1"), "needs --pod-name"),
    (("--kv-events", "redis://h:1", "--pod-name", "pod"), "--pod-name: "),
    (("--kv-events", "redis://h:1", "--pod-name", "Pod.ns"), "not NAME.NAMESPACE"),
    (("--kv-events", "redis://h:1", "--pod-name", "p.n_s"), "not NAME.NAMESPACE"),
    (("--kv-events", "redis://h:1", "--pod-name", "p.ns", "--kv-events-chunk-size", "0"),
     "--kv-events-chunk-size: "),
    (("--pod-name", "p.ns"), "only with --kv-events"),
    (("--kv-events-max-chunks", "7"), "only with --kv-events"),
    # PD: each worker announces as NAME-WORKER.NAMESPACE, which must still be a pod name
    (("--kv-events", "redis://h:1", "--pod-name", "p" * 250 + ".ns", "--mode", "pd"),
     "--pod-name: .*-prefill-0.ns"),
    (("--kv-events", "redis://h:1", "--pod-name", "p.ns", "--no-prefix-caching"),
     "--no-prefix-caching"),
])
def test_flags_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as info:
        _kv_events(*argv)
    assert str(info.value).startswith("--")


def test_pd_workers_each_get_their_own_owner_name():
    config = _kv_events("--kv-events", "redis://h:1", "--pod-name", "kthena-0.serving",
                        "--mode", "pd")
    from kthena_serve.cluster.config import worker_names

    owners = [config.for_worker(name).pod for name in worker_names(1, 2)]
    assert owners == ["kthena-0-prefill-0.serving", "kthena-0-decode-0.serving",
                      "kthena-0-decode-1.serving"]
    assert {config.for_worker("decode-1").model} == {"m"}


def test_password_is_not_echoed():
    with pytest.raises(ValueError) as info:
        _kv_events("--kv-events", "rediss://u:hunter2@h:1", "--pod-name", "p.ns")
    assert "hunter2" not in str(info.value) and "***" in str(info.value)
