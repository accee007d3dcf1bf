"""``local`` backend: engines in one process, a put or get is one memcpy.

Engines that should see each other's memory share a ``LocalFabric`` (passed in their config);
a remote handle is valid while its owner keeps it registered on that fabric. Used by tests and
by single-process deployments where prefill and decode share an address space.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import attrs

from kthena_comm.errors import UnregisteredRangeError
from kthena_comm.transfer._base import BaseEngine
from kthena_comm.transfer._memory import RawBuffer, memcpy
from kthena_comm.transfer.engine import BackendEntry, register_backend
from kthena_comm.transfer.handle import MemoryHandle, TransferOp

_FABRIC_IDS = itertools.count()


class LocalFabric:
    """The set of memory regions local engines may address in this process."""

    def __init__(self) -> None:
        self.name = f"local:{next(_FABRIC_IDS)}"
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}

    def add(self, addr: int, nbytes: int) -> None:
        with self._lock:
            self._regions[addr] = nbytes

    def remove(self, addr: int) -> None:
        with self._lock:
            self._regions.pop(addr, None)

    def covers(self, handle: MemoryHandle) -> bool:
        with self._lock:
            return self._regions.get(handle.base_addr, -1) >= handle.length


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

    @property
    def address(self) -> str:
        return self._fabric.name

    def _register_raw(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        self._fabric.add(raw.addr, raw.nbytes)
        return MemoryHandle(self.backend, self.address, raw.addr, raw.nbytes, layout_id=layout_id)

    def _unregister_raw(self, handle: MemoryHandle, raw: RawBuffer) -> None:
        self._fabric.remove(handle.base_addr)

    def _transfer(self, op: str, ops: Sequence[TransferOp]) -> None:
        for item in ops:
            if item.remote.peer != self.address or not self._fabric.covers(item.remote):
                raise UnregisteredRangeError(self.backend, item.remote.peer, op,
                                             "remote memory is not registered on this fabric")
        for item in ops:
            local = item.local.base_addr + item.local_offset
            remote = item.remote.base_addr + item.remote_offset
            dst, src = (remote, local) if op == "put" else (local, remote)
            memcpy(dst, src, item.length)

    def _close_backend(self) -> None:
        """Nothing beyond unregistering, which the base class does."""


register_backend(BackendEntry("local", LocalEngine))
