"""``torch`` backend: one-sided verbs emulated with two-sided send/recv over a gloo group.

The fallback where no one-sided engine exists. Each engine owns a private ``ProcessGroupGloo``
(rendezvous over a TCPStore, sockets bound to ``host``), so its traffic never mixes with the
application's collectives. For every other rank it runs a service thread that answers requests::

    initiator (client)                               target (service thread for that rank)
    put: HDR [magic, PUT, n, total] ─┐               recv HDR, RANGES, DATA (staging tensor)
         RANGES [(addr, len)] × n    ├── tags 1-3 ─▶ check every range is registered here,
         DATA (ranges gathered)     ─┘               scatter into memory
                          ◀──────────── tag 4 ────── REPLY [status, bad range index]
    get: HDR, RANGES ───────────────────────────────▶ check, gather
                          ◀──────────── tag 4, 5 ─── REPLY, DATA → client scatters locally
    notify: HDR [magic, NOTIFY, 0, size], DATA ─────▶ inbox; REPLY

Calls to one peer are serialised (one lock per peer), so the tagged streams stay in step.
Bounded time: every wait carries a deadline. Gloo closes every pair of a context when one wait
times out, so a timeout breaks the engine (later calls raise at once; create a new one), while a
peer that dies (SIGKILL) closes only its own pair: calls to it raise ``PeerUnreachableError``
within about a second. ``close()`` uses that same rule on purpose — a 1 ms wait that must time
out — to wake the service threads, which are blocked in a receive that nothing else interrupts.
"""

from __future__ import annotations

import ctypes
import secrets
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import numpy as np

from kthena_comm.errors import (
    InitError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
    UnregisteredRangeError,
)
from kthena_comm.transfer._base import BaseEngine
from kthena_comm.transfer._memory import RawBuffer
from kthena_comm.transfer.batch import Ranges, copy_ranges, put_or_get
from kthena_comm.transfer.engine import MAX_NOTIFY_BYTES, BackendEntry, register_backend
from kthena_comm.transfer.handle import MemoryHandle

_MAGIC = 0x4B54484E  # "KTHN"
_PUT, _GET, _NOTIFY = 1, 2, 3
_OK, _BAD_RANGE, _BAD_REQUEST = 0, 1, 2
_T_HDR, _T_RANGES, _T_DATA, _T_REPLY, _T_REPLY_DATA, _T_POISON = 1, 2, 3, 4, 5, 6
_IDLE_WAIT = timedelta(days=30)  # a service thread waits this long for the next request
_CLOSE_JOIN_S = 5.0


@attrs.frozen
class TorchConfig:
    """Where the engines of one transfer world meet, and their deadlines.

    ``rank`` 0 hosts the TCPStore at ``master_addr:master_port`` unless ``store`` (any c10d
    store, e.g. the one ``groups.connect_store`` returns) is given. ``host`` is the address the
    gloo sockets bind to.
    """

    rank: int = attrs.field(validator=attrs.validators.ge(0))
    world_size: int = attrs.field(validator=attrs.validators.ge(1))
    master_addr: str = "127.0.0.1"
    master_port: int = 29611
    host: str = "127.0.0.1"
    store: Any = attrs.field(default=None, eq=False)
    prefix: str = "kthena_comm/transfer"
    timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    connect_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside world_size {self.world_size}")


class _Regions:
    """Registered memory of this engine, as sorted arrays for vectorised range checks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_base: dict[int, int] = {}
        self._bases = self._ends = np.zeros(0, dtype=np.int64)

    def add(self, base: int, nbytes: int) -> None:
        with self._lock:
            self._by_base[base] = nbytes
            self._rebuild()

    def remove(self, base: int) -> None:
        with self._lock:
            self._by_base.pop(base, None)
            self._rebuild()

    def _rebuild(self) -> None:
        bases = np.array(sorted(self._by_base), dtype=np.int64)
        self._bases = bases
        self._ends = bases + np.array([self._by_base[b] for b in bases.tolist()], dtype=np.int64)

    def first_unregistered(self, addrs: np.ndarray, lengths: np.ndarray) -> int | None:
        """Index of the first range not inside one registered region, or None."""
        bases, ends = self._bases, self._ends
        if not len(bases):
            return 0
        idx = np.searchsorted(bases, addrs, side="right") - 1
        ok = (idx >= 0) & (addrs + lengths <= ends[np.maximum(idx, 0)]) & (lengths > 0)
        return None if ok.all() else int((~ok).argmax())


class TorchEngine(BaseEngine):
    """Transfer engine over two-sided gloo send/recv (see the module docstring)."""

    backend = "torch"

    def __init__(self, config: TorchConfig) -> None:
        import torch.distributed as dist

        self.config = config
        super().__init__(config.timeout_s)
        self._dist = dist
        self._store, self._pg, world = _connect(config)
        self._address = f"torch:{world}/{config.rank}"
        self._world = world
        self._regions = _Regions()
        self._peer_locks = {r: threading.Lock() for r in range(config.world_size)}
        self._dead: dict[int, str] = {}  # rank -> why its pair is unusable
        self._broken: str | None = None  # set when a timeout closed every pair
        self._closing = False
        self._services = [threading.Thread(target=self._serve, args=(r,), daemon=True,
                                           name=f"kthena-torch-svc-{r}")
                          for r in range(config.world_size) if r != config.rank]
        for thread in self._services:
            thread.start()

    @property
    def address(self) -> str:
        return self._address

    def address_of(self, rank: int) -> str:
        """The address of ``rank``'s engine in this transfer world (a ``notify`` target)."""
        return f"torch:{self._world}/{rank}"

    # -- registration --------------------------------------------------------------------------
    def _register_raw(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        self._regions.add(raw.addr, raw.nbytes)
        return MemoryHandle(self.backend, self.address, raw.addr, raw.nbytes, layout_id=layout_id)

    def _unregister_raw(self, handle: MemoryHandle, raw: RawBuffer) -> None:
        self._regions.remove(handle.base_addr)

    # -- initiator side ------------------------------------------------------------------------
    def _transfer(self, op: str, batches: Sequence[Ranges]) -> None:
        for batch in batches:
            rank = self._rank_of(batch.remote.peer, op)
            local = batch.local.base_addr + np.asarray(batch.local_offsets, dtype=np.int64)
            remote = batch.remote.base_addr + np.asarray(batch.remote_offsets, dtype=np.int64)
            lengths = np.asarray(batch.lengths, dtype=np.int64)
            if rank == self.config.rank:
                self._loopback(op, batch.remote.peer, local, remote, lengths)
                continue
            with self._peer_locks[rank]:
                self._check_peer(rank, op)
                self._guarded(rank, op, self._exchange, op, rank, local, remote, lengths)

    def _exchange(self, op: str, rank: int, local: np.ndarray, remote: np.ndarray,
                  lengths: np.ndarray, deadline: float) -> None:
        import torch

        total = int(lengths.sum())
        header = torch.tensor([_MAGIC, _PUT if op == "put" else _GET, len(lengths), total],
                              dtype=torch.int64)
        ranges = torch.from_numpy(np.stack([remote, lengths], axis=1))
        works = [self._pg.send([header], rank, _T_HDR), self._pg.send([ranges], rank, _T_RANGES)]
        if op == "put":
            data = _gathered(local, lengths, total)
            works.append(self._pg.send([data], rank, _T_DATA))
        reply = torch.zeros(2, dtype=torch.int64)
        self._wait(self._pg.recv([reply], rank, _T_REPLY), deadline)
        for work in works:
            self._wait(work, deadline)
        status, bad = reply.tolist()
        if status != _OK:
            raise _reply_error(status, self.address_of(rank), op, local, remote, lengths, bad)
        if op == "get":
            contiguous = _is_contiguous(local, lengths)
            data = _view(int(local[0]), total) if contiguous else _staging(total)
            self._wait(self._pg.recv([data], rank, _T_REPLY_DATA), deadline)
            if not contiguous:
                copy_ranges(local, _starts(data, lengths), lengths)  # scatter

    def _send_notify(self, peer: str, message: bytes) -> None:
        import torch

        rank = self._rank_of(peer, "notify")
        if rank == self.config.rank:
            self._deliver(self.address, message)
            return
        header = torch.tensor([_MAGIC, _NOTIFY, 0, len(message)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(message) or bytearray(1), dtype=torch.uint8)

        def exchange(deadline: float) -> None:
            works = [self._pg.send([header], rank, _T_HDR), self._pg.send([payload], rank, _T_DATA)]
            reply = torch.zeros(2, dtype=torch.int64)
            self._wait(self._pg.recv([reply], rank, _T_REPLY), deadline)
            for work in works:
                self._wait(work, deadline)

        with self._peer_locks[rank]:
            self._check_peer(rank, "notify")
            self._guarded(rank, "notify", exchange)

    def _loopback(self, op: str, peer: str, local: np.ndarray, remote: np.ndarray,
                  lengths: np.ndarray) -> None:
        bad = self._regions.first_unregistered(remote, lengths)
        if bad is not None:
            raise _reply_error(_BAD_RANGE, peer, op, local, remote, lengths, bad)
        copy_ranges(*put_or_get(op, local, remote), lengths)

    # -- target side ---------------------------------------------------------------------------
    def _serve(self, rank: int) -> None:
        import torch

        header = torch.zeros(4, dtype=torch.int64)
        try:
            while True:
                self._pg.recv([header], rank, _T_HDR).wait(_IDLE_WAIT)
                magic, kind, num_ranges, total = header.tolist()
                deadline = time.monotonic() + self.timeout_s
                if magic != _MAGIC or kind not in (_PUT, _GET, _NOTIFY):
                    raise TransferError(self.backend, self.address_of(rank), "serve",
                                        f"malformed request header {header.tolist()}")
                if kind == _NOTIFY:
                    self._serve_notify(rank, total, deadline)
                else:
                    self._serve_transfer(rank, kind, num_ranges, total, deadline)
        except Exception as exc:  # the pair is closed: peer exited, timed out, or we close
            if not self._closing:
                self._dead.setdefault(rank, f"its connection closed ({_short(exc)})")

    def _serve_transfer(self, rank: int, kind: int, num_ranges: int, total: int,
                        deadline: float) -> None:
        import torch

        ranges = torch.zeros((num_ranges, 2), dtype=torch.int64)
        self._wait(self._pg.recv([ranges], rank, _T_RANGES), deadline)
        addrs, lengths = ranges[:, 0].numpy(), ranges[:, 1].numpy()
        if kind == _PUT:  # staged: nothing lands in our memory before its ranges are checked
            staging = _staging(total)
            self._wait(self._pg.recv([staging], rank, _T_DATA), deadline)
        bad = self._regions.first_unregistered(addrs, lengths)
        ok = bad is None and int(lengths.sum()) == total
        if ok and kind == _PUT:
            copy_ranges(addrs, _starts(staging, lengths), lengths)  # scatter into our memory
        reply = torch.tensor([_OK if ok else _BAD_RANGE, -1 if bad is None else bad])
        self._wait(self._pg.send([reply], rank, _T_REPLY), deadline)
        if ok and kind == _GET:
            data = _gathered(addrs, lengths, total)
            self._wait(self._pg.send([data], rank, _T_REPLY_DATA), deadline)

    def _serve_notify(self, rank: int, size: int, deadline: float) -> None:
        import torch

        payload = _staging(max(size, 1))
        self._wait(self._pg.recv([payload], rank, _T_DATA), deadline)
        ok = size <= MAX_NOTIFY_BYTES
        if ok:
            self._deliver(self.address_of(rank), payload[:size].numpy().tobytes())
        reply = torch.tensor([_OK if ok else _BAD_REQUEST, -1])
        self._wait(self._pg.send([reply], rank, _T_REPLY), deadline)

    # -- failure handling ----------------------------------------------------------------------
    def _rank_of(self, peer: str, op: str) -> int:
        kind, _, rest = peer.partition(":")
        world, _, rank = rest.partition("/")
        if kind != "torch" or world != self._world or not rank.isdigit():
            raise UnregisteredRangeError(self.backend, peer, op,
                                         f"not an engine of this torch transfer world "
                                         f"(torch:{self._world}/<rank>)")
        if int(rank) >= self.config.world_size:
            raise UnregisteredRangeError(self.backend, peer, op,
                                         f"rank {rank} outside world of {self.config.world_size}")
        return int(rank)

    def _check_peer(self, rank: int, op: str) -> None:
        if self._broken is not None:
            raise PeerUnreachableError(self.backend, self.address_of(rank), op,
                                       f"engine unusable: {self._broken}; create a new engine")
        if rank in self._dead:
            raise PeerUnreachableError(self.backend, self.address_of(rank), op, self._dead[rank])

    def _guarded(self, rank: int, op: str, fn: Any, *args: Any) -> None:
        """Run one exchange with ``rank``; gloo failures become kthena_comm exceptions."""
        try:
            fn(*args, time.monotonic() + self.timeout_s)
        except TransferError:  # the peer answered with a clear refusal: the pair is fine
            raise
        except _GlooTimeout as exc:
            self._broken = f"a wait timed out after {self.timeout_s}s, which closes every pair"
            raise TransferTimeoutError(self.backend, self.address_of(rank), op, str(exc)) from None
        except RuntimeError as exc:
            if self._broken is not None or self._closing:
                raise PeerUnreachableError(self.backend, self.address_of(rank), op,
                                           f"engine closing or unusable: {_short(exc)}") from None
            self._dead.setdefault(rank, f"peer closed the connection ({_short(exc)})")
            raise PeerUnreachableError(self.backend, self.address_of(rank), op,
                                       self._dead[rank]) from None

    def _wait(self, work: Any, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0.001:
            raise _GlooTimeout(f"deadline passed before the exchange finished ({self.timeout_s}s)")
        try:
            work.wait(timedelta(seconds=left))
        except RuntimeError as exc:
            if "Timed out" in str(exc):
                raise _GlooTimeout(_short(exc)) from None
            raise

    def _close_backend(self) -> None:
        self._closing = True
        alive = [r for r in range(self.config.world_size)
                 if r != self.config.rank and r not in self._dead]
        if alive:
            self._poison(alive[0])
        for thread in self._services:
            thread.join(_CLOSE_JOIN_S)
        self._pg = None
        self._store = None

    def _poison(self, rank: int) -> None:
        """Close every pair of our gloo context (see the module docstring), waking the services."""
        import torch

        try:
            self._pg.recv([torch.zeros(1)], rank, _T_POISON).wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the expected timeout


class _GlooTimeout(Exception):
    """A gloo wait ran past its deadline (internal; surfaces as TransferTimeoutError)."""


def _connect(config: TorchConfig) -> tuple[Any, Any, str]:
    """Store, private gloo group and world id (rank 0 draws it) for ``config``."""
    import torch.distributed as dist

    from kthena_comm.store import open_store

    timeout = timedelta(seconds=config.connect_timeout_s)
    where = f"{config.master_addr}:{config.master_port}"
    try:
        store = config.store if config.store is not None else open_store(
            config.master_addr, config.master_port, config.world_size, config.rank == 0, timeout)
        store = dist.PrefixStore(config.prefix, store)
        if config.rank == 0:
            store.set("world", secrets.token_hex(4))
        world = store.get("world").decode()
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=config.host)]
        options._timeout = timeout
        group = dist.ProcessGroupGloo(dist.PrefixStore(world, store), config.rank,
                                      config.world_size, options)
    except Exception as exc:  # torch raises DistNetworkError / DistStoreError / RuntimeError
        raise InitError(config.rank, where, "MASTER_ADDR/MASTER_PORT/WORLD_SIZE",
                        f"torch transfer world did not form: {_short(exc)}") from exc
    return store, group, world


def _staging(nbytes: int) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8)


def _view(addr: int, nbytes: int) -> Any:
    """A uint8 tensor over ``nbytes`` of memory at ``addr`` (registered memory only)."""
    import torch

    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def _is_contiguous(addrs: np.ndarray, lengths: np.ndarray) -> bool:
    return bool((addrs[1:] == addrs[:-1] + lengths[:-1]).all())


def _gathered(addrs: np.ndarray, lengths: np.ndarray, total: int) -> Any:
    """The ranges back to back: a view when they already are, else a staging copy."""
    if _is_contiguous(addrs, lengths):
        return _view(int(addrs[0]), total)
    staging = _staging(total)
    copy_ranges(_starts(staging, lengths), addrs, lengths)
    return staging


def _starts(staging: Any, lengths: np.ndarray) -> np.ndarray:
    """Address of each range inside a staging tensor that holds them back to back."""
    offsets = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(np.int64)
    return staging.data_ptr() + offsets


def _reply_error(status: int, peer: str, op: str, local: np.ndarray, remote: np.ndarray,
                 lengths: np.ndarray, bad: int) -> TransferError:
    if status == _BAD_RANGE and 0 <= bad < len(lengths):
        return UnregisteredRangeError(
            "torch", peer, op, f"the peer has no registered memory at [{int(remote[bad]):#x}, "
            f"{int(remote[bad] + lengths[bad]):#x}) (range {bad}): it unregistered it, or the "
            "handle is forged or stale")
    return TransferError("torch", peer, op, f"the peer rejected the request (status {status})")


def _short(exc: BaseException) -> str:
    text = str(exc).split("] ", 1)[-1]  # drop gloo's source location prefix
    return text.split(". This is typically")[0][:200]


register_backend(BackendEntry("torch", TorchEngine))  # torch is a dependency of kthena_comm
