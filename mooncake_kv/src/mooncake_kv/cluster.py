"""Cluster prefix index: which instance holds how much of a prompt, from their KV events.

Each serving instance's ``KVCacheManager`` announces ``BlockStored`` / ``BlockRemoved`` /
``AllCleared``; the cluster index applies them per instance and answers, for a token
sequence, how many *leading* full blocks each instance holds — the input to cache-aware
routing (Mooncake's Conductor, Kthena's kvcache-aware router)::

    hashes of the prompt:  h0   h1   h2   h3
    instance a holds:      h0   h1   h2   --      -> a: 3
    instance b holds:      h0   --   h2   h3      -> b: 1   (a gap ends the prefix)

It keys on the same stable block hashes as the instances, so it must use the same block
size and hash algorithm, and the same ``ExtraKeys`` (salt, adapter) as the request.
It is thread-safe: events may be applied from one thread while others match.

Bounded: an entry (one instance holding one block) leaves when the instance announces its
eviction (``BlockRemoved``, ``AllCleared``), and at most ``max_entries`` are kept: past that
the least recently stored or matched entry goes first. A router that records blocks before
an instance confirms them (or whose hashes an instance never stores) cannot grow it without
end. Within a stored or matched chain the head counts as the most recent, so the tail of a
prefix is dropped before its head (a dropped head would hide the whole chain)::

    recency, oldest first:  b:h7  a:h3  a:h2  a:h1  a:h0   (a matched h0..h3 last)
    one entry over the bound -> b:h7 goes; a keeps its prefix of 4
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from mooncake_kv.events import AllCleared, BlockRemoved, BlockStored, KVEvent
from mooncake_kv.hashing import DEFAULT_HASH_ALGO, BlockHasher, ExtraKeys
from mooncake_kv.types import BlockHash, InstanceId, UnknownInstanceError

__all__ = ["DEFAULT_MAX_ENTRIES", "ClusterPrefixIndex"]

# (instance, block) entries kept at most: 2**18, e.g. 4 instances x 65,536 blocks (1M tokens
# each at 16 tokens a block). Full, with no block shared, it held 124 MiB (tracemalloc, 32-byte
# hashes included).
DEFAULT_MAX_ENTRIES = 1 << 18


class ClusterPrefixIndex:
    """Block hash -> instances holding it, kept up to date from KV events, bounded.

    Args:
        block_size: tokens per block, as on every instance.
        hash_algo: hash algorithm, as on every instance.
        max_entries: (instance, block) entries kept at most; past it the least recently
            stored or matched go (see the module docs).

    Raises:
        ValueError: ``max_entries`` below 1.
    """

    def __init__(self, block_size: int, hash_algo: str = DEFAULT_HASH_ALGO, *,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._hasher = BlockHasher(block_size, hash_algo)
        self._holders: dict[BlockHash, set[InstanceId]] = {}
        self._held: dict[InstanceId, set[BlockHash]] = {}
        self._recency: OrderedDict[tuple[InstanceId, BlockHash], None] = OrderedDict()
        self._max_entries = max_entries
        self._num_dropped = 0
        self._lock = threading.Lock()

    @property
    def max_entries(self) -> int:
        return self._max_entries

    @property
    def num_entries(self) -> int:
        """(instance, block) entries held now (at most ``max_entries``)."""
        with self._lock:
            return len(self._recency)

    @property
    def num_dropped(self) -> int:
        """Entries dropped so far for the bound (not announced evictions)."""
        with self._lock:
            return self._num_dropped

    @property
    def hasher(self) -> BlockHasher:
        return self._hasher

    def instances(self) -> tuple[InstanceId, ...]:
        """Known instances, sorted."""
        with self._lock:
            return tuple(sorted(self._held))

    def num_blocks(self, instance_id: InstanceId) -> int:
        """How many cached blocks ``instance_id`` announced and still holds."""
        with self._lock:
            return len(self._held_by(instance_id))

    def add_instance(self, instance_id: InstanceId) -> None:
        """Know an instance before its first event (it then matches 0 blocks)."""
        with self._lock:
            self._held.setdefault(instance_id, set())

    def subscriber(self, instance_id: InstanceId) -> Callable[[KVEvent], None]:
        """A callback to pass to ``KVCacheManager.subscribe`` for that instance."""
        self.add_instance(instance_id)
        return lambda event: self.apply(instance_id, event)

    def apply(self, instance_id: InstanceId, event: KVEvent) -> None:
        """Apply one event from ``instance_id`` (registering the instance if new).

        Raises:
            ValueError: a ``BlockStored`` with another block size.
            TypeError: not a KV event.
        """
        with self._lock:
            held = self._held.setdefault(instance_id, set())
            if isinstance(event, BlockStored):
                self._store(instance_id, held, event)
            elif isinstance(event, BlockRemoved):
                self._drop(instance_id, held, event.block_hashes)
            elif isinstance(event, AllCleared):
                self._drop(instance_id, held, list(held))
            else:
                raise TypeError(f"expected BlockStored, BlockRemoved or AllCleared, got {event!r}")

    def apply_all(self, instance_id: InstanceId, events: Iterable[KVEvent]) -> None:
        """Apply events in order (e.g. ``EventQueue.drain()``)."""
        for event in events:
            self.apply(instance_id, event)

    def remove_instance(self, instance_id: InstanceId) -> None:
        """Forget an instance and everything it held (it left or restarted).

        Raises:
            UnknownInstanceError: the instance is not known.
        """
        with self._lock:
            held = self._held_by(instance_id)
            self._drop(instance_id, held, list(held))
            del self._held[instance_id]

    def match(
        self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> dict[InstanceId, int]:
        """Leading full blocks of ``token_ids`` held by each known instance (0 if none)."""
        return self.match_hashes(self._hasher.hash_tokens(token_ids, extra_keys))

    def match_hashes(self, block_hashes: Sequence[BlockHash]) -> dict[InstanceId, int]:
        """Like ``match`` for precomputed block hashes."""
        with self._lock:
            counts = dict.fromkeys(self._held, 0)
            alive = set(self._held)
            for depth, block_hash in enumerate(block_hashes, 1):
                alive &= self._holders.get(block_hash, set())
                if not alive:
                    break
                for instance_id in alive:
                    counts[instance_id] = depth
            for instance_id in sorted(counts):  # ties between instances: by name
                self._touch(instance_id, block_hashes[:counts[instance_id]])
            return counts

    # ---- internals (lock held) ---------------------------------------------------------
    def _held_by(self, instance_id: InstanceId) -> set[BlockHash]:
        try:
            return self._held[instance_id]
        except KeyError:
            known = ", ".join(sorted(self._held)) or "none"
            raise UnknownInstanceError(
                f"unknown instance {instance_id!r}; known instances: {known}"
            ) from None

    def _store(self, instance_id: InstanceId, held: set[BlockHash], event: BlockStored) -> None:
        if event.block_size != self._hasher.block_size:
            raise ValueError(
                f"instance {instance_id!r} stores blocks of {event.block_size} tokens; "
                f"this index uses {self._hasher.block_size}"
            )
        for block_hash in event.block_hashes:
            self._holders.setdefault(block_hash, set()).add(instance_id)
            held.add(block_hash)
        self._touch(instance_id, event.block_hashes)
        while len(self._recency) > self._max_entries:
            (oldest_id, oldest_hash), _ = self._recency.popitem(last=False)
            self._drop(oldest_id, self._held[oldest_id], (oldest_hash,))
            self._num_dropped += 1

    def _touch(self, instance_id: InstanceId, chain: Sequence[BlockHash]) -> None:
        """Make ``chain``'s entries the most recent, its head last (dropped last)."""
        for block_hash in reversed(chain):
            key = (instance_id, block_hash)
            self._recency[key] = None
            self._recency.move_to_end(key)

    def _drop(
        self, instance_id: InstanceId, held: set[BlockHash], block_hashes: Iterable[BlockHash]
    ) -> None:
        for block_hash in block_hashes:
            held.discard(block_hash)
            self._recency.pop((instance_id, block_hash), None)
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(instance_id)
                if not holders:
                    del self._holders[block_hash]
