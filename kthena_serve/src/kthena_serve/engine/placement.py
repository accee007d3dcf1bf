"""Where a rank of a tp x pp engine puts its tensors, and the collective backend joining the ranks.

    EngineConfig.device ──type──┬─▶ the rank's device: cpu, or <type>:LOCAL_RANK
    ("cpu" | "cuda" | "npu")    │   (kthena_comm.device.local_device)
                                └─▶ the process-group backend: cpu gloo, cuda nccl, npu hccl
                                    (kthena_comm's table); KTHENA_DIST_BACKEND, which kthena-run
                                    exports from the host's hardware, must name that same one

Each rank loads its own shard onto its device, creates its KV pool there and runs its forwards
there; ``RankPlacement`` is what a rank reports of it (``ParallelModelRunner.placements``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import attrs
import torch

from kthena_serve.engine.config import EngineConfig

if TYPE_CHECKING:
    from kthena_comm.groups import GroupConfig

__all__ = ["DIST_BACKEND_ENV", "DistBackendError", "RankPlacement", "device_type",
           "dist_backend", "group_config", "rank_device"]

DIST_BACKEND_ENV = "KTHENA_DIST_BACKEND"


class DistBackendError(ValueError):
    """``KTHENA_DIST_BACKEND`` names no collective backend, or not the engine device's one."""


def device_type(device: str) -> str:
    """``cpu``, ``cuda`` or ``npu``: the kind of a device string such as ``"cuda:1"``."""
    return device.partition(":")[0]


def dist_backend(device: str, environ: Mapping[str, str] | None = None) -> str:
    """The collective backend of ranks on ``device`` (``EngineConfig.device``): the device
    type's (cpu gloo, cuda nccl, npu hccl), checked against ``KTHENA_DIST_BACKEND`` in
    ``environ`` (default ``os.environ``) when that is set and not empty.

    Only the device's own backend carries every op the engine runs (all-reduce, broadcast,
    send/recv) on that device's tensors, so another name is refused rather than left to fail
    inside torch.distributed.

    Raises:
        DistBackendError: the variable names an unknown backend, or another device's.
    """
    from kthena_comm.device import backend_for_device, device_backends

    own = backend_for_device(device_type(device))
    value = (os.environ if environ is None else environ).get(DIST_BACKEND_ENV, "")
    if not value or value == own:
        return own
    known = sorted({entry.backend for entry in device_backends()})
    if value not in known:
        raise DistBackendError(f"{DIST_BACKEND_ENV}={value!r} is not a collective backend: "
                               f"one of {', '.join(map(repr, known))}, or unset (the device's)")
    raise DistBackendError(f"{DIST_BACKEND_ENV}={value!r}, but device {device!r} takes {own!r} "
                           f"(cpu gloo, cuda nccl, npu hccl): unset it, set it to {own!r} "
                           f"(kthena-run --backend {own}), or change --device")


def group_config(config: EngineConfig, environ: Mapping[str, str] | None = None) -> GroupConfig:
    """kthena_comm's ``GroupConfig`` for ``config``'s ranks (see ``dist_backend``).

    Raises:
        DistBackendError: see ``dist_backend``.
    """
    from kthena_comm.groups import GroupConfig

    return GroupConfig(device_type=device_type(config.device),
                       backend=dist_backend(config.device, environ))


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device the rank with this LOCAL_RANK binds: ``cpu``, else ``<type>:local_rank``.

    Raises:
        kthena_comm.errors.DeviceUnavailableError: this host has no such device.
    """
    from kthena_comm.device import local_device

    return local_device(device_type(config.device), local_rank)


def _devices(tensors: Iterable[torch.Tensor]) -> frozenset[str]:
    return frozenset(str(t.device) for t in tensors)


@attrs.frozen
class RankPlacement:
    """Where one rank's tensors are: the device it bound, its backend, and the devices its
    parameters, buffers and KV pool tensors report (each set is the one device it bound when
    every tensor is there).

    Attributes:
        rank: the global rank.
        device: the device it bound (``"cpu"``, ``"cuda:1"``).
        backend: its process group's backend (``"gloo"``, ``"nccl"``, ``"hccl"``).
        num_parameters, num_buffers, num_pool_tensors: how many tensors each set covers.
    """

    rank: int
    device: str
    backend: str
    parameters: frozenset[str]
    buffers: frozenset[str]
    pool: frozenset[str]
    num_parameters: int
    num_buffers: int
    num_pool_tensors: int

    @classmethod
    def of(cls, rank: int, device: torch.device, backend: str, model: torch.nn.Module,
           pool_tensors: list[torch.Tensor]) -> RankPlacement:
        """Read where ``model``'s parameters and buffers and ``pool_tensors`` are."""
        parameters, buffers = list(model.parameters()), list(model.buffers())
        return cls(rank, str(device), backend, _devices(parameters), _devices(buffers),
                   _devices(pool_tensors), len(parameters), len(buffers), len(pool_tensors))

    @property
    def is_all_on_device(self) -> bool:
        """Every parameter, buffer and pool tensor is on ``device``."""
        return self.parameters | self.buffers | self.pool == {self.device}
