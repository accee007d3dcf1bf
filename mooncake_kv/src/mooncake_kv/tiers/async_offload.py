"""Asynchronous offload and promotion: block bytes move between the pool and the tiers on
background threads, so the manager's owner thread (the engine step) never waits on a tier.

    owner thread                          copier thread                promoter thread
    ────────────                          ─────────────                ───────────────
    commit ─BlockStored─▶ queue (bounded) ─▶ read block ─▶ tier 0 (host) ─LRU out─▶ tier 1..
              (full: dropped, counted)        (seqlock)       ▲                     (store)
    evict ──BlockRemoved─▶ epoch[block] += 1                  │                        │
    admit ──start_promotion(hashes, new blocks) ─────────────▶ look up key by key, tier by tier,
    poll  ◀── PromotionJob.num_promoted ◀─────────────────── write each hit into its block

* Offload is write-through at commit, as vLLM's CPU offloading connector stores a block once
  it is full: the owner thread only enqueues (block id, hash, epoch). The copier reads the
  block straight from the pool, without a staging copy on the owner thread, and a seqlock keeps
  that safe: eviction bumps the block's epoch *before* the manager hands the block to a new
  owner, and the copier compares the epoch before and after its read, so a read that raced a
  reuse is thrown away (counted in ``num_dropped_evicted``). A full queue drops the offload
  (``num_dropped_full``); the block is then recomputed if it is needed after eviction.
* A key that tier 0 pushes out goes one tier down (a spill), and the copier skips a key that
  some tier holds already (asking a lower tier costs a round trip, on the copier thread): each
  block lives in one tier of this engine, and one promoted from the store stays there. With
  ``write_through`` every offload also goes to tier 1 at once (tier 0 then caches a subset of
  it, and what tier 0 pushes out is simply dropped): a shared store sees a block as soon as it
  is computed.
* Promotion: the caller allocated blocks for the hashes after its pool hit; the promoter
  fetches them in chain order, stopping at the first miss, and writes each into its block.
  ``num_promoted`` only ever counts whole blocks already written, so a caller that gives up
  (``cancel``) keeps those and recomputes the rest. A tier that raises (a dead Mooncake
  master) is a miss, warned about once and skipped for ``retry_after_s``: never wrong KV.
* Every value is a self-checking frame (``tiers.base``): a foreign or damaged value is a miss.
* Keys this offloader put into a lower tier (the store) are remembered (the newest
  ``MAX_REMEMBERED_KEYS``) and removed from it at ``close``: a store shared by a deployment
  keeps nothing of a process that has gone (older keys are left to the store's own eviction).
  A paused tier (its master does not answer) is not asked.

Threading: ``on_event``, ``start_promotion`` and ``PromotionJob.cancel`` run on the manager's
owner thread; ``stats``/``snapshot`` on any thread. The tiers are only touched under one lock
(tier 0) or from the background threads (lower tiers), never from the owner thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from mooncake_kv.events import AllCleared, BlockRemoved, BlockStored, KVEvent
from mooncake_kv.tiers.base import CorruptBlockError, KVTier, frame_block, unframe_block
from mooncake_kv.types import BlockHash, BlockId

if TYPE_CHECKING:
    from mooncake_kv.manager import KVCacheManager
    from mooncake_kv.tiers.offload import BlockStorage

__all__ = ["AsyncOffloader", "OffloadSnapshot", "PromotionJob", "TierCounters"]

_log = logging.getLogger(__name__)
_STOP = object()
MAX_REMEMBERED_KEYS = 1 << 20  # lower-tier keys removed at close, newest first kept


@attrs.frozen
class TierCounters:
    """Counters of one tier since start.

    Attributes:
        name: the tier's name (``host``, ``mooncake_store``).
        num_hits: promotion lookups this tier answered.
        num_misses: promotion lookups that reached this tier and missed.
        num_promoted_blocks: blocks copied from this tier into the pool.
        num_stored_blocks: blocks put into this tier (offloads or spills from above).
        num_bytes_in: framed bytes put into this tier.
        num_bytes_out: framed bytes read back from it for promotion.
        num_errors: calls that raised (the tier is skipped a while after each).
        num_corrupt: values that failed their frame check (dropped, recomputed).
        used_bytes: bytes the tier holds now, where it knows (the host tier); None for a tier
            shared with other processes (the store).
    """

    name: str
    num_hits: int = 0
    num_misses: int = 0
    num_promoted_blocks: int = 0
    num_stored_blocks: int = 0
    num_bytes_in: int = 0
    num_bytes_out: int = 0
    num_errors: int = 0
    num_corrupt: int = 0
    used_bytes: int | None = None


@attrs.frozen
class OffloadSnapshot:
    """A consistent view (for metrics and tests).

    Attributes:
        tiers: per-tier counters, fastest first.
        queue_depth: offloads waiting for the copier.
        num_enqueued: offloads accepted into the queue.
        num_offloaded: offloads that left the pool (into tier 0, or past it when larger).
        num_skipped: offloads of a key some tier already held.
        num_dropped_full: offloads dropped because the queue was full.
        num_dropped_evicted: offloads dropped because the block was reused before its copy.
        num_failed: offloads that failed (a read that raised).
        num_spilled_lost: keys pushed out of a tier that the tier below did not take (failed
            or paused).
        num_evicted: keys pushed out of the last tier (its LRU at work).
        in_flight: offloads taken by the copier and not finished.
        tier_keys: keys held by each tier that can list them, if asked (else None each).
    """

    tiers: tuple[TierCounters, ...]
    queue_depth: int
    num_enqueued: int
    num_offloaded: int
    num_skipped: int
    num_dropped_full: int
    num_dropped_evicted: int
    num_failed: int
    num_spilled_lost: int
    num_evicted: int
    in_flight: int
    tier_keys: tuple[frozenset[str] | None, ...] = ()

    @property
    def num_dropped(self) -> int:
        return self.num_dropped_full + self.num_dropped_evicted


class PromotionJob:
    """Blocks being filled from the tiers for one request (see module docs)."""

    def __init__(self, keys: Sequence[str], block_ids: Sequence[BlockId]) -> None:
        self.keys = tuple(keys)
        self.block_ids = tuple(block_ids)
        self.num_promoted = 0  # leading blocks written, only ever grows
        self.started = time.monotonic()
        self._lock = threading.Lock()  # held around each block write
        self._cancelled = False
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the job ends; False if ``timeout_s`` passed first."""
        return self._done.wait(timeout_s)

    def cancel(self) -> int:
        """Stop writing; returns the blocks written, which stay valid.

        Waits at most for one block write already under way (a memcpy), never for a tier.
        """
        with self._lock:
            self._cancelled = True
            return self.num_promoted


class AsyncOffloader:
    """Offloads committed blocks of ``manager`` to ``tiers`` and promotes them back.

    Args:
        manager: the KV cache manager; this object subscribes to its events.
        pool: the block bytes; its layout fingerprint goes into every key and frame.
        tiers: opened tiers, fastest first (e.g. host memory, then Mooncake Store).
        namespace: prefix of every key, e.g. the model's name and dtype, so caches of
            different models never answer each other.
        queue_depth: offloads waiting for the copier at most; more are dropped.
        write_through: put every offload into tier 1 too, at once (a shared store then sees
            blocks as soon as they are computed); default: only what tier 0 pushes out.
        retry_after_s: how long a tier that raised is skipped.
        clock: monotonic seconds.

    Raises:
        ValueError: no tier, or a queue depth below 1.
    """

    def __init__(self, manager: KVCacheManager, pool: BlockStorage, tiers: Sequence[KVTier], *,
                 namespace: str = "", queue_depth: int = 256, write_through: bool = False,
                 retry_after_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not tiers:
            raise ValueError("AsyncOffloader needs at least one tier (host memory first)")
        if not isinstance(queue_depth, int) or queue_depth < 1:
            raise ValueError(f"queue_depth must be an int >= 1, got {queue_depth!r}")
        self.manager, self.pool, self.tiers = manager, pool, tuple(tiers)
        fingerprint = pool.layout.shape.fingerprint()
        self._fingerprint = f"{namespace}|{fingerprint}" if namespace else fingerprint
        self._epochs = [0] * pool.layout.num_blocks
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._lock = threading.Lock()  # tier 0 and the counters
        self._tier_locks = [self._lock] + [threading.Lock() for _ in self.tiers[1:]]
        self._counts = dict.fromkeys(("enqueued", "offloaded", "skipped", "dropped_full",
                                      "dropped_evicted", "failed", "spilled_lost", "evicted"),
                                     0)
        counted = [n for n in attrs.fields_dict(TierCounters) if n not in ("name", "used_bytes")]
        self._tier_counts = [dict.fromkeys(counted, 0) for _ in self.tiers]
        # lower tiers: keys put there (insertion order = age), removed at close
        self._put_keys: list[dict[str, None]] = [{} for _ in self.tiers]
        self._down_until: dict[int, float] = {}
        self.retry_after_s, self._clock = retry_after_s, clock
        self.write_through = write_through
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._threads = [threading.Thread(target=self._copy_loop, name="kv-offload-copier",
                                          daemon=True),
                         threading.Thread(target=self._promote_loop, name="kv-promoter",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()
        manager.subscribe(self.on_event)

    # ---- owner thread ------------------------------------------------------------------------
    def key(self, block_hash: BlockHash) -> str:
        """The tier key of a block: namespace, pool fingerprint and the chain hash."""
        return f"{self._fingerprint}/{block_hash.hex()}"

    def on_event(self, event: KVEvent) -> None:
        """Manager callback: enqueue stored blocks; bump the epoch of evicted ones."""
        if isinstance(event, BlockStored):
            for block_hash, block_id in zip(event.block_hashes, event.block_ids, strict=True):
                self._enqueue(block_id, block_hash)
        elif isinstance(event, BlockRemoved):
            for block_id in event.block_ids:
                self._epochs[block_id] += 1
        elif isinstance(event, AllCleared):
            for block_id in range(len(self._epochs)):
                self._epochs[block_id] += 1

    def _enqueue(self, block_id: BlockId, block_hash: BlockHash) -> None:
        with self._lock:  # never blocks: the copier holds this lock only briefly
            try:
                self._queue.put_nowait((block_id, block_hash, self._epochs[block_id]))
            except queue.Full:
                self._counts["dropped_full"] += 1
                return
            self._counts["enqueued"] += 1

    def start_promotion(self, block_hashes: Sequence[BlockHash],
                        block_ids: Sequence[BlockId]) -> PromotionJob:
        """Fill ``block_ids`` (allocated by the caller) with the KV of ``block_hashes``.

        The caller must not free the blocks before the job is done or cancelled.
        """
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"{len(block_hashes)} hashes for {len(block_ids)} blocks; "
                             "give one block per hash")
        job = PromotionJob([self.key(h) for h in block_hashes], block_ids)
        if self._closed:
            job._done.set()
        else:
            self._jobs.put(job)
        return job

    def may_hold(self, block_hash: BlockHash) -> bool:
        """Whether a promotion of this block could succeed: tier 0 holds it, or a lower tier
        is configured and not paused (it can only be asked from a background thread)."""
        with self._lock:
            if self.tiers[0].contains(self.key(block_hash)):
                return True
        return any(not self._is_paused(level) for level in range(1, len(self.tiers)))

    # ---- copier thread -------------------------------------------------------------------------
    def _copy_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            outcome = "failed"
            try:
                outcome, pushed = self._copy(*item)
                self._spill(1, pushed)  # still in flight meanwhile: drain() waits for it
            except Exception:  # noqa: BLE001 - one bad copy must not stop the copier
                _log.exception("offloading a KV block failed; it will be recomputed if needed")
            finally:
                with self._lock:  # outcome and task_done together: snapshots add up
                    self._counts[outcome] += 1
                    self._queue.task_done()

    def _copy(self, block_id: BlockId, block_hash: BlockHash, epoch: int,
              ) -> tuple[str, list[tuple[str, bytes]]]:
        key = self.key(block_hash)
        with self._lock:
            if self.tiers[0].contains(key):
                return "skipped", []
        if any(not self._is_paused(level) and self._call(level, "contains", key)
               for level in range(1, len(self.tiers))):
            return "skipped", []  # e.g. promoted from the store: it stays there, in one tier
        if self._epochs[block_id] != epoch:
            return "dropped_evicted", []
        payload = self.pool.read_block(block_id)
        if self._epochs[block_id] != epoch:  # reused while we read: the bytes may be torn
            return "dropped_evicted", []
        value = frame_block(key, self._fingerprint, payload)
        with self._lock:
            pushed = self.tiers[0].put(key, value)  # a value larger than the tier comes back
            kept = not any(old == key for old, _ in pushed)
            if kept:
                self._add_locked(0, num_stored_blocks=1, num_bytes_in=len(value))
            if self.write_through and len(self.tiers) > 1:  # pushed-out keys are below already
                self._counts["evicted"] += len(pushed) - (not kept)
                pushed = [(key, value)]
        return "offloaded", pushed

    def _spill(self, level: int, entries: list[tuple[str, bytes]]) -> None:
        """Put what the tier above pushed out into tier ``level`` (lost past the last)."""
        for key, value in entries:
            if level >= len(self.tiers):
                self._count("evicted")
                continue
            if self._is_paused(level):
                self._count("spilled_lost")
                continue
            pushed = self._call(level, "put", key, value)
            if pushed is None:
                self._count("spilled_lost")
                continue
            self._remember(level, key)
            self._add(level, num_stored_blocks=1, num_bytes_in=len(value))
            self._spill(level + 1, pushed)

    # ---- promoter thread -----------------------------------------------------------------------
    def _promote_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                self._promote(job)
            except Exception:  # noqa: BLE001 - the request recomputes what was not written
                _log.exception("promoting KV blocks failed; recomputing them")
            finally:
                job._done.set()
                self._jobs.task_done()

    def _promote(self, job: PromotionJob) -> None:
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            if job._cancelled:
                return
            found = self._lookup(key)
            if found is None:
                return
            level, payload = found
            with job._lock:
                if job._cancelled:
                    return
                self.pool.write_block(block_id, payload)
                job.num_promoted += 1
            self._add(level, num_promoted_blocks=1)

    def _lookup(self, key: str) -> tuple[int, bytes] | None:
        for level in range(len(self.tiers)):
            if level == 0:
                with self._lock:
                    blob = self.tiers[0].get(key)
            elif self._is_paused(level):
                continue
            else:
                blob = self._call(level, "get", key)
            if blob is None:
                self._add(level, num_misses=1)
                continue
            try:
                payload = unframe_block(key, self._fingerprint, blob)
            except CorruptBlockError as exc:
                self._add(level, num_corrupt=1)
                _log.warning("KV tier %s returned a bad value, recomputing: %s",
                             self.tiers[level].name, exc)
                continue
            self._add(level, num_hits=1, num_bytes_out=len(blob))
            return level, payload
        return None

    # ---- lower-tier calls -------------------------------------------------------------------
    def _call(self, level: int, op: str, *args: object,
              ) -> bool | bytes | list[tuple[str, bytes]] | None:
        """A lower tier's op; a raise counts, warns once, pauses the tier, and reads None."""
        tier = self.tiers[level]
        try:
            with self._tier_locks[level]:  # tiers are not thread-safe; two threads call them
                result = getattr(tier, op)(*args)
        except Exception as exc:  # noqa: BLE001
            self._add(level, num_errors=1)
            with self._lock:
                was_down = level in self._down_until
                self._down_until[level] = self._clock() + self.retry_after_s
            if not was_down:
                _log.warning("KV tier %s failed on %s (%s); skipping it for %.0f s, its blocks "
                             "are recomputed", tier.name, op, exc, self.retry_after_s)
            return None
        with self._lock:
            if self._down_until.pop(level, None) is not None:
                _log.warning("KV tier %s works again", tier.name)
        return result

    def _remember(self, level: int, key: str) -> None:
        with self._lock:
            keys = self._put_keys[level]
            keys[key] = None
            if len(keys) > MAX_REMEMBERED_KEYS:
                del keys[next(iter(keys))]

    def _is_paused(self, level: int) -> bool:
        until = self._down_until.get(level)
        return until is not None and self._clock() < until

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _add(self, level: int, **deltas: int) -> None:
        with self._lock:
            self._add_locked(level, **deltas)

    def _add_locked(self, level: int, **deltas: int) -> None:
        counts = self._tier_counts[level]
        for name, delta in deltas.items():
            counts[name] += delta

    # ---- any thread ----------------------------------------------------------------------------
    def snapshot(self, *, with_keys: bool = False) -> OffloadSnapshot:
        """Counters and queue depth, consistent with each other (thread-safe, never waits on
        a tier). ``with_keys`` also lists the keys of tiers that can (tests): that waits for
        a lower-tier call under way."""
        with contextlib.ExitStack() as stack:
            for lock in self._tier_locks[1:] if with_keys else ():
                stack.enter_context(lock)
            stack.enter_context(self._lock)
            stack.enter_context(self._queue.mutex)
            tiers = tuple(TierCounters(t.name, **c, used_bytes=getattr(t, "used_bytes", None))
                          for t, c in zip(self.tiers, self._tier_counts, strict=True))
            keys = tuple(frozenset(t.keys()) if with_keys and hasattr(t, "keys") else None
                         for t in self.tiers)
            queued = len(self._queue.queue)
            c = self._counts
            return OffloadSnapshot(
                tiers=tiers, queue_depth=queued, num_enqueued=c["enqueued"],
                num_offloaded=c["offloaded"], num_skipped=c["skipped"],
                num_dropped_full=c["dropped_full"], num_dropped_evicted=c["dropped_evicted"],
                num_failed=c["failed"], num_spilled_lost=c["spilled_lost"], num_evicted=c["evicted"],
                in_flight=self._queue.unfinished_tasks - queued, tier_keys=keys)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued offload and promotion is done; False on timeout (tests and
        benchmarks; the engine never calls it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0 and self._jobs.unfinished_tasks == 0:
                return True
            time.sleep(0.002)
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop following the manager, stop the threads, close every tier. Safe to repeat.

        Queued offloads are dropped; the keys this offloader put into lower tiers are removed
        from them (see module docs). A tier whose close hangs (a Mooncake client retrying a
        dead master) is given ``timeout_s`` in all, then left to a daemon thread.
        """
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ValueError):
            self.manager.unsubscribe(self.on_event)
        with self._queue.mutex:
            dropped = len(self._queue.queue)
            self._queue.queue.clear()
            self._queue.unfinished_tasks -= dropped
        self._queue.put(_STOP)
        self._jobs.put(_STOP)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        closer = threading.Thread(target=self._close_tiers, name="kv-tier-close", daemon=True)
        closer.start()
        closer.join(max(0.0, deadline - time.monotonic()))

    def _close_tiers(self) -> None:
        for level, tier in enumerate(self.tiers):
            keys = list(self._put_keys[level]) if level and not self._is_paused(level) else []
            for key in keys:  # removal failing (a dead master) pauses it: stop asking
                if self._call(level, "remove", key) is None and self._is_paused(level):
                    break
            try:
                tier.close()
            except Exception:  # noqa: BLE001 - closing must not fail the engine's close
                _log.exception("closing KV tier %s failed", tier.name)

    def __enter__(self) -> AsyncOffloader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
