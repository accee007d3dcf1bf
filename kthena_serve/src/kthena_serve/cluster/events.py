"""KV events on the wire: a worker's sequenced event log and the JSON codec the router reads.

A worker (PD worker or DP replica) appends every ``BlockStored`` / ``BlockRemoved`` /
``AllCleared`` of its KV manager to an ``EventLog``; the router polls the worker's state route
(``/pd/state?since=seq``, ``/dp/state?since=seq``) and decodes the events with
``event_from_json`` into its ``ClusterPrefixIndex``. Both sides import this module, so the
router never imports a worker app.

The wire carries block hashes, never tokens: the index keys on hashes only, and a worker's
state route must not hand out its tenants' prompts. A ``BlockStored`` decoded here has
empty ``token_ids``.
"""

from __future__ import annotations

import threading
from collections import deque

from mooncake_kv import AllCleared, BlockRemoved, BlockStored, KVCacheManager

__all__ = ["EventLog", "event_from_json"]


class EventLog:
    """A worker's KV events with sequence numbers, for the router to poll (``since``)."""

    def __init__(self, kv: KVCacheManager, maxlen: int = 50_000) -> None:
        self._events: deque[tuple[int, dict]] = deque(maxlen=maxlen)
        self._seq = 0
        self._lock = threading.Lock()
        kv.subscribe(self._on_event)

    def _on_event(self, event: object) -> None:
        if isinstance(event, BlockStored):
            data = {"type": "stored", "block_hashes": [h.hex() for h in event.block_hashes],
                    "parent": event.parent_block_hash.hex() if event.parent_block_hash else None,
                    "block_size": event.block_size,
                    "block_ids": list(event.block_ids)}
        elif isinstance(event, BlockRemoved):
            data = {"type": "removed", "block_hashes": [h.hex() for h in event.block_hashes],
                    "block_ids": list(event.block_ids)}
        else:
            data = {"type": "cleared"}
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, data))

    def since(self, seq: int) -> tuple[int, int, list[dict]]:
        """(first seq still held, last seq, events after ``seq``)."""
        with self._lock:
            first = self._events[0][0] if self._events else self._seq + 1
            return first, self._seq, [e for s, e in self._events if s > seq]


def event_from_json(data: dict) -> BlockStored | BlockRemoved | AllCleared:
    """The KV event an ``EventLog`` item describes (``BlockStored.token_ids`` is empty)."""
    if data["type"] == "stored":
        parent = bytes.fromhex(data["parent"]) if data["parent"] else None
        return BlockStored(tuple(bytes.fromhex(h) for h in data["block_hashes"]), parent,
                           (), data["block_size"], tuple(data["block_ids"]))
    if data["type"] == "removed":
        return BlockRemoved(tuple(bytes.fromhex(h) for h in data["block_hashes"]),
                            tuple(data["block_ids"]))
    return AllCleared()
