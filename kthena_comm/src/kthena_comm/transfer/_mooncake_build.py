"""What the installed Mooncake wheel can move, read from the wheel itself, and the refusals.

Mooncake's Python module states its compile-time features as ``mooncake.engine.SUPPORT_CUDA``,
``SUPPORT_MNNVL``, ``SUPPORT_INTRA_NVLINK`` (Mooncake docs, "Compile-time Feature Support
Attributes"). It has no such flag for Ascend, and ``initialize(..., "ascend", ...)`` on a build
without it returns 0 and silently falls back to TCP, so the ascend_direct transport is detected
the way vllm-ascend checks its Mooncake builds: by the transport's class name in the loaded
library (``AscendDirectTransport``, compiled in with ``-DUSE_ASCEND_DIRECT=ON``).

Location names passed to ``register_memory`` follow Mooncake: ``cuda:N`` for GPU memory,
``npu:N`` for Ascend device memory (ascend_direct maps ``npu*`` to ADXL ``MEM_DEVICE``), ``*``
(auto-detect) for host memory.
"""

from __future__ import annotations

import functools
import importlib.metadata
import mmap
import os
from types import ModuleType

import attrs

from kthena_comm.transfer.memory import MemoryLocation

ASCEND_MARKER = b"AscendDirectTransport"
_BUILD_FLAGS = {"cuda": "-DUSE_CUDA=ON", "nvlink": "-DUSE_MNNVL=ON",
                "nvlink_intra": "-DUSE_INTRA_NVLINK=ON", "ascend": "-DUSE_ASCEND_DIRECT=ON"}


@attrs.frozen
class MooncakeBuild:
    """Transports compiled into the installed Mooncake engine module."""

    package: str
    """Distribution and version, e.g. ``mooncake-transfer-engine-non-cuda 0.3.13.post1``."""
    cuda: bool = False
    mnnvl: bool = False
    intra_nvlink: bool = False
    ascend_direct: bool = False

    def refusal(self, location: MemoryLocation, protocol: str,
                npu_device_id: int | None) -> str | None:
        """Why this build (with this protocol) cannot register memory at ``location``; None if
        it can."""
        if location.kind == "cuda":
            return self._cuda_refusal(protocol)
        if location.kind == "npu":
            return self._npu_refusal(location, protocol, npu_device_id)
        return None

    def _cuda_refusal(self, protocol: str) -> str | None:
        if not self.cuda:
            return (f"the installed wheel ({self.package}) was built without CUDA "
                    "(mooncake.engine.SUPPORT_CUDA is False); install the CUDA wheel "
                    f"`mooncake-transfer-engine` or build Mooncake with {_BUILD_FLAGS['cuda']}")
        if protocol == "ascend":
            return "the ascend transport moves NPU and host memory, not CUDA memory"
        if protocol == "nvlink" and not self.mnnvl:
            return f"protocol 'nvlink' needs a build with {_BUILD_FLAGS['nvlink']}"
        if protocol == "nvlink_intra" and not self.intra_nvlink:
            return f"protocol 'nvlink_intra' needs a build with {_BUILD_FLAGS['nvlink_intra']}"
        return None

    def _npu_refusal(self, location: MemoryLocation, protocol: str,
                     npu_device_id: int | None) -> str | None:
        if not self.ascend_direct:
            return self.missing_ascend()
        if protocol != "ascend" or npu_device_id is None:
            return ("NPU memory moves only over the ascend transport: use MooncakeConfig("
                    "protocol='ascend', ascend=AscendDirectConfig(device_id=N))")
        if location.device_id != npu_device_id:
            return (f"this engine was initialised on npu:{npu_device_id}; register that "
                    "device's memory, or create one engine per NPU")
        return None

    def missing_ascend(self) -> str:
        return (f"the installed wheel ({self.package}) has no ascend_direct transport (no "
                f"{ASCEND_MARKER.decode()} in its library); build Mooncake with "
                f"{_BUILD_FLAGS['ascend']} against CANN. The PyPI wheels "
                "(mooncake-transfer-engine, mooncake-transfer-engine-non-cuda) are not such builds")


def detect_build(module: ModuleType) -> MooncakeBuild:
    """The transports of the loaded ``mooncake.engine`` module."""
    return MooncakeBuild(
        package=_package(),
        cuda=bool(getattr(module, "SUPPORT_CUDA", False)),
        mnnvl=bool(getattr(module, "SUPPORT_MNNVL", False)),
        intra_nvlink=bool(getattr(module, "SUPPORT_INTRA_NVLINK", False)),
        ascend_direct=any(_contains_marker(path) for path in _library_files(module)),
    )


def register_location(location: MemoryLocation) -> str:
    """Mooncake's ``location`` argument of ``register_memory`` for memory at ``location``."""
    return "*" if location.kind == "host" else str(location)


def _library_files(module: ModuleType) -> list[str]:
    """The engine module's file and the transfer-engine libraries beside it (shared builds)."""
    path = getattr(module, "__file__", None)
    if not path:
        return []
    folder = os.path.dirname(path)
    siblings = sorted(os.path.join(folder, name) for name in os.listdir(folder)
                      if name.startswith("libtransfer_engine") and ".so" in name)
    return [path, *siblings]


@functools.lru_cache(maxsize=16)
def _contains_marker(path: str) -> bool:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(ASCEND_MARKER) >= 0
    except (OSError, ValueError):  # unreadable, or empty (mmap of 0 bytes)
        return False


@functools.cache
def _package() -> str:
    names = importlib.metadata.packages_distributions().get("mooncake", [])
    for name in names:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "an unpackaged mooncake module"
