"""``local`` backend: engines in one process, a put or get is one memcpy per merged range.

Engines that should see each other's memory share a ``LocalFabric`` (passed in their config);
a remote handle is valid while its owner keeps it registered on that fabric. Each engine has its
own address on the fabric, which is also where its notify messages are delivered. Used by tests
and by single-process deployments where prefill and decode share an address space.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import attrs

from kthena_comm.errors import PeerUnreachableError, UnregisteredRangeError
from kthena_comm.transfer._base import BaseEngine
from kthena_comm.transfer._memory import RawBuffer
from kthena_comm.transfer.batch import Ranges, copy_batch
from kthena_comm.transfer.engine import BackendEntry, register_backend
from kthena_comm.transfer.handle import MemoryHandle

_FABRIC_IDS = itertools.count()


class LocalFabric:
    """The memory regions and mailboxes local engines may address in this process."""

    def __init__(self) -> None:
        self.name = f"local:{next(_FABRIC_IDS)}"
        self._lock = threading.Lock()
        self._engine_ids = itertools.count()
        self._regions: dict[int, tuple[int, str]] = {}
        self._mailboxes: dict[str, Callable[[str, bytes], None]] = {}

    def join(self, deliver: Callable[[str, bytes], None]) -> str:
        """A new engine address on this fabric; ``deliver`` receives its notify messages."""
        with self._lock:
            address = f"{self.name}/{next(self._engine_ids)}"
            self._mailboxes[address] = deliver
        return address

    def leave(self, address: str) -> None:
        with self._lock:
            self._mailboxes.pop(address, None)

    def add(self, addr: int, nbytes: int, owner: str) -> None:
        with self._lock:
            self._regions[addr] = (nbytes, owner)

    def remove(self, addr: int) -> None:
        with self._lock:
            self._regions.pop(addr, None)

    def covers(self, handle: MemoryHandle) -> bool:
        with self._lock:
            nbytes, owner = self._regions.get(handle.base_addr, (-1, ""))
        return owner == handle.peer and nbytes >= handle.length

    def mailbox(self, address: str) -> Callable[[str, bytes], None] | None:
        with self._lock:
            return self._mailboxes.get(address)


@attrs.frozen
class LocalConfig:
    """``fabric``: shared with the engines to talk to (default: a private one)."""

    fabric: LocalFabric = attrs.field(factory=LocalFabric, eq=False)
    timeout_s: float = 10.0


class LocalEngine(BaseEngine):
    """Same-process transfer engine."""

    backend = "local"

    def __init__(self, config: LocalConfig | None = None) -> None:
        config = config or LocalConfig()
        super().__init__(config.timeout_s)
        self._fabric = config.fabric
        self._address = self._fabric.join(self._deliver)

    @property
    def address(self) -> str:
        return self._address

    def _register_raw(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        self._fabric.add(raw.addr, raw.nbytes, self.address)
        return MemoryHandle(self.backend, self.address, raw.addr, raw.nbytes, layout_id=layout_id)

    def _unregister_raw(self, handle: MemoryHandle, raw: RawBuffer) -> None:
        self._fabric.remove(handle.base_addr)

    def _transfer(self, op: str, batches: Sequence[Ranges]) -> None:
        for batch in batches:
            if not self._fabric.covers(batch.remote):
                raise UnregisteredRangeError(self.backend, batch.remote.peer, op,
                                             "remote memory is not registered on this fabric")
        for batch in batches:
            copy_batch(op, batch, batch.local.base_addr, batch.remote.base_addr)

    def _send_notify(self, peer: str, message: bytes) -> None:
        deliver = self._fabric.mailbox(peer)
        if deliver is None:
            raise PeerUnreachableError(self.backend, peer, "notify",
                                       "no open engine has that address on this fabric")
        deliver(self.address, message)

    def _close_backend(self) -> None:
        self._fabric.leave(self.address)


register_backend(BackendEntry("local", LocalEngine))
