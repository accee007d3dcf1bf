"""Shared engine machinery: registration book-keeping, op validation, async, close.

Backends subclass ``BaseEngine`` and fill in four hooks: ``_register_raw``, ``_unregister_raw``,
``_transfer`` (one validated batch, blocking) and ``_close_backend``.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from kthena_comm.errors import EngineClosedError, UnregisteredRangeError
from kthena_comm.transfer._memory import RawBuffer, raw_buffer
from kthena_comm.transfer.engine import TransferFuture, wait_all
from kthena_comm.transfer.handle import MemoryHandle, TransferOp


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

    # -- hooks ---------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        raise NotImplementedError

    def _register_raw(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        raise NotImplementedError

    def _unregister_raw(self, handle: MemoryHandle, raw: RawBuffer) -> None:
        raise NotImplementedError

    def _transfer(self, op: str, ops: Sequence[TransferOp]) -> None:
        raise NotImplementedError

    def _close_backend(self) -> None:
        raise NotImplementedError

    # -- protocol ------------------------------------------------------------------------------
    def register(self, memory: Any, layout_id: str | None = None) -> MemoryHandle:
        self._check_open("register")
        return self._remember(raw_buffer(memory), layout_id)

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

    def batch_put(self, ops: Sequence[TransferOp]) -> None:
        self._run_sync("put", ops)

    def batch_get(self, ops: Sequence[TransferOp]) -> None:
        self._run_sync("get", ops)

    def batch_put_async(self, ops: Sequence[TransferOp]) -> TransferFuture:
        return self._submit("put", ops)

    def batch_get_async(self, ops: Sequence[TransferOp]) -> TransferFuture:
        return self._submit("get", ops)

    def wait(self, futures: Iterable[TransferFuture], timeout_s: float | None = None) -> None:
        wait_all(futures, timeout_s)

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
    def _run_sync(self, op: str, ops: Sequence[TransferOp]) -> None:
        ops = self._validated(op, ops)
        if self.sync_in_caller:
            self._transfer(op, ops)
        elif ops:
            self._submit_validated(op, ops).wait()

    def _submit(self, op: str, ops: Sequence[TransferOp]) -> TransferFuture:
        return self._submit_validated(op, self._validated(op, ops))

    def _submit_validated(self, op: str, ops: list[TransferOp]) -> TransferFuture:
        inner = self._executor.submit(self._transfer, op, ops) if ops else _done()
        return TransferFuture(inner, self.backend, peers_of(ops), op, self.timeout_s)

    def _validated(self, op: str, ops: Sequence[TransferOp]) -> list[TransferOp]:
        self._check_open(op)
        ops = list(ops)
        for handle in {o.local for o in ops}:  # distinct handles once, ranges per op
            self._check_local_handle(op, handle)
        for remote in {o.remote for o in ops}:
            _check_remote_handle(self.backend, op, remote)
        for item in ops:
            _check_range(self.backend, op, item, item.local, item.local_offset, "local")
            _check_range(self.backend, op, item, item.remote, item.remote_offset, "remote")
        return ops

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise EngineClosedError(self.backend, op)

    def _check_local_handle(self, op: str, handle: MemoryHandle) -> None:
        entry = self._registered.get(handle.base_addr)
        if entry is None or entry[0] != handle:
            raise UnregisteredRangeError(self.backend, "-", op,
                                         "local handle is not registered with this engine; "
                                         "call register() on this engine first")



def _check_remote_handle(backend: str, op: str, remote: MemoryHandle) -> None:
    if remote.backend != backend:
        raise UnregisteredRangeError(backend, remote.peer, op,
                                     f"remote handle belongs to backend {remote.backend!r}; "
                                     f"use a handle registered with a {backend!r} engine")


def _check_range(backend: str, op: str, item: TransferOp, handle: MemoryHandle, offset: int,
                 side: str) -> None:
    if offset + item.length > handle.length:
        raise UnregisteredRangeError(
            backend, item.remote.peer, op,
            f"{side} range [{offset}, {offset + item.length}) exceeds the registered "
            f"{handle.length} bytes; keep offset + length within the handle")


def peers_of(ops: Sequence[TransferOp]) -> str:
    """Comma-separated distinct remote peers of a batch, for error messages."""
    return ",".join(sorted({o.remote.peer for o in ops})) or "-"


def _done() -> cf.Future:
    future: cf.Future = cf.Future()
    future.set_result(None)
    return future
