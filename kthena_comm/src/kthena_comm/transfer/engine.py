"""The one-sided ``TransferEngine`` protocol (the HIXL / Mooncake model) and its registry.

An engine registers memory (→ ``MemoryHandle``), then moves bytes with ``batch_put`` (local →
remote) and ``batch_get`` (remote → local) without the peer's CPU taking part. The async variants
return a ``TransferFuture``; ``wait`` blocks for futures with a deadline. Every failure is an
exception naming the backend, the peer and the op; nothing blocks past ``timeout_s``. A batch is a
list of ``TransferOp`` or, for many ranges, one columnar ``TransferBatch``.

``Notifier`` is the optional half (HIXL / Mooncake notify): a small message sent after a put, so
the target learns that a request's blocks have landed without polling its memory.

Backends register a factory by name (``local``, ``shm``, ``mooncake``, ``torch``), so callers
pick one with ``create_engine(name, config)`` and no code branches on the backend.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from kthena_comm.errors import TransferError, TransferTimeoutError, UnknownBackendError
from kthena_comm.transfer.batch import TransferBatch
from kthena_comm.transfer.handle import MemoryHandle, TransferOp
from kthena_comm.transfer.memory import MemoryLocation
from kthena_comm.transfer.tcp_queues import SocketBacklog

Batch = Sequence[TransferOp] | TransferBatch
"""What the batch verbs accept: ``TransferOp`` values, or one columnar ``TransferBatch``."""

MAX_NOTIFY_BYTES = 64 * 1024
"""Largest ``notify`` message: control data (request id, block ids), never KV bytes."""


class TransferFuture:
    """An in-flight batch. ``wait`` returns when it is done or raises its error."""

    def __init__(self, inner: cf.Future, backend: str, peer: str, op: str,
                 timeout_s: float) -> None:
        self._inner = inner
        self._context = (backend, peer, op)
        self._timeout_s = timeout_s

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the batch completes.

        Raises:
            TransferTimeoutError: not done within ``timeout_s`` (default: the engine's).
            TransferError: the batch failed (a subclass says why).
        """
        limit = self._timeout_s if timeout_s is None else timeout_s
        try:
            self._inner.result(timeout=limit)
        except cf.TimeoutError:
            raise TransferTimeoutError(*self._context, f"not complete after {limit}s") from None


@runtime_checkable
class TransferEngine(Protocol):
    """One-sided transfer between registered memories."""

    backend: str

    @property
    def address(self) -> str:
        """This engine's peer address, as it appears in its handles' ``peer``."""

    def register(self, memory: Any, layout_id: str | None = None, *,
                 location: MemoryLocation | None = None) -> MemoryHandle:
        """Register memory; returns its handle (which records ``location``).

        ``memory`` is a contiguous tensor (its device gives the location: host, cuda:N, npu:N),
        a ``DeviceBuffer`` (device memory by address) or a writable host buffer. ``location``
        may restate where it lives; it must agree.

        Raises:
            TransportUnavailableError: this backend (or the installed library) cannot move
                memory of that kind; the message names what is missing.
            ValueError: empty, read-only or non-contiguous memory.
        """

    def unregister(self, handle: MemoryHandle) -> None:
        """Stop serving ``handle``'s memory (idempotent)."""

    def batch_put(self, ops: Batch) -> None:
        """Copy each op's local range into its remote range; returns when all landed."""

    def batch_get(self, ops: Batch) -> None:
        """Copy each op's remote range into its local range."""

    def batch_put_async(self, ops: Batch) -> TransferFuture:
        """Start ``batch_put``; the future completes when all bytes landed."""

    def batch_get_async(self, ops: Batch) -> TransferFuture:
        """Start ``batch_get``."""

    def wait(self, futures: Iterable[TransferFuture], timeout_s: float | None = None) -> None:
        """Wait for every future; raises the first error."""

    def wire_backlog(self, peer: MemoryHandle) -> SocketBacklog | None:
        """Bytes to or from ``peer`` that this process's kernel still holds beyond every
        future (TCP transports; zero for in-process ones; None: cannot say)."""

    def close(self) -> None:
        """Release memory, connections and threads; a second call does nothing."""


@attrs.frozen
class Notification:
    """A small message from ``sender`` (its engine address)."""

    sender: str
    message: bytes


@runtime_checkable
class Notifier(Protocol):
    """Engines that can send a small control message to a peer (all built-in backends)."""

    def notify(self, peer: MemoryHandle | str, message: bytes) -> None:
        """Send ``message`` (at most ``MAX_NOTIFY_BYTES``) to ``peer`` (a handle it owns, or its
        address). Messages from one sender arrive in order, after the puts it waited for."""

    def poll_notifies(self, timeout_s: float = 0.0) -> list[Notification]:
        """Messages received so far, oldest first; waits up to ``timeout_s`` for the first one
        and returns ``[]`` if none came."""


@attrs.frozen
class BackendEntry:
    """How to build one backend, and whether it can run on this machine."""

    name: str
    factory: Callable[..., TransferEngine] = attrs.field(eq=False)
    is_available: Callable[[], bool] = attrs.field(eq=False, default=lambda: True)


_BACKENDS: dict[str, BackendEntry] = {}


def register_backend(entry: BackendEntry) -> None:
    """Add or replace a transfer backend."""
    _BACKENDS[entry.name] = entry


def create_engine(name: str, config: Any = None) -> TransferEngine:
    """Build an engine of backend ``name`` with its config object (``None``: its defaults).

    Raises:
        UnknownBackendError: no backend of that name is registered.
    """
    try:
        entry = _BACKENDS[name]
    except KeyError:
        raise UnknownBackendError("transfer", name, list(_BACKENDS)) from None
    return entry.factory() if config is None else entry.factory(config)


def available_backends() -> list[str]:
    """Registered backends that can run here (their library is importable)."""
    return [name for name, entry in _BACKENDS.items() if entry.is_available()]


def wait_all(futures: Iterable[TransferFuture], timeout_s: float | None = None) -> None:
    """Wait for every future in turn; re-raises the first failure."""
    errors: list[TransferError] = []
    for future in futures:
        try:
            future.wait(timeout_s)
        except TransferError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
