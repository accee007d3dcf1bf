"""Where registered memory lives: host, or one CUDA / NPU device (a ``MemoryLocation``).

``TransferEngine.register`` takes the location with the memory. For a tensor it is read from
``tensor.device`` (cpu -> host, cuda:N, npu:N); for device memory allocated outside torch (by
``aclrtMalloc``, ``cudaMalloc`` ...) pass a ``DeviceBuffer`` (address, size, location). Every
backend states which kinds it moves; the others are refused at registration with
``TransportUnavailableError``, which names what is missing (a backend, a wheel, a build flag).
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["HOST", "MEMORY_KINDS", "DeviceBuffer", "MemoryLocation", "location_of"]

MEMORY_KINDS = ("host", "cuda", "npu")
_TORCH_KINDS = {"cpu": "host", "cuda": "cuda", "npu": "npu"}


@attrs.frozen
class MemoryLocation:
    """A memory kind and, for device memory, the device id (``host``, ``cuda:0``, ``npu:3``)."""

    kind: str = attrs.field(validator=attrs.validators.in_(MEMORY_KINDS))
    device_id: int | None = attrs.field(default=None)

    @device_id.validator
    def _check_device(self, attribute: attrs.Attribute, value: int | None) -> None:
        if self.kind == "host" and value is not None:
            raise ValueError(f"host memory has no device id, got {value!r}")
        if self.kind != "host" and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{self.kind} memory needs a device id >= 0, got {value!r}")

    @property
    def is_device(self) -> bool:
        return self.kind != "host"

    def __str__(self) -> str:
        return self.kind if self.kind == "host" else f"{self.kind}:{self.device_id}"

    @classmethod
    def parse(cls, text: str) -> MemoryLocation:
        """``"host"``, ``"cuda:0"`` or ``"npu:1"`` -> a location.

        Raises:
            ValueError: any other spelling.
        """
        kind, _, index = text.partition(":")
        if kind == "host" and not index:
            return HOST
        if kind in ("cuda", "npu") and index.isdigit():
            return cls(kind, int(index))
        raise ValueError(f"memory location {text!r}: expected 'host', 'cuda:N' or 'npu:N'")


HOST = MemoryLocation("host")


@attrs.frozen
class DeviceBuffer:
    """Device memory given by address, for memory that is not a torch tensor.

    ``keepalive`` is held by the engine while the memory is registered (the owner object, if any).
    """

    addr: int = attrs.field(validator=attrs.validators.gt(0))
    nbytes: int = attrs.field(validator=attrs.validators.gt(0))
    location: MemoryLocation = attrs.field(validator=attrs.validators.instance_of(MemoryLocation))
    keepalive: Any = attrs.field(default=None, eq=False, repr=False)


def location_of(memory: Any) -> MemoryLocation:
    """The location of a tensor (from its ``device``), a ``DeviceBuffer``, or a host buffer.

    Raises:
        ValueError: a tensor on a device type no backend knows (``mps``, ``xpu`` ...).
    """
    if isinstance(memory, DeviceBuffer):
        return memory.location
    device = getattr(memory, "device", None)
    if device is None or not hasattr(memory, "data_ptr"):
        return HOST
    kind = _TORCH_KINDS.get(device.type)
    if kind is None:
        raise ValueError(f"cannot register a {device.type} tensor: transfer engines move host, "
                         "cuda and npu memory")
    if kind == "host":
        return HOST
    return MemoryLocation(kind, 0 if device.index is None else device.index)
