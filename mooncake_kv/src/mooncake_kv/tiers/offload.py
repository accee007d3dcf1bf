"""Offload coordinator: evicted blocks go down to the tiers, and come back on a later match.

    pool (KVCacheManager's blocks) ──BlockRemoved──▶ tier 0 (host) ──LRU out──▶ tier 1 (store)
          ▲                                              │                        │
          └──── match_prefix: after the pool's own hit, the following block hashes
                are looked up tier by tier; hits are copied into blocks allocated
                with try_allocate and committed, so they are matchable again

* Offload runs inside the manager's `BlockRemoved` delivery, which happens before the
  evicted block is handed to its new owner, so the bytes read are still the old block's.
* Every value is a self-checking frame (see `tiers.base`): a value that is stale, foreign
  or damaged is a miss. A tier that raises (store unreachable, ...) is logged once as a
  warning and then skipped for `retry_after_s` (a dead Mooncake master costs seconds per
  call), its blocks recomputed instead: never wrong KV. After the pause it is tried again.
* Restored blocks are ordinary blocks of the request: the scheduler continues with
  `try_allocate` for the rest of the prompt from the returned `num_cached_tokens`.

Runs on the manager's owner thread, like the verbs it wraps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from mooncake_kv.events import BlockRemoved, KVEvent
from mooncake_kv.hashing import ExtraKeys
from mooncake_kv.layout import KVLayout
from mooncake_kv.results import PrefixMatch
from mooncake_kv.tiers.base import (
    CorruptBlockError,
    KVTier,
    TierConfig,
    TierError,
    frame_block,
    open_tier,
    unframe_block,
)
from mooncake_kv.types import BlockHash, BlockId

if TYPE_CHECKING:
    from mooncake_kv.manager import KVCacheManager

__all__ = ["BlockStorage", "OffloadStats", "TierStats", "TieredKVCache"]

_log = logging.getLogger(__name__)


class BlockStorage(Protocol):
    """Where the manager's blocks live (`KVPool` is one): whole-block bytes in and out."""

    @property
    def layout(self) -> KVLayout: ...

    def read_block(self, block_id: BlockId) -> bytes: ...

    def write_block(self, block_id: BlockId, payload: bytes) -> None: ...


@attrs.frozen
class TierStats:
    """Counters of one tier. Lookups count only those that reached this tier."""

    name: str
    num_lookups: int
    num_hits: int
    num_stores: int
    num_demoted: int
    num_errors: int
    num_corrupt: int
    num_skipped: int

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0


@attrs.frozen
class OffloadStats:
    """Snapshot of a `TieredKVCache`.

    Attributes:
        tiers: per-tier counters, fastest tier first.
        num_offloaded_blocks: evicted blocks copied out of the pool towards tier 0.
        num_restored_blocks: blocks copied back into the pool and committed.
    """

    tiers: tuple[TierStats, ...]
    num_offloaded_blocks: int
    num_restored_blocks: int

    @property
    def hit_rate(self) -> float:
        """Restored blocks / blocks looked up below the pool (0.0 before any lookup)."""
        lookups = self.tiers[0].num_lookups if self.tiers else 0
        return self.num_restored_blocks / lookups if lookups else 0.0


class _Counters:
    __slots__ = ("corrupt", "demoted", "errors", "hits", "lookups", "skipped", "stores")

    def __init__(self) -> None:
        self.lookups = self.hits = self.stores = self.demoted = 0
        self.errors = self.corrupt = self.skipped = 0


class TieredKVCache:
    """Moves evicted blocks of `manager` (bytes in `pool`) through `tiers`, fastest first.

    Args:
        manager: the KV cache manager; this object subscribes to its events.
        pool: the block bytes (shape fingerprint names the keys).
        tiers: opened tiers, fastest first; may be empty (then nothing is offloaded).
        retry_after_s: how long a tier that raised is skipped before it is tried again.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        pool: BlockStorage,
        tiers: Sequence[KVTier],
        *,
        retry_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.tiers = tuple(tiers)
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._fingerprint = pool.layout.shape.fingerprint()
        self._counters = [_Counters() for _ in self.tiers]
        self._down_until: dict[int, float] = {}  # level -> when to try a failed tier again
        self._num_offloaded = self._num_restored = 0
        manager.subscribe(self.on_event)

    @classmethod
    def open(
        cls,
        manager: KVCacheManager,
        pool: BlockStorage,
        configs: Sequence[TierConfig],
        **options: object,
    ) -> TieredKVCache:
        """Open each configured tier; one that cannot be opened is left out with a warning.

        `options` are passed on to the constructor (retry_after_s, clock).
        """
        tiers = []
        for config in configs:
            try:
                tiers.append(open_tier(config))
            except TierError as exc:
                _log.warning("KV tier %s left out, its blocks will be recomputed: %s",
                             getattr(config, "name", config.kind), exc)
        return cls(manager, pool, tiers, **options)

    # ---- offload -------------------------------------------------------------------------
    def on_event(self, event: KVEvent) -> None:
        """Manager event callback: offload the blocks of every `BlockRemoved`."""
        if isinstance(event, BlockRemoved) and self.tiers:
            for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                self.offload(block_hash, block_id)

    def offload(self, block_hash: BlockHash, block_id: BlockId) -> None:
        """Copy one block (still holding `block_hash`'s KV) into the first tier."""
        if self._is_paused(0):
            self._counters[0].skipped += 1
            return  # do not even copy the block out while the tier is down
        key = self._key(block_hash)
        if self._call(0, "contains", key):
            return  # already below: the pool copy came from there, or was offloaded before
        value = frame_block(key, self._fingerprint, self.pool.read_block(block_id))
        self._store(0, [(key, value)])
        self._num_offloaded += 1

    def _store(self, level: int, entries: list[tuple[str, bytes]]) -> None:
        """Put entries into tier `level`; what it pushes out goes one tier down."""
        if level >= len(self.tiers):
            return
        pushed: list[tuple[str, bytes]] = []
        for key, value in entries:
            evicted = self._call(level, "put", key, value)
            if evicted is None:
                continue
            refused = any(old_key == key for old_key, _ in evicted)
            self._counters[level].stores += not refused
            self._counters[level].demoted += len(evicted) - refused
            pushed += evicted
        if pushed:
            self._store(level + 1, pushed)

    # ---- restore -------------------------------------------------------------------------
    def match_prefix(
        self, request_id: str, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None,
        *, lookup: bool = True,
    ) -> PrefixMatch:
        """`manager.match_prefix`, extended with blocks restored from the tiers (none restored
        with ``lookup=False``: the prompt is computed in full).

        Restored blocks are allocated for the request with `try_allocate`, filled, and
        committed; the result counts them in `block_ids` and `num_cached_tokens` exactly as
        if the pool had still held them. Too few free blocks or tier misses just mean fewer
        restored blocks (the rest is computed).

        Raises:
            The manager's errors for `match_prefix` (e.g. DuplicateRequestError).
        """
        match = self.manager.match_prefix(request_id, token_ids, extra_keys, lookup=lookup)
        if not lookup:
            return match
        size = self.manager.block_size
        limit = (len(token_ids) - 1) // size  # at least one token is always computed
        start = match.num_cached_blocks
        if not self.tiers or start >= limit:
            return match
        hashes = self.manager.hasher.hash_tokens(token_ids[: limit * size], extra_keys)
        wanted = hashes[start : start + self.manager.num_free_blocks]
        payloads = self._fetch_run(wanted)
        if not payloads:
            return match
        return self._restore(request_id, token_ids, extra_keys, match, payloads)

    def _fetch_run(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the leading blocks found in some tier; stops at the first miss."""
        payloads = []
        for block_hash in block_hashes:
            payload = self._lookup(self._key(block_hash))
            if payload is None:
                break
            payloads.append(payload)
        return payloads

    def _lookup(self, key: str) -> bytes | None:
        for level in range(len(self.tiers)):
            counters = self._counters[level]
            counters.lookups += 1
            blob = self._call(level, "get", key)
            if blob is None:
                continue
            try:
                payload = unframe_block(key, self._fingerprint, blob)
            except CorruptBlockError as exc:
                counters.corrupt += 1
                _log.warning("KV tier %s returned a bad value, recomputing: %s",
                             self.tiers[level].name, exc)
                self._call(level, "remove", key)
                continue
            counters.hits += 1
            return payload
        return None

    def _restore(
        self,
        request_id: str,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None,
        match: PrefixMatch,
        payloads: list[bytes],
    ) -> PrefixMatch:
        size = self.manager.block_size
        blocks = self.manager.try_allocate(request_id, len(payloads) * size)
        if blocks is None:
            return match
        try:
            for block_id, payload in zip(blocks.new_block_ids, payloads, strict=True):
                self.pool.write_block(block_id, payload)
        except Exception:
            # never leave half-written blocks counted as cached: start the request afresh
            _log.exception("writing restored KV blocks failed; recomputing them")
            self.manager.free(request_id)
            return self.manager.match_prefix(request_id, token_ids, extra_keys)
        num_cached = match.num_cached_tokens + len(payloads) * size
        self.manager.commit(request_id, token_ids[:num_cached])
        self._num_restored += len(payloads)
        return PrefixMatch(blocks.block_ids, num_cached)

    # ---- tier calls, stats, lifetime -------------------------------------------------------
    def _call(self, level: int, op: str, *args: object):
        """Run a tier op. A raising tier counts an error, warns once, reads as a miss, and
        is skipped (None) until `retry_after_s` has passed."""
        tier, counters = self.tiers[level], self._counters[level]
        if self._is_paused(level):
            counters.skipped += 1
            return None
        was_down = level in self._down_until
        try:
            result = getattr(tier, op)(*args)
        except Exception as exc:
            counters.errors += 1
            self._down_until[level] = self._clock() + self.retry_after_s
            if not was_down:
                _log.warning("KV tier %s failed on %s (%s); skipping it for %.0f s, its blocks "
                             "are recomputed", tier.name, op, exc, self.retry_after_s)
            return None
        if was_down:
            del self._down_until[level]
            _log.warning("KV tier %s works again", tier.name)
        return result

    def _is_paused(self, level: int) -> bool:
        return level in self._down_until and self._clock() < self._down_until[level]

    def _key(self, block_hash: BlockHash) -> str:
        return f"{self._fingerprint}/{block_hash.hex()}"

    def stats(self) -> OffloadStats:
        tiers = tuple(
            TierStats(tier.name, c.lookups, c.hits, c.stores, c.demoted, c.errors, c.corrupt,
                      c.skipped)
            for tier, c in zip(self.tiers, self._counters, strict=True)
        )
        return OffloadStats(tiers, self._num_offloaded, self._num_restored)

    def close(self) -> None:
        """Stop following the manager and close every tier. Safe to repeat."""
        try:
            self.manager.unsubscribe(self.on_event)
        except ValueError:
            pass  # closed before
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
