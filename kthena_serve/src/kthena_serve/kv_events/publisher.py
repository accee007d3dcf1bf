"""RedisKVPublisher: the KV cache's router chunks written to Redis, off the engine thread.

::

    engine thread                      publisher thread ("kthena-kv-events")
    KV manager verb ── event ──▶ bounded queue ──▶ RouterChunks (which chunks are held)
                     (full: drop + count)             │ changed chunk hashes
                                                      ▼
                                Redis pipeline: HSET key pod <unix s> + EXPIRE key 24 h
                                                HDEL key pod          (batch_size per trip)

The engine never waits: the subscriber only does ``put_nowait``. The publisher thread folds
events into ``RouterChunks`` and writes what changed since its last round trip. When Redis
fails (refused, timed out, gone), the error is counted, the thread keeps folding events in
and retries with a doubling backoff (0.1 s up to ``max_backoff_s``); after a failure it
resyncs (writes every held chunk, removes every other field it may have written), which also
covers a Redis that restarted empty. Held fields are rewritten every ``refresh_s`` so the
router's 24 h GC keeps them. Dropped events make the publisher compare its blocks with the
manager's snapshot (a lost removal must not keep a claim). ``close`` removes every field it
wrote (one attempt; fields left behind age out, and the router ignores those written before
the pod's containers started) and closes the connection.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import attrs

from kthena_serve.kv_events.chunks import RouterChunks
from kthena_serve.kv_events.config import KVEventsConfig, redacted_url
from kthena_serve.kv_events.router_hash import FIELD_FRESH_SECONDS, ChunkHash, redis_key
from mooncake_kv import BlockHasher, CacheSnapshot, KVEvent
from mooncake_kv.events import KVEventCallback

__all__ = ["CLIENT_NAME", "KVEventSource", "KVEventsStats", "RedisKVPublisher", "import_redis"]

log = logging.getLogger(__name__)

CLIENT_NAME = "kthena-kv-events"  # CLIENT SETNAME of the publisher's connection
_FIRST_BACKOFF_S = 0.1
_TICK_S = 0.1  # longest wait for the first event of a batch (and for close)
_MAX_EVENTS_PER_TRIP = 8192
_RECONCILE_EVERY_S = 1.0  # after drops: at most one snapshot comparison per second


class KVEventSource(Protocol):
    """What the publisher needs of a KV cache manager (``mooncake_kv.KVCacheManager``)."""

    @property
    def hasher(self) -> BlockHasher: ...

    def subscribe(self, callback: KVEventCallback) -> None: ...

    def unsubscribe(self, callback: KVEventCallback) -> None: ...

    def snapshot(self) -> CacheSnapshot: ...


@attrs.frozen
class KVEventsStats:
    """The publisher's counters (``RedisKVPublisher.stats()``).

    Attributes:
        num_published_keys: fields written (HSET) for chunks that became held, or again
            after a Redis failure; the periodic timestamp refreshes are not counted.
        num_removed_keys: fields removed (HDEL), on eviction and at shutdown.
        num_dropped_events: KV events dropped because the queue was full.
        num_redis_errors: Redis round trips that failed (connect, timeout, reply error).
        num_held_chunks: chunk hashes the cache holds whole now.
    """

    num_published_keys: int
    num_removed_keys: int
    num_dropped_events: int
    num_redis_errors: int
    num_held_chunks: int


def import_redis() -> Any:
    """The ``redis`` module (redis-py), imported on first use.

    Raises:
        ImportError: it is not installed; the message names the extra that brings it.
    """
    try:
        import redis
        import redis.backoff
        import redis.retry
    except ImportError as error:
        raise ImportError(
            "publishing KV events (--kv-events) needs the Redis client redis-py: "
            "pip install 'kthena-serve[kv-events]' (or pip install redis)") from error
    return redis


class RedisKVPublisher:
    """Announces, in the Redis the Kthena router reads, which chunks the KV cache holds.

    Args:
        config: where to write, as whom, and the router's chunking.
        source: the KV cache manager whose events are published.

    Raises:
        ImportError: redis-py is missing (see ``import_redis``).
    """

    def __init__(self, config: KVEventsConfig, source: KVEventSource) -> None:
        redis = import_redis()
        self.config = config
        self._source = source
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            config.redis_url, socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.socket_timeout_s, client_name=CLIENT_NAME,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))  # our loop retries
        self._queue: queue.Queue[KVEvent] = queue.Queue(config.queue_size)
        self._chunks = RouterChunks(config.chunk_size, config.max_chunks, source.hasher)
        self._published: set[ChunkHash] = set()  # fields we may have written (a superset)
        self._thread = threading.Thread(target=self._run, name=CLIENT_NAME, daemon=True)
        self._stop = threading.Event()
        self._is_lost = False  # events were dropped: compare with a snapshot
        self._needs_resync = False
        self._is_down = False
        self._backoff_s = _FIRST_BACKOFF_S
        self._retry_at = self._reconcile_at = 0.0
        self._refresh_at = time.monotonic() + config.refresh_s
        self._num_enqueued = self._num_applied = self._num_synced = 0
        self._num_published = self._num_removed = self._num_dropped = self._num_errors = 0
        self._is_started = self._is_closed = False

    # ---- lifetime -----------------------------------------------------------------------------
    def start(self) -> RedisKVPublisher:
        """Subscribe to the KV events and start the publisher thread (once)."""
        if not self._is_started:
            self._is_started = True
            self._source.subscribe(self._on_event)
            self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Unsubscribe, remove every field written, close the connection, join the thread.

        Bounded: one removal attempt of ``socket_timeout_s`` per batch at most, stopping at
        the first failure; the thread is joined for up to ``timeout`` seconds.
        """
        if self._is_closed:
            return
        self._is_closed = True
        if not self._is_started:
            self._client.close()
            return
        self._source.unsubscribe(self._on_event)
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kv events: the publisher thread did not stop within %g s", timeout)

    def __enter__(self) -> RedisKVPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- any thread ---------------------------------------------------------------------------
    def stats(self) -> KVEventsStats:
        return KVEventsStats(self._num_published, self._num_removed, self._num_dropped,
                             self._num_errors, len(self._chunks.ref_counts))

    def held_chunks(self) -> set[ChunkHash]:
        """The chunk hashes the cache holds whole, as the publisher last saw them."""
        return set(dict.copy(self._chunks.ref_counts))  # one C call: safe while it changes

    def wait_synced(self, timeout: float = 10.0) -> bool:
        """Wait until every event queued so far is written to Redis; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            target = self._num_enqueued
            if self._num_synced >= target and not self._needs_resync and self._queue.empty():
                return True
            time.sleep(0.01)
        return False

    # ---- engine thread: never blocks ----------------------------------------------------------
    def _on_event(self, event: KVEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._num_dropped += 1
            self._is_lost = True
            return
        self._num_enqueued += 1

    # ---- publisher thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._absorb()
                if self._is_lost and time.monotonic() >= self._reconcile_at:
                    self._reconcile()
                if time.monotonic() >= self._retry_at:
                    self._flush()
            self._retract()
        except Exception:  # noqa: BLE001 - a publisher bug must not take the server down
            log.exception("kv events: the publisher thread failed; nothing more is published")
        finally:
            self._client.close()

    def _absorb(self) -> None:
        """Fold queued events into the chunk view (waits up to a tick for the first)."""
        try:
            event = self._queue.get(timeout=_TICK_S)
        except queue.Empty:
            return
        for _ in range(_MAX_EVENTS_PER_TRIP):
            self._chunks.apply(event)
            self._num_applied += 1
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return
        self._chunks.apply(event)
        self._num_applied += 1

    def _reconcile(self) -> None:
        """After drops: forget blocks the manager no longer caches (a lost BlockRemoved)."""
        self._is_lost = False
        self._reconcile_at = time.monotonic() + _RECONCILE_EVERY_S
        cached = {block_hash for block_hash, _ in self._source.snapshot().cached}
        num_gone = self._chunks.retain(cached)
        if num_gone:
            log.info("kv events: %d blocks whose removal was dropped are forgotten", num_gone)

    def _flush(self) -> None:
        """Write what changed (everything after a failure; every held field when due)."""
        applied = self._num_applied
        changed = self._chunks.take_changed()
        held = self._chunks.ref_counts
        if self._needs_resync:
            new = set(held)
            gone = self._published - new
        else:
            new = {c for c in changed if c in held and c not in self._published}
            gone = {c for c in changed if c not in held and c in self._published}
        is_refresh = time.monotonic() >= self._refresh_at
        again = set(held) - new if is_refresh else set()
        if new or gone or again:
            self._published |= new  # before writing: a failed trip may have landed
            try:
                self._write(new | again, gone)
            except self._errors as error:
                self._failed(error)
                return
            self._published -= gone
            self._num_published += len(new)
            self._num_removed += len(gone)
            self._recovered()
        if is_refresh:
            self._refresh_at = time.monotonic() + self.config.refresh_s
        self._needs_resync = False  # written, or nothing of ours can be in Redis
        self._num_synced = applied

    def _write(self, new: Iterable[ChunkHash], gone: Iterable[ChunkHash]) -> None:
        now = str(int(time.time()))
        pod, model = self.config.pod, self.config.model
        commands = [("set", c) for c in new] + [("del", c) for c in gone]
        for batch in _batches(commands, self.config.batch_size):
            pipe = self._client.pipeline(transaction=False)
            for verb, chunk in batch:
                key = redis_key(model, chunk)
                if verb == "set":
                    pipe.hset(key, pod, now)
                    pipe.expire(key, FIELD_FRESH_SECONDS)
                else:
                    pipe.hdel(key, pod)
            pipe.execute()

    def _retract(self) -> None:
        """At shutdown: remove every field written (one attempt)."""
        if not self._published:
            return
        try:
            self._write((), self._published)
        except self._errors as error:
            self._num_errors += 1
            log.warning("kv events: could not remove %d fields of %s from %s at shutdown (%s); "
                        "the router ignores them once this pod restarts, and drops them after "
                        "24 h", len(self._published), self.config.pod,
                        redacted_url(self.config.redis_url), error)
            return
        self._num_removed += len(self._published)
        self._published.clear()

    def _failed(self, error: BaseException) -> None:
        self._num_errors += 1
        self._needs_resync = True
        if not self._is_down:
            self._is_down = True
            log.warning("kv events: Redis %s failed (%s); serving goes on, retrying with "
                        "backoff", redacted_url(self.config.redis_url), error)
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, self.config.max_backoff_s)

    def _recovered(self) -> None:
        self._backoff_s = _FIRST_BACKOFF_S
        if self._is_down:
            self._is_down = False
            log.warning("kv events: Redis %s is back; fields resynced",
                        redacted_url(self.config.redis_url))


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
