"""Registry of collective backends by device type: cpu → gloo, cuda → nccl, npu → hccl.

Each entry knows how to get its device ready for a rank (select the local device, and for Ascend
import torch_npu, which registers the ``hccl`` backend with torch.distributed) and how many
devices of its type this process sees. A rank binds ``<type>:LOCAL_RANK`` (``local_device``; a
CPU rank binds ``cpu``). New device types register an entry instead of growing an if/elif chain.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from kthena_comm.errors import DeviceUnavailableError, UnknownBackendError

if TYPE_CHECKING:
    import torch


@attrs.frozen
class DeviceBackend:
    """How one device type runs collectives."""

    device_type: str
    backend: str
    prepare: Callable[[int], None] = attrs.field(eq=False)
    """Called with the rank's LOCAL_RANK before ``init_process_group``."""
    count: Callable[[], int] = attrs.field(default=lambda: 1, eq=False)
    """How many devices of this type this process sees (0 where the runtime is missing)."""
    requirement: str = ""
    """What a device of this type needs, and where ``count`` looks: said when there are too few."""


def _prepare_cpu(local_rank: int) -> None:
    """Nothing to select on a CPU."""


def _prepare_cuda(local_rank: int) -> None:
    import torch

    torch.cuda.set_device(local_rank)


def _prepare_npu(local_rank: int) -> None:
    # torch_npu must be imported only here: importing it without CANN breaks `import torch`.
    torch_npu = importlib.import_module("torch_npu")
    torch_npu.npu.set_device(local_rank)


def _count_cuda() -> int:
    import torch

    return torch.cuda.device_count()  # 0 for a CPU-only build or with no GPU visible


def _count_npu() -> int:
    # Only look for torch_npu without importing it: importing it without CANN breaks torch.
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return 0
    return int(importlib.import_module("torch_npu").npu.device_count())


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


def device_backends() -> tuple[DeviceBackend, ...]:
    """Every registered entry, in registration order."""
    return tuple(_REGISTRY.values())


def backend_for_device(device_type: str, override: str | None = None) -> str:
    """Collective backend name for a device, unless ``override`` names one explicitly."""
    return override if override is not None else device_backend(device_type).backend


def device_count(device_type: str) -> int:
    """Devices of ``device_type`` this process sees (a CPU counts as one)."""
    return device_backend(device_type).count()


def local_device(device_type: str, local_rank: int) -> torch.device:
    """The device a rank with this LOCAL_RANK binds: ``cpu``, else ``<type>:local_rank``.

    Raises:
        UnknownBackendError: an unregistered device type.
        DeviceUnavailableError: this host has no device ``local_rank`` of that type.
    """
    import torch

    entry = device_backend(device_type)
    if device_type == "cpu":
        return torch.device("cpu")
    have = entry.count()
    if local_rank >= have:
        raise DeviceUnavailableError(device_type, local_rank, have, entry.requirement)
    return torch.device(device_type, local_rank)


for _entry in (DeviceBackend("cpu", "gloo", _prepare_cpu),
               DeviceBackend("cuda", "nccl", _prepare_cuda, _count_cuda,
                             "a CUDA build of torch and a visible GPU, counted by "
                             "torch.cuda.device_count()"),
               DeviceBackend("npu", "hccl", _prepare_npu, _count_npu,
                             "torch_npu with CANN, counted by torch_npu.npu.device_count() "
                             "(none without torch_npu)")):
    register_device_backend(_entry)
