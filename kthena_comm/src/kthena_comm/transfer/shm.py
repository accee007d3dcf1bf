"""``shm`` backend: processes on one host share POSIX shared-memory segments.

``allocate(nbytes)`` creates a segment (``/dev/shm/<prefix>-<pid>-<n>-<random>``, mode 0600,
owner only) and registers it; its handle carries the segment name, so a peer maps the same
physical pages. A put into a peer's segment is therefore one memcpy from the source (the only
copy), and a producer that computes straight into ``buffer(handle)`` needs no put at all (zero
copy). Memory registered with ``register()`` stays private: it can be the local side of an op,
never the remote side.

Notify: each engine binds a Unix datagram socket ``<prefix>-<pid>-inbox-<random>`` in the same
directory (mode 0600, removed by the janitor like a segment); its name is part of the engine's
address ``shm:<pid>:<inbox>``, so a handle says where to send the "blocks landed" message.

Liveness: the owner holds a shared ``flock`` on each segment; a peer that can take the lock
exclusively knows the owner is gone (checked before and after each batch, so a put into an
orphaned segment raises ``PeerUnreachableError`` instead of silently succeeding). Clean-up: a
tiny janitor process unlinks the owner's segments when the owner exits, even by SIGKILL.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

import attrs

from kthena_comm.errors import (
    CommError,
    PeerUnreachableError,
    TransferTimeoutError,
    UnregisteredRangeError,
)
from kthena_comm.transfer._base import BaseEngine
from kthena_comm.transfer._memory import RawBuffer
from kthena_comm.transfer.batch import Ranges, copy_batch
from kthena_comm.transfer.engine import MAX_NOTIFY_BYTES, BackendEntry, register_backend
from kthena_comm.transfer.handle import MemoryHandle

_JANITOR = os.path.join(os.path.dirname(__file__), "_shm_janitor.py")


@attrs.frozen
class ShmConfig:
    """Segment name prefix, directory (tmpfs) and per-batch deadline."""

    prefix: str = attrs.field(default="kthena")

    @prefix.validator
    def _plain_name(self, attribute: attrs.Attribute, value: str) -> None:
        if not value or "/" in value or ":" in value:
            raise ValueError(f"prefix must be a non-empty file name without '/' or ':', "
                             f"got {value!r}")

    directory: str = "/dev/shm"
    timeout_s: float = 10.0


class _Segment:
    """One mapped segment: file descriptor (holding the liveness lock), mapping, address."""

    def __init__(self, path: str, fd: int, nbytes: int) -> None:
        self.path, self.fd, self.nbytes = path, fd, nbytes
        self.mm = mmap.mmap(fd, nbytes)
        self._anchor = (ctypes.c_char * nbytes).from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)

    def close(self) -> None:
        # mmap holds a dup of fd, so drop the lock explicitly: peers must see us go now.
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        del self._anchor
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds buffer(); the mapping goes when that view is freed
        os.close(self.fd)


class ShmEngine(BaseEngine):
    """Same-host, cross-process transfer over shared memory."""

    backend = "shm"

    def __init__(self, config: ShmConfig | None = None) -> None:
        self.config = config or ShmConfig()
        super().__init__(self.config.timeout_s)
        self._names = itertools.count()
        self._own: dict[str, _Segment] = {}
        self._mapped: dict[str, _Segment] = {}
        self._map_lock = threading.Lock()  # async batches map from worker threads
        self._janitor = subprocess.Popen(
            [sys.executable, "-I", "-S", _JANITOR, self.config.directory],
            stdin=subprocess.PIPE, start_new_session=True)
        self._inbox_name = self._new_name("inbox")
        self._inbox_sock = self._bind_inbox(self._inbox_name)
        self._outbox_sock: socket.socket | None = None
        self._address = f"shm:{os.getpid()}:{self._inbox_name}"

    @property
    def address(self) -> str:
        return self._address

    def allocate(self, nbytes: int, layout_id: str | None = None) -> MemoryHandle:
        """Create and register a shared segment of ``nbytes``; peers can put into it."""
        self._check_open("allocate")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        name = self._new_name(str(next(self._names)))
        path = os.path.join(self.config.directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, nbytes)
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while we live: our liveness signal
        segment = _Segment(path, fd, nbytes)
        self._own[name] = segment
        return self._remember(RawBuffer(segment.addr, nbytes, name), layout_id)

    def _new_name(self, kind: str) -> str:
        """A fresh file name in the directory, announced to the janitor before it exists."""
        name = f"{self.config.prefix}-{os.getpid()}-{kind}-{secrets.token_hex(4)}"
        self._tell_janitor(f"+{name}")
        return name

    def _bind_inbox(self, name: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path = os.path.join(self.config.directory, name)
        sock.bind(path)
        os.chmod(path, 0o600)  # only our user may send us messages
        sock.setblocking(False)
        return sock

    def buffer(self, handle: MemoryHandle) -> memoryview:
        """Writable view of a segment (own or a peer's): the zero-copy path."""
        self._check_open("buffer")
        segment = self._own.get(handle.segment) or self._map("buffer", handle)
        return memoryview(segment.mm)[: handle.length]

    def _register_raw(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        name = raw.keepalive if isinstance(raw.keepalive, str) else ""
        return MemoryHandle(self.backend, self.address, raw.addr, raw.nbytes, name, layout_id)

    def _unregister_raw(self, handle: MemoryHandle, raw: RawBuffer) -> None:
        segment = self._own.pop(handle.segment, None)
        if segment is not None:
            os.unlink(segment.path)
            segment.close()
            self._tell_janitor(f"-{handle.segment}")

    def _transfer(self, op: str, batches: Sequence[Ranges]) -> None:
        targets = {b.remote.segment: self._target(op, b.remote) for b in batches}
        self._check_alive(op, batches)
        for batch in batches:
            copy_batch(op, batch, batch.local.base_addr, targets[batch.remote.segment].addr)
        self._check_alive(op, batches)  # a peer that died mid-batch never saw the bytes

    def _target(self, op: str, handle: MemoryHandle) -> _Segment:
        if not handle.segment:
            raise UnregisteredRangeError(self.backend, handle.peer, op,
                                         "remote handle is private memory (register()); peers "
                                         "can only reach memory created with allocate()")
        return self._own.get(handle.segment) or self._map(op, handle)

    def _map(self, op: str, handle: MemoryHandle) -> _Segment:
        with self._map_lock:
            segment = self._mapped.get(handle.segment)
            if segment is None:
                segment = _open_segment(self.config.directory, op, handle)
                self._mapped[handle.segment] = segment
        if segment.nbytes < handle.length:
            raise UnregisteredRangeError(self.backend, handle.peer, op,
                                         f"handle claims {handle.length} bytes but segment "
                                         f"{handle.segment} has {segment.nbytes}")
        return segment

    def _send_notify(self, peer: str, message: bytes) -> None:
        inbox = _inbox_of(peer)
        if self._outbox_sock is None:
            self._outbox_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._outbox_sock.settimeout(self.timeout_s)  # a full inbox blocks, never forever
        try:
            self._outbox_sock.sendto(self.address.encode() + b"\0" + message,
                                     os.path.join(self.config.directory, inbox))
        except (FileNotFoundError, ConnectionRefusedError):
            raise PeerUnreachableError(self.backend, peer, "notify",
                                       "its inbox is gone: the engine closed or exited") from None
        except TimeoutError:
            raise TransferTimeoutError(self.backend, peer, "notify",
                                       f"inbox full for {self.timeout_s}s") from None

    def _pull_notifies(self) -> None:
        while True:
            try:
                datagram = self._inbox_sock.recv(MAX_NOTIFY_BYTES + 4096)
            except (BlockingIOError, OSError):
                return
            sender, _, message = datagram.partition(b"\0")
            self._deliver(sender.decode(errors="replace"), message)

    def _check_alive(self, op: str, batches: Sequence[Ranges]) -> None:
        for handle in {b.remote for b in batches if b.remote.segment in self._mapped}:
            if _is_lock_free(self._mapped[handle.segment].fd):
                self._mapped.pop(handle.segment).close()
                raise _gone_error(self.backend, op, handle)

    def _tell_janitor(self, line: str) -> None:
        try:
            self._janitor.stdin.write(f"{line}\n".encode())  # type: ignore[union-attr]
            self._janitor.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError) as exc:
            raise CommError(f"shm: segment janitor (pid {self._janitor.pid}) is gone; "
                            "segments could leak, create a new engine") from exc

    def _close_backend(self) -> None:
        for segment in self._mapped.values():
            segment.close()
        self._mapped.clear()
        self._inbox_sock.close()
        if self._outbox_sock is not None:
            self._outbox_sock.close()
        _unlink(os.path.join(self.config.directory, self._inbox_name))
        self._tell_janitor(f"-{self._inbox_name}")
        self._janitor.stdin.close()  # type: ignore[union-attr]
        try:
            self._janitor.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._janitor.kill()
            self._janitor.wait()


def _open_segment(directory: str, op: str, handle: MemoryHandle) -> _Segment:
    path = os.path.join(directory, handle.segment)
    if "/" in handle.segment:
        raise UnregisteredRangeError("shm", handle.peer, op, f"bad segment name {handle.segment!r}")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise UnregisteredRangeError("shm", handle.peer, op,
                                     f"segment {handle.segment} does not exist: the peer "
                                     "unregistered it or exited") from None
    return _Segment(path, fd, os.fstat(fd).st_size)


def _is_lock_free(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _inbox_of(peer: str) -> str:
    kind, _, rest = peer.partition(":")
    inbox = rest.partition(":")[2]
    if kind != "shm" or not inbox or "/" in inbox:
        raise ValueError(f"{peer!r} is not an shm engine address (shm:<pid>:<inbox>)")
    return inbox


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _gone_error(backend: str, op: str, handle: MemoryHandle) -> Exception:
    pid_text = handle.peer.split(":")[1] if handle.peer.count(":") >= 1 else ""
    pid = int(pid_text) if pid_text.isdigit() else 0
    if _pid_alive(pid):
        return UnregisteredRangeError(backend, handle.peer, op,
                                      f"peer unregistered segment {handle.segment}")
    return PeerUnreachableError(backend, handle.peer, op, f"peer process {pid} has exited")


def _pid_alive(pid: int) -> bool:
    # A process being reaped can still open and then fail the read with ESRCH
    # (ProcessLookupError): any OSError here means the process is gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError, ValueError):
        return False


register_backend(BackendEntry("shm", ShmEngine, lambda: os.path.isdir("/dev/shm")))
