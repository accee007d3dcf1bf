"""Shared engine machinery: registration book-keeping, batch validation, async, notify, close.

Backends subclass ``BaseEngine`` and fill in the hooks: ``_register_raw``, ``_unregister_raw``,
``_check_memory`` (which memory kinds it moves: host only unless overridden),
``_transfer`` (validated columnar batches, blocking), ``_close_backend`` and, for notify,
``_send_notify`` (plus ``_pull_notifies`` when messages must be fetched from the transport).
Validation is whole-array numpy work per batch, so its cost barely grows with the range count.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kthena_comm.errors import EngineClosedError, TransportUnavailableError, UnregisteredRangeError
from kthena_comm.transfer._memory import RawBuffer, raw_buffer
from kthena_comm.transfer.batch import Ranges, SmallBatch, batches_of, first_overflow
from kthena_comm.transfer.engine import (
    MAX_NOTIFY_BYTES,
    Batch,
    Notification,
    TransferFuture,
    wait_all,
)
from kthena_comm.transfer.handle import MemoryHandle
from kthena_comm.transfer.memory import MemoryLocation
from kthena_comm.transfer.tcp_queues import SocketBacklog

#: how often ``poll_notifies`` re-checks a transport that cannot wake it
_NOTIFY_POLL_S = 0.002


class BaseEngine:
    """Common half of every backend; see the module docstring for the hooks."""

    backend = "base"
    #: run sync batches on the caller's thread (the backend cannot block) or on a worker thread
    #: with a deadline (the backend talks to a peer that may hang).
    sync_in_caller = True

    def __init__(self, timeout_s: float, num_workers: int = 2) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._closed = False
        self._lock = threading.Lock()
        self._registered: dict[int, tuple[MemoryHandle, RawBuffer]] = {}
        self._executor = cf.ThreadPoolExecutor(num_workers, thread_name_prefix=self.backend)
        self._inbox: collections.deque[Notification] = collections.deque()
        self._inbox_ready = threading.Condition()

    # -- hooks ---------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        raise NotImplementedError

    def _register_raw(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        raise NotImplementedError

    def _unregister_raw(self, handle: MemoryHandle, raw: RawBuffer) -> None:
        raise NotImplementedError

    def _transfer(self, op: str, batches: Sequence[Ranges]) -> None:
        raise NotImplementedError

    def _send_notify(self, peer: str, message: bytes) -> None:
        raise NotImplementedError(f"{self.backend}: this backend has no notify")

    def _pull_notifies(self) -> None:
        """Move messages waiting in the transport into the inbox (push transports: nothing)."""

    def _close_backend(self) -> None:
        raise NotImplementedError

    def _check_memory(self, location: MemoryLocation) -> None:
        """Refuse memory this backend cannot move (default: everything but host memory)."""
        if location.is_device:
            raise TransportUnavailableError(
                self.backend, f"{location} memory",
                f"the {self.backend} backend moves host memory only; register device memory "
                "with the mooncake backend (a Mooncake build with that device's transport, see "
                "docs/accelerators.md) or copy it to a CPU tensor")

    # -- protocol ------------------------------------------------------------------------------
    def register(self, memory: Any, layout_id: str | None = None, *,
                 location: MemoryLocation | None = None) -> MemoryHandle:
        self._check_open("register")
        raw = raw_buffer(memory, location)
        self._check_memory(raw.location)
        return self._remember(raw, layout_id)

    def _remember(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        handle = self._register_raw(raw, layout_id)
        with self._lock:
            self._registered[handle.base_addr] = (handle, raw)
        return handle

    def unregister(self, handle: MemoryHandle) -> None:
        with self._lock:
            entry = self._registered.pop(handle.base_addr, None)
        if entry is not None and not self._closed:
            self._unregister_raw(*entry)

    def batch_put(self, ops: Batch) -> None:
        self._run_sync("put", ops)

    def batch_get(self, ops: Batch) -> None:
        self._run_sync("get", ops)

    def batch_put_async(self, ops: Batch) -> TransferFuture:
        return self._submit("put", ops)

    def batch_get_async(self, ops: Batch) -> TransferFuture:
        return self._submit("get", ops)

    def notify(self, peer: MemoryHandle | str, message: bytes) -> None:
        """Send a small control message to ``peer`` (a handle it owns, or its address).

        Raises:
            ValueError: ``message`` is not bytes or is longer than ``MAX_NOTIFY_BYTES``.
            PeerUnreachableError: the peer is gone.
        """
        self._check_open("notify")
        if not isinstance(message, bytes | bytearray | memoryview):
            raise ValueError(f"notify message must be bytes, got {type(message).__name__}")
        if len(message) > MAX_NOTIFY_BYTES:
            raise ValueError(f"notify message of {len(message)} bytes exceeds {MAX_NOTIFY_BYTES}; "
                             "send ids in the message and the data with batch_put")
        address = peer.peer if isinstance(peer, MemoryHandle) else peer
        self._send_notify(address, bytes(message))

    def poll_notifies(self, timeout_s: float = 0.0) -> list[Notification]:
        """Messages received so far, oldest first; waits up to ``timeout_s`` for the first one."""
        self._check_open("poll_notifies")
        deadline = time.monotonic() + timeout_s
        while True:
            self._pull_notifies()
            with self._inbox_ready:
                if self._inbox:
                    messages = list(self._inbox)
                    self._inbox.clear()
                    return messages
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._inbox_ready.wait(min(left, _NOTIFY_POLL_S))

    def _deliver(self, sender: str, message: bytes) -> None:
        """Called by a backend (any thread) when a message arrives."""
        with self._inbox_ready:
            self._inbox.append(Notification(sender, message))
            self._inbox_ready.notify_all()

    def wait(self, futures: Iterable[TransferFuture], timeout_s: float | None = None) -> None:
        wait_all(futures, timeout_s)

    def wire_backlog(self, peer: MemoryHandle) -> SocketBacklog | None:
        """What a finished (or failed) transfer to or from ``peer`` may still deliver outside
        this engine's futures: none here (a done future of an in-process engine is the end of
        its bytes); engines over TCP sockets report their kernel queues (`tcp_queues`)."""
        del peer
        return SocketBacklog(0, 0, 0)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = list(self._registered.values())
            self._registered.clear()
        for handle, raw in entries:
            self._unregister_raw(handle, raw)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._close_backend()

    def __enter__(self) -> BaseEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _run_sync(self, op: str, ops: Batch) -> None:
        batches = self._validated(op, ops)
        if self.sync_in_caller:
            if batches:
                self._transfer(op, batches)
        elif batches:
            self._submit_validated(op, batches).wait()

    def _submit(self, op: str, ops: Batch) -> TransferFuture:
        return self._submit_validated(op, self._validated(op, ops))

    def _submit_validated(self, op: str, batches: list[Ranges]) -> TransferFuture:
        inner = self._executor.submit(self._transfer, op, batches) if batches else _done()
        return TransferFuture(inner, self.backend, peers_of(batches), op, self.timeout_s)

    def _validated(self, op: str, ops: Batch) -> list[Ranges]:
        self._check_open(op)
        batches = batches_of(ops)
        registered = self._registered
        for batch in batches:
            entry = registered.get(batch.local.base_addr)
            if entry is None or (entry[0] is not batch.local and entry[0] != batch.local):
                self._check_local_handle(op, batch.local)  # raises with the full story
            if batch.remote.backend != self.backend:
                _check_remote_handle(self.backend, op, batch.remote)
            _check_ranges(self.backend, op, batch)
        return batches

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise EngineClosedError(self.backend, op)

    def _check_local_handle(self, op: str, handle: MemoryHandle) -> None:
        entry = self._registered.get(handle.base_addr)
        if entry is None or (entry[0] is not handle and entry[0] != handle):
            raise UnregisteredRangeError(self.backend, "-", op,
                                         "local handle is not registered with this engine; "
                                         "call register() on this engine first")


def _check_remote_handle(backend: str, op: str, remote: MemoryHandle) -> None:
    if remote.backend != backend:
        raise UnregisteredRangeError(backend, remote.peer, op,
                                     f"remote handle belongs to backend {remote.backend!r}; "
                                     f"use a handle registered with a {backend!r} engine")


def _check_ranges(backend: str, op: str, batch: Ranges) -> None:
    if type(batch) is SmallBatch:  # the per-call path: plain int compares
        local_len, remote_len = batch.local.length, batch.remote.length
        for lo, ro, n in zip(batch.local_offsets, batch.remote_offsets, batch.lengths):  # noqa: B905
            if lo + n > local_len or ro + n > remote_len:
                break
        else:
            return
    local = first_overflow(batch.local_offsets, batch.lengths, batch.local.length)
    remote = first_overflow(batch.remote_offsets, batch.lengths, batch.remote.length)
    if local is not None or remote is not None:
        side, handle, offsets, bad = (("local", batch.local, batch.local_offsets, local)
                                      if local is not None else
                                      ("remote", batch.remote, batch.remote_offsets, remote))
        start, end = int(offsets[bad]), int(offsets[bad] + batch.lengths[bad])
        raise UnregisteredRangeError(
            backend, batch.remote.peer, op,
            f"{side} range [{start}, {end}) exceeds the registered {handle.length} bytes; "
            "keep offset + length within the handle")


def peers_of(batches: Sequence[Ranges]) -> str:
    """Comma-separated distinct remote peers of a batch, for error messages."""
    return ",".join(sorted({b.remote.peer for b in batches})) or "-"


def _done() -> cf.Future:
    future: cf.Future = cf.Future()
    future.set_result(None)
    return future
