"""One-sided transfer: the ``TransferEngine`` protocol, its value types and its backends.

Importing this package needs neither torch nor Mooncake; the mooncake backend imports its wheel
when an engine is created.
"""

from kthena_comm.transfer.engine import (
    BackendEntry,
    TransferEngine,
    TransferFuture,
    available_backends,
    create_engine,
    register_backend,
    wait_all,
)
from kthena_comm.transfer.handle import MemoryHandle, TransferOp
from kthena_comm.transfer.local import LocalConfig, LocalEngine, LocalFabric
from kthena_comm.transfer.mooncake import MooncakeConfig, MooncakeEngine
from kthena_comm.transfer.shm import ShmConfig, ShmEngine

__all__ = [
    "BackendEntry", "LocalConfig", "LocalEngine", "LocalFabric", "MemoryHandle",
    "MooncakeConfig", "MooncakeEngine", "ShmConfig", "ShmEngine", "TransferEngine",
    "TransferFuture", "TransferOp", "available_backends", "create_engine", "register_backend",
    "wait_all",
]
