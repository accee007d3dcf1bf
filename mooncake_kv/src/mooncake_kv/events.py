"""KV events: what an instance announces when blocks become matchable or stop being so.

``BlockStored`` is emitted when ``commit`` caches blocks, ``BlockRemoved`` when cached
blocks are evicted, ``AllCleared`` when the whole prefix cache is reset. Events carry the
stable block hashes (what a router or cluster index keys on) *and* the instance-local block
ids (what a tier needs to copy a block's bytes).

Delivery is synchronous, on the manager's owner thread, inside the verb that caused it:
``BlockRemoved`` for an evicted block is delivered before the verb returns that block to a
new owner, so a subscriber may still read (offload) the block's old bytes. Subscribers
must be quick and must not call mutating verbs; an exception from one is logged and does
not stop the others. ``subscribe``/``unsubscribe`` may be called from any thread. For
consumers on other threads, ``EventQueue`` buffers events to ``drain()`` later.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Union

import attrs

from mooncake_kv.types import BlockHash, BlockId

__all__ = [
    "AllCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBus",
    "EventQueue",
    "KVEvent",
    "KVEventCallback",
    "stored_events",
]

_log = logging.getLogger(__name__)


@attrs.frozen
class BlockStored:
    """Consecutive blocks of one chain became matchable.

    Attributes:
        block_hashes: hashes of the stored blocks, in chain order.
        parent_block_hash: hash of the block before the first one; None at the chain start.
        token_ids: the stored blocks' tokens, ``block_size`` per block.
        block_size: tokens per block.
        block_ids: instance-local ids of the blocks holding them.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    block_ids: tuple[BlockId, ...]


@attrs.frozen
class BlockRemoved:
    """Blocks stopped being matchable (evicted); ids are instance-local, hashes global."""

    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[BlockId, ...]


@attrs.frozen
class AllCleared:
    """Every cached block of the instance was dropped at once."""


KVEvent = Union[BlockStored, BlockRemoved, AllCleared]
KVEventCallback = Callable[[KVEvent], None]


class EventQueue:
    """A thread-safe buffer of events: the bus puts, any thread drains."""

    __slots__ = ("_bus", "_queue")

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._queue: queue.SimpleQueue[KVEvent] = queue.SimpleQueue()

    def __call__(self, event: KVEvent) -> None:
        self._queue.put(event)

    def drain(self) -> list[KVEvent]:
        """Return (and remove) every buffered event, oldest first; never blocks."""
        events: list[KVEvent] = []
        while True:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                return events

    def get(self, timeout: float | None = None) -> KVEvent | None:
        """Wait up to ``timeout`` seconds for the next event; None if none came."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop receiving events (already buffered ones can still be drained)."""
        self._bus.unsubscribe(self)


class EventBus:
    """Subscriber list with copy-on-write updates, so emitting needs no lock."""

    __slots__ = ("_lock", "_subscribers")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: tuple[KVEventCallback, ...] = ()

    @property
    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self, callback: KVEventCallback) -> None:
        """Deliver every later event to ``callback`` (thread-safe)."""
        with self._lock:
            self._subscribers = (*self._subscribers, callback)

    def unsubscribe(self, callback: KVEventCallback) -> None:
        """Stop delivering to ``callback`` (thread-safe).

        Raises:
            ValueError: ``callback`` is not subscribed.
        """
        with self._lock:
            subscribers = list(self._subscribers)
            if callback not in subscribers:
                raise ValueError(f"{callback!r} is not subscribed; nothing to unsubscribe")
            subscribers.remove(callback)
            self._subscribers = tuple(subscribers)

    def open_queue(self) -> EventQueue:
        """Subscribe a new ``EventQueue`` and return it."""
        events = EventQueue(self)
        self.subscribe(events)
        return events

    def emit(self, event: KVEvent) -> None:
        """Deliver ``event`` to every subscriber; a failing subscriber is logged, not raised."""
        for callback in self._subscribers:
            try:
                callback(event)
            except Exception:
                _log.exception("KV event subscriber %r failed on %r", callback, type(event))


def stored_events(hashes: Sequence[BlockHash], token_ids: Sequence[int],
                  block_ids: Sequence[BlockId], runs: Sequence[tuple[int, int]],
                  block_size: int) -> Iterator[BlockStored]:
    """One ``BlockStored`` per run ``[first, stop)`` of block positions that became cached:
    their hashes, parent hash, tokens and block ids."""
    for first, stop in runs:
        yield BlockStored(
            block_hashes=tuple(hashes[first:stop]),
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tuple(token_ids[first * block_size : stop * block_size]),
            block_size=block_size,
            block_ids=tuple(block_ids[first:stop]),
        )
