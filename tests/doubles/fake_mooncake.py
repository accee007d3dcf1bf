"""TEST DOUBLE for ``mooncake.engine``: a TransferEngine that records calls and moves nothing.

It stands in for Mooncake builds this machine does not have (CUDA, ascend_direct), so tests can
assert the calls our backend makes: the order (environment, NPU selection, constructor,
``initialize``), the arguments (host name form, protocol, ``register_memory`` locations) and
which verb a put or get uses (WRITE / READ). The build flags are the documented module
attributes (``SUPPORT_CUDA`` ...); ascend_direct is signalled the way the real library shows
it, by the transport's class name inside the module's library file, which the double writes to
a temporary folder. Passing against this double is never evidence that Mooncake works so.
"""

from __future__ import annotations

import enum
import os
import sys
import types
from pathlib import Path
from typing import Any

ENV_KEYS = ("ASCEND_CONNECT_TIMEOUT", "ASCEND_TRANSFER_TIMEOUT", "ASCEND_USE_ASYNC_TRANSFER",
            "HCCL_INTRA_ROCE_ENABLE", "MC_TRANSFER_TIMEOUT")


class CallLog:
    """Calls in order, shared with other doubles (fake_torch_npu) so order across them shows."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def add(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]

    def of(self, name: str) -> list[tuple[tuple, dict]]:
        return [(args, kwargs) for op, args, kwargs in self.calls if op == name]


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


class TransferNotify:
    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name, self.msg = name, msg


def make_module(log: CallLog, folder: Path, *, cuda: bool = False, mnnvl: bool = False,
                intra_nvlink: bool = False, ascend_direct: bool = False,
                transfer_rc: int = 0, probe_rc: int = 0) -> types.ModuleType:
    """A ``mooncake.engine`` double; ``transfer_rc`` is what every transfer call returns."""
    library = folder / "engine.so"
    payload = b"\x7fELF test double" + (b" N8mooncake21AscendDirectTransportE" if ascend_direct
                                         else b" N8mooncake12TcpTransportE")
    library.write_bytes(payload)

    class TransferEngine:
        def __init__(self) -> None:
            log.add("TransferEngine()", env={k: os.environ.get(k) for k in ENV_KEYS})

        def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str) -> int:
            log.add("initialize", local_hostname, metadata_server, protocol, device_name)
            return 0

        def get_rpc_port(self) -> int:
            return 15000

        def register_memory(self, addr: int, capacity: int, location: str = "*") -> int:
            log.add("register_memory", addr, capacity, location)
            return 0

        def unregister_memory(self, addr: int) -> int:
            log.add("unregister_memory", addr)
            return 0

        def batch_transfer_sync_write(self, peer, local, remote, lengths) -> int:
            log.add("batch_transfer_sync_write", peer, local, remote, lengths)
            return transfer_rc

        def batch_transfer_sync_read(self, peer, local, remote, lengths) -> int:
            log.add("batch_transfer_sync_read", peer, local, remote, lengths)
            return transfer_rc

        def batch_transfer_async_write(self, peer, local, remote, lengths) -> int:
            log.add("batch_transfer_async_write", peer, local, remote, lengths)
            return 1

        def batch_transfer_async_read(self, peer, local, remote, lengths) -> int:
            log.add("batch_transfer_async_read", peer, local, remote, lengths)
            return 1

        def get_batch_transfer_status(self, batch_ids) -> int:
            log.add("get_batch_transfer_status", batch_ids)
            return transfer_rc

        def send_probe(self, peer: str) -> int:
            log.add("send_probe", peer)
            return probe_rc

        def get_notifies(self) -> list:
            return []

    module = types.ModuleType("mooncake.engine")
    module.__file__ = str(library)
    module.__doc__ = "TEST DOUBLE of mooncake.engine (tests/doubles/fake_mooncake.py)"
    module.TransferEngine = TransferEngine
    module.TransferOpcode = TransferOpcode
    module.TransferNotify = TransferNotify
    module.SUPPORT_CUDA, module.SUPPORT_MNNVL = cuda, mnnvl
    module.SUPPORT_INTRA_NVLINK = intra_nvlink
    return module


def install(monkeypatch: Any, folder: Path, **options: Any) -> CallLog:
    """Put a double in ``sys.modules["mooncake.engine"]``; returns its call log."""
    log = CallLog()
    monkeypatch.setitem(sys.modules, "mooncake.engine", make_module(log, folder, **options))
    return log
