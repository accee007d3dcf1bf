"""One-sided transfer: the ``TransferEngine`` protocol, its value types and its backends.

Importing this package needs neither torch nor Mooncake; the mooncake and torch backends import
their libraries when an engine is created.
"""

from kthena_comm.transfer._ascend import AscendDirectConfig
from kthena_comm.transfer.batch import TransferBatch
from kthena_comm.transfer.engine import (
    MAX_NOTIFY_BYTES,
    BackendEntry,
    Notification,
    Notifier,
    TransferEngine,
    TransferFuture,
    available_backends,
    create_engine,
    register_backend,
    wait_all,
)
from kthena_comm.transfer.handle import MemoryHandle, TransferOp
from kthena_comm.transfer.local import LocalConfig, LocalEngine, LocalFabric
from kthena_comm.transfer.memory import HOST, DeviceBuffer, MemoryLocation
from kthena_comm.transfer.mooncake import MooncakeConfig, MooncakeEngine
from kthena_comm.transfer.shm import ShmConfig, ShmEngine
from kthena_comm.transfer.torch_p2p import TorchConfig, TorchEngine

__all__ = [
    "HOST", "MAX_NOTIFY_BYTES", "AscendDirectConfig", "BackendEntry", "DeviceBuffer",
    "LocalConfig", "LocalEngine", "LocalFabric", "MemoryHandle", "MemoryLocation",
    "MooncakeConfig", "MooncakeEngine", "Notification", "Notifier", "ShmConfig", "ShmEngine",
    "TorchConfig", "TorchEngine", "TransferBatch", "TransferEngine", "TransferFuture",
    "TransferOp", "available_backends", "create_engine", "register_backend", "wait_all",
]
