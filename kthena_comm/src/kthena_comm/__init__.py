"""kthena_comm: how ranks talk and how KV moves.

* process groups from a parallel layout (``init_parallel_groups``), backend chosen by device;
* collectives, sync or async, and a bucketed all-reduce (``kthena_comm.collectives``);
* one-sided transfer (``kthena_comm.transfer``): ``TransferEngine`` with local, shm, mooncake
  and torch backends.

Names are imported lazily so that ``import kthena_comm.transfer`` does not load torch.
"""

from __future__ import annotations

from kthena_core.lazy import lazy_exports

_EXPORTS = {
    "CommError": "errors", "EngineClosedError": "errors", "InitError": "errors",
    "LayoutError": "errors", "PeerUnreachableError": "errors", "RankEnvError": "errors",
    "TransferError": "errors", "TransferTimeoutError": "errors",
    "UnknownBackendError": "errors", "UnregisteredRangeError": "errors",
    "TransportUnavailableError": "errors",
    "Rank": "layout", "group_ranks": "layout", "RankEnv": "env",
    "DeviceBackend": "device", "backend_for_device": "device", "device_backends": "device",
    "device_count": "device", "local_device": "device", "register_device_backend": "device",
    "DeviceUnavailableError": "errors",
    "CommGroup": "groups", "GroupConfig": "groups", "ParallelGroups": "groups",
    "init_parallel_groups": "groups", "PeerCheck": "groups", "hccl_comm_name": "hccl",
    "Handle": "collectives", "all_gather": "collectives", "all_reduce": "collectives",
    "all_to_all": "collectives", "barrier": "collectives", "broadcast": "collectives",
    "recv": "collectives", "reduce_scatter": "collectives", "send": "collectives",
    "bucketed_all_reduce": "bucketing", "plan_buckets": "bucketing",
    "MemoryHandle": "transfer", "TransferEngine": "transfer", "TransferFuture": "transfer",
    "TransferOp": "transfer", "create_engine": "transfer", "available_backends": "transfer",
    "TransferBatch": "transfer", "Notification": "transfer", "Notifier": "transfer",
    "MemoryLocation": "transfer", "DeviceBuffer": "transfer",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
