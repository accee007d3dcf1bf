"""``mooncake`` backend: the Mooncake Transfer Engine (TCP here, RDMA on clusters, ``ascend``
transport on Ascend, which is Mooncake's path to HIXL there).

This module is the binding boundary: Mooncake's integer return codes become kthena_comm
exceptions here and nowhere else. Every blocking Mooncake call runs on a worker thread with a
deadline, so a hung peer yields ``TransferTimeoutError`` rather than a hang.

Note: with the P2PHANDSHAKE metadata mode Mooncake's RPC and data sockets listen on all
interfaces (0.0.0.0), whatever ``host`` says; ``host`` is only the address advertised to peers.
Firewall the port range on multi-tenant hosts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from itertools import groupby
from typing import Any

import attrs

from kthena_comm.errors import (
    PeerUnreachableError,
    TransferError,
    UnregisteredRangeError,
)
from kthena_comm.transfer._base import BaseEngine
from kthena_comm.transfer._memory import RawBuffer
from kthena_comm.transfer.engine import BackendEntry, TransferFuture, register_backend
from kthena_comm.transfer.handle import MemoryHandle, TransferOp


@attrs.frozen
class MooncakeConfig:
    """Arguments of Mooncake's ``initialize`` plus a per-batch deadline."""

    host: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    timeout_s: float = 10.0
    max_batch_ops: int = 512
    """Ranges per Mooncake call: its TCP lanes reject slices beyond their queue depth."""


def is_available() -> bool:
    """True when the Mooncake wheel is importable (it also needs libibverbs1 at load time)."""
    return importlib.util.find_spec("mooncake") is not None


class MooncakeEngine(BaseEngine):
    """Transfer engine over ``mooncake.engine.TransferEngine``."""

    backend = "mooncake"
    sync_in_caller = False

    def __init__(self, config: MooncakeConfig | None = None) -> None:
        self.config = config or MooncakeConfig()
        super().__init__(self.config.timeout_s, num_workers=4)
        try:
            from mooncake.engine import TransferEngine as _Engine
        except ImportError as exc:
            raise ImportError("the mooncake backend needs `pip install kthena-comm[mooncake]` "
                              "and the libibverbs1 system package") from exc
        self._engine: Any = _Engine()
        c = self.config
        rc = self._engine.initialize(c.host, c.metadata_server, c.protocol, c.device_name)
        self._check(rc, c.metadata_server, "initialize")
        self._address = f"{c.host}:{self._engine.get_rpc_port()}"

    @property
    def address(self) -> str:
        return self._address

    def _register_raw(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        self._check(self._engine.register_memory(raw.addr, raw.nbytes), self.address, "register")
        return MemoryHandle(self.backend, self.address, raw.addr, raw.nbytes, layout_id=layout_id)

    def _unregister_raw(self, handle: MemoryHandle, raw: RawBuffer) -> None:
        self._check(self._engine.unregister_memory(handle.base_addr), self.address, "unregister")

    def _transfer(self, op: str, ops: Sequence[TransferOp]) -> None:
        call = (self._engine.batch_transfer_sync_write if op == "put"
                else self._engine.batch_transfer_sync_read)
        for peer, batch in _by_peer(ops):
            for start in range(0, len(batch), self.config.max_batch_ops):
                chunk = batch[start: start + self.config.max_batch_ops]
                self._check_transfer(call(peer, *_columns(chunk)), peer, op)

    def _submit_validated(self, op: str, ops: list[TransferOp]) -> TransferFuture:
        if len(ops) > self.config.max_batch_ops:  # too big for one submission: chunk on a worker
            return super()._submit_validated(op, ops)
        # Submit each peer's batch now (Mooncake's own async path), wait on a worker thread.
        call = (self._engine.batch_transfer_async_write if op == "put"
                else self._engine.batch_transfer_async_read)
        batch_ids = []
        for peer, batch in _by_peer(ops):
            batch_id = call(peer, *_columns(batch))
            if batch_id == 0:
                self._check_transfer(-1, peer, op)
            batch_ids.append((peer, batch_id))
        inner = self._executor.submit(self._await_batches, op, batch_ids)
        return TransferFuture(inner, self.backend, ",".join(p for p, _ in batch_ids), op,
                              self.timeout_s)

    def _await_batches(self, op: str, batch_ids: list[tuple[str, int]]) -> None:
        for peer, batch_id in batch_ids:
            self._check_transfer(self._engine.get_batch_transfer_status([batch_id]), peer, op)

    def _check_transfer(self, rc: int, peer: str, op: str) -> None:
        if rc >= 0:
            return
        if self._engine.send_probe(peer) != 0:
            raise PeerUnreachableError(self.backend, peer, op,
                                       f"Mooncake returned {rc} and the peer does not answer")
        raise UnregisteredRangeError(self.backend, peer, op,
                                     f"Mooncake returned {rc} while the peer answers probes: it "
                                     "rejected a range it has not registered (or the local "
                                     "transport queue overflowed; see Mooncake's log)")

    def _check(self, rc: int, peer: str, op: str) -> None:
        if rc != 0:
            raise TransferError(self.backend, peer, op, f"Mooncake returned {rc}")

    def _close_backend(self) -> None:
        self._engine = None  # the binding's destructor stops Mooncake's threads and sockets


def _by_peer(ops: Sequence[TransferOp]) -> list[tuple[str, list[TransferOp]]]:
    ordered = sorted(ops, key=lambda o: o.remote.peer)
    return [(peer, list(batch)) for peer, batch in groupby(ordered, key=lambda o: o.remote.peer)]


def _columns(batch: Sequence[TransferOp]) -> tuple[list[int], list[int], list[int]]:
    return ([o.local.base_addr + o.local_offset for o in batch],
            [o.remote.base_addr + o.remote_offset for o in batch],
            [o.length for o in batch])


register_backend(BackendEntry("mooncake", MooncakeEngine, is_available))
