"""``mooncake`` backend: the Mooncake Transfer Engine (TCP here, RDMA on clusters, the
ascend_direct transport on Ascend, which is Mooncake's path to CANN HIXL/ADXL there).

This module is the binding boundary: Mooncake's integer return codes become kthena_comm
exceptions here and nowhere else (families in _status.py). Every blocking Mooncake call runs on
a worker thread with a deadline, so a hung peer yields ``TransferTimeoutError`` rather than a
hang. ``put`` is Mooncake WRITE (local -> remote), ``get`` is READ.

Memory: host memory on any build; CUDA memory only on a wheel built with CUDA (and, for the
``nvlink`` / ``nvlink_intra`` protocols, with those transports); NPU memory only over the
ascend_direct transport (``protocol="ascend"`` with an ``AscendDirectConfig``), on a build with
``-DUSE_ASCEND_DIRECT=ON``. What the installed wheel has is read from it (_mooncake_build.py);
anything else is refused at ``register`` (or, for an ascend config, at construction) with
``TransportUnavailableError`` naming the missing build. The Ascend set-up order is in _ascend.py.

Notify: Mooncake attaches a ``TransferNotify`` to a transfer and delivers it to the target's
``get_notifies`` after the bytes (it rejects an empty batch), so ``notify`` reads one byte of
memory the peer registered — a handle given to ``notify``, or the last one this engine moved
bytes to — with the message attached. Payloads travel base64-encoded (Mooncake takes text).

Note: with the P2PHANDSHAKE metadata mode Mooncake's RPC and data sockets listen on all
interfaces (0.0.0.0, [::]), whatever ``host`` says; ``host`` is only the address advertised to
peers. Construct the engine inside ``mooncake_kv.listen.confine_listeners(host)`` to keep them
on ``host`` (kthena_serve's PD workers do); otherwise firewall the port range.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import importlib
import importlib.util
import os
import time
from collections.abc import Sequence
from itertools import groupby
from types import ModuleType
from typing import Any

import attrs
import numpy as np

from kthena_comm.device import device_backend
from kthena_comm.errors import TransferError, TransportUnavailableError
from kthena_comm.transfer._ascend import (
    AscendDirectConfig,
    apply_environment,
    ascend_environment,
    mc_transfer_timeout_s,
)
from kthena_comm.transfer._base import BaseEngine
from kthena_comm.transfer._memory import RawBuffer
from kthena_comm.transfer._mooncake_build import MooncakeBuild, detect_build, register_location
from kthena_comm.transfer._status import mooncake_error
from kthena_comm.transfer.batch import Column, Ranges
from kthena_comm.transfer.engine import BackendEntry, TransferFuture, register_backend
from kthena_comm.transfer.handle import MemoryHandle
from kthena_comm.transfer.memory import MemoryLocation
from kthena_comm.transfer.tcp_queues import SocketBacklog, host_addresses, socket_backlog


@attrs.frozen
class MooncakeConfig:
    """Arguments of Mooncake's ``initialize`` plus a per-batch deadline.

    ``protocol="ascend"`` needs ``ascend`` (the NPU and the transport's settings); ``ascend``
    needs ``protocol="ascend"``.
    """

    host: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    timeout_s: float = 10.0
    max_batch_ops: int = 512
    """Ranges per Mooncake call: its TCP lanes reject slices beyond their queue depth."""
    ascend: AscendDirectConfig | None = None

    def __attrs_post_init__(self) -> None:
        if (self.protocol == "ascend") != (self.ascend is not None):
            raise ValueError("MooncakeConfig: protocol='ascend' and ascend=AscendDirectConfig("
                             "device_id=N) go together; give both or neither")
        if self.ascend is not None and self.timeout_s <= mc_transfer_timeout_s(self.ascend):
            raise ValueError(f"MooncakeConfig.timeout_s={self.timeout_s} must exceed "
                             f"MC_TRANSFER_TIMEOUT={mc_transfer_timeout_s(self.ascend)}s (derived "
                             "from ascend.transfer_timeout_ms), so Mooncake gives up first")


def is_available() -> bool:
    """True when the Mooncake wheel is importable (it also needs libibverbs1 at load time)."""
    return importlib.util.find_spec("mooncake") is not None


def installed_build() -> MooncakeBuild:
    """The transports of the installed Mooncake wheel, read from it (imports Mooncake).

    Raises:
        ImportError: Mooncake is not installed.
    """
    return detect_build(_engine_module())


def _engine_module() -> ModuleType:
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise ImportError("the mooncake backend needs `pip install kthena-comm[mooncake]` "
                          "and the libibverbs1 system package") from exc


_CONNECTION_POOL = "MC_TCP_ENABLE_CONNECTION_POOL"


class MooncakeEngine(BaseEngine):
    """Transfer engine over ``mooncake.engine.TransferEngine``."""

    backend = "mooncake"
    sync_in_caller = False

    def __init__(self, config: MooncakeConfig | None = None) -> None:
        self.config = config or MooncakeConfig()
        module = _engine_module()
        self.build: MooncakeBuild = detect_build(module)
        """The transports of the installed wheel (what ``register`` may accept)."""
        c = self.config
        if c.ascend is not None:  # before any side effect: env, device, engine
            if not self.build.ascend_direct:
                raise TransportUnavailableError(self.backend, "protocol 'ascend'",
                                                self.build.missing_ascend())
            apply_environment(ascend_environment(c.ascend))
            device_backend("npu").prepare(c.ascend.device_id)  # Mooncake: set_device first
        # One TCP connection per slice, closed when the slice ends (Mooncake's TCP transport
        # reads this when the engine is made): an open connection then means a slice still
        # moving bytes, which is what `wire_backlog` needs to say that a failed transfer is over
        # (pooled connections stay open idle and hide it). A value the user set is kept.
        os.environ.setdefault(_CONNECTION_POOL, "0")
        super().__init__(c.timeout_s, num_workers=4)
        self._engine: Any = module.TransferEngine()
        rc = self._engine.initialize(c.host, c.metadata_server, c.protocol, c.device_name)
        self._check(rc, c.metadata_server, "initialize")
        self._address = f"{c.host}:{self._engine.get_rpc_port()}"
        self._transport_timeout_s = c.ascend.transfer_timeout_s if c.ascend else None
        self._known_remote: dict[str, MemoryHandle] = {}  # peer -> a handle it registered
        self._notify_target: dict[str, MemoryHandle] = {}
        self._scratch = ctypes.create_string_buffer(64)  # local side of a notify's 1-byte read
        self._scratch_addr = ctypes.addressof(self._scratch)
        self._check(self._engine.register_memory(self._scratch_addr, 64, "*"), self.address,
                    "register")

    @property
    def address(self) -> str:
        return self._address

    def _check_memory(self, location: MemoryLocation) -> None:
        npu_id = self.config.ascend.device_id if self.config.ascend else None
        reason = self.build.refusal(location, self.config.protocol, npu_id)
        if reason is not None:
            raise TransportUnavailableError(self.backend, f"{location} memory", reason)

    def _register_raw(self, raw: RawBuffer, layout_id: str | None) -> MemoryHandle:
        rc = self._engine.register_memory(raw.addr, raw.nbytes, register_location(raw.location))
        self._check(rc, self.address, "register")
        return MemoryHandle(self.backend, self.address, raw.addr, raw.nbytes, layout_id=layout_id,
                            location=str(raw.location))

    def _unregister_raw(self, handle: MemoryHandle, raw: RawBuffer) -> None:
        self._check(self._engine.unregister_memory(handle.base_addr), self.address, "unregister")

    def _transfer(self, op: str, batches: Sequence[Ranges]) -> None:
        call = (self._engine.batch_transfer_sync_write if op == "put"   # put = WRITE
                else self._engine.batch_transfer_sync_read)             # get = READ
        for peer, columns in _by_peer(batches):
            self._known_remote[peer] = columns.handle
            for start in range(0, len(columns.lengths), self.config.max_batch_ops):
                chunk = columns.slice(start, start + self.config.max_batch_ops)
                began = time.monotonic()
                self._check_transfer(call(peer, *chunk), peer, op, began)

    def _submit_validated(self, op: str, batches: list[Ranges]) -> TransferFuture:
        if sum(len(b) for b in batches) > self.config.max_batch_ops:  # chunk on a worker
            return super()._submit_validated(op, batches)
        # Submit each peer's batch now (Mooncake's own async path), wait on a worker thread.
        call = (self._engine.batch_transfer_async_write if op == "put"
                else self._engine.batch_transfer_async_read)
        batch_ids, began = [], time.monotonic()
        for peer, columns in _by_peer(batches):
            self._known_remote[peer] = columns.handle
            batch_id = call(peer, *columns.slice(0, len(columns.lengths)))
            if batch_id == 0:
                self._check_transfer(-1, peer, op, began)
            batch_ids.append((peer, batch_id))
        inner = self._executor.submit(self._await_batches, op, batch_ids, began)
        return TransferFuture(inner, self.backend, ",".join(p for p, _ in batch_ids), op,
                              self.timeout_s)

    def wire_backlog(self, peer: MemoryHandle) -> SocketBacklog | None:
        """This process's kernel queues on its TCP sockets to ``peer``'s host: a put or get
        that Mooncake reported failed (a timeout on a partitioned link) may still deliver
        what its sockets hold once the link heals (`tcp_queues`). None off Linux (unknown)."""
        backlog = socket_backlog(host_addresses(peer.peer))
        if backlog is not None and os.environ.get(_CONNECTION_POOL, "0").lower() not in (
                "0", "false", "no"):
            # pooled connections stay open idle: an open one says nothing; count them as busy
            return attrs.evolve(backlog, outgoing=max(backlog.outgoing, 1))
        return backlog

    def _send_notify(self, peer: str, message: bytes) -> None:
        handle = self._notify_target.pop(peer, None) or self._known_remote.get(peer)
        if handle is None:
            raise TransferError(self.backend, peer, "notify",
                                "Mooncake sends a notify with a transfer: pass a MemoryHandle "
                                "the peer registered, or move bytes to that peer first")
        from mooncake.engine import TransferNotify, TransferOpcode

        note = TransferNotify(self.address, base64.b64encode(message).decode("ascii"))
        began = time.monotonic()
        rc = self._engine.batch_transfer_sync(peer, [self._scratch_addr], [handle.base_addr], [1],
                                              TransferOpcode.Read, note)
        self._check_transfer(rc, peer, "notify", began)

    def notify(self, peer: MemoryHandle | str, message: bytes) -> None:
        if isinstance(peer, MemoryHandle):  # remember which of its memories to ride on
            self._notify_target[peer.peer] = peer
        super().notify(peer, message)

    def _pull_notifies(self) -> None:
        engine = self._engine
        for note in engine.get_notifies() if engine is not None else ():
            try:
                message = base64.b64decode(note.msg, validate=True)
            except (binascii.Error, ValueError):
                message = note.msg.encode()  # a sender that is not kthena_comm
            self._deliver(note.name, message)

    def _await_batches(self, op: str, batch_ids: list[tuple[str, int]], began: float) -> None:
        for peer, batch_id in batch_ids:
            rc = self._engine.get_batch_transfer_status([batch_id])
            self._check_transfer(rc, peer, op, began)

    def _check_transfer(self, rc: int, peer: str, op: str, began: float) -> None:
        if rc >= 0:
            return
        raise mooncake_error(rc, self.backend, peer, op,
                             peer_answers=self._engine.send_probe(peer) == 0,
                             elapsed_s=time.monotonic() - began,
                             transport_timeout_s=self._transport_timeout_s)

    def _check(self, rc: int, peer: str, op: str) -> None:
        if rc != 0:
            raise TransferError(self.backend, peer, op, f"Mooncake returned {rc}")

    def _close_backend(self) -> None:
        self._engine.unregister_memory(self._scratch_addr)
        self._engine = None  # the binding's destructor stops Mooncake's threads and sockets


class _PeerColumns:
    """Absolute address columns of every range going to one peer."""

    def __init__(self, batches: list[Ranges]) -> None:
        self.handle = batches[-1].remote
        self.local = np.concatenate([_addrs(b.local, b.local_offsets) for b in batches])
        self.remote = np.concatenate([_addrs(b.remote, b.remote_offsets) for b in batches])
        self.lengths = np.concatenate([np.asarray(b.lengths, dtype=np.int64) for b in batches])

    def slice(self, start: int, stop: int) -> tuple[list[int], list[int], list[int]]:
        return (self.local[start:stop].tolist(), self.remote[start:stop].tolist(),
                self.lengths[start:stop].tolist())


def _addrs(handle: MemoryHandle, offsets: Column) -> np.ndarray:
    return handle.base_addr + np.asarray(offsets, dtype=np.int64)


def _by_peer(batches: Sequence[Ranges]) -> list[tuple[str, _PeerColumns]]:
    ordered = sorted(batches, key=lambda b: b.remote.peer)
    return [(peer, _PeerColumns(list(group)))
            for peer, group in groupby(ordered, key=lambda b: b.remote.peer)]


register_backend(BackendEntry("mooncake", MooncakeEngine, is_available))
