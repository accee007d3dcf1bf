"""Registry of collective backends by device type: cpu → gloo, cuda → nccl, npu → hccl.

Each entry knows how to get its device ready for a rank (select the local device, and for Ascend
import torch_npu, which registers the ``hccl`` backend with torch.distributed). New device types
register an entry instead of growing an if/elif chain.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import attrs

from kthena_comm.errors import UnknownBackendError


@attrs.frozen
class DeviceBackend:
    """How one device type runs collectives."""

    device_type: str
    backend: str
    prepare: Callable[[int], None] = attrs.field(eq=False)
    """Called with the rank's LOCAL_RANK before ``init_process_group``."""


def _prepare_cpu(local_rank: int) -> None:
    """Nothing to select on a CPU."""


def _prepare_cuda(local_rank: int) -> None:
    import torch

    torch.cuda.set_device(local_rank)


def _prepare_npu(local_rank: int) -> None:
    # torch_npu must be imported only here: importing it without CANN breaks `import torch`.
    torch_npu = importlib.import_module("torch_npu")
    torch_npu.npu.set_device(local_rank)


_REGISTRY: dict[str, DeviceBackend] = {}


def register_device_backend(entry: DeviceBackend) -> None:
    """Add or replace the backend used for ``entry.device_type``."""
    _REGISTRY[entry.device_type] = entry


def device_backend(device_type: str) -> DeviceBackend:
    """The registered entry for ``device_type`` (``cpu``, ``cuda``, ``npu``)."""
    try:
        return _REGISTRY[device_type]
    except KeyError:
        raise UnknownBackendError("device", device_type, list(_REGISTRY)) from None


def backend_for_device(device_type: str, override: str | None = None) -> str:
    """Collective backend name for a device, unless ``override`` names one explicitly."""
    return override if override is not None else device_backend(device_type).backend


for _entry in (DeviceBackend("cpu", "gloo", _prepare_cpu),
               DeviceBackend("cuda", "nccl", _prepare_cuda),
               DeviceBackend("npu", "hccl", _prepare_npu)):
    register_device_backend(_entry)
