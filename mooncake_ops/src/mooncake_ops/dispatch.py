"""Device dispatch: a registry of backends keyed by device type, resolved once per type.

    op call ──▶ tensor.device.type ──▶ _TABLES[type][op]  (a dict lookup on the hot path)
                                          │ first call for a type only
                                          ▼
                              registry entry ──load()──▶ DeviceBackend.op_table(allow_native)

``cpu``: native C++ kernels (native/) where built and applicable, else the PyTorch reference;
``cuda``: SDPA-based attention, PyTorch reference for the rest; ``npu``: the torch_npu adapter,
whose module (and torch_npu) is imported only when the first npu tensor arrives.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from mooncake_ops.backends.base import (
    MC2_OPS,
    MOE_DISTRIBUTE_OPS,
    OP_NAMES,
    DeviceBackend,
    OpImpl,
)
from mooncake_ops.errors import NativeUnavailableError, UnsupportedDeviceError

__all__ = [
    "MC2_OPS", "MOE_DISTRIBUTE_OPS", "OP_NAMES", "TESTED", "UNVERIFIED", "BackendEntry", "Capability", "DeviceBackend",
    "OpImpl", "capabilities", "choose_impl", "dispatch_state", "impl", "implementation_name",
    "lazy", "native_enabled", "op_candidates", "register_backend", "restore_dispatch",
    "use_native",
]

TESTED = "tested"
UNVERIFIED = "unverified on hardware"


@attrs.frozen
class BackendEntry:
    """A registered device type: how to load its backend lazily, and what it claims.

    ``describe`` must not load anything device-specific (it feeds `capabilities()`)."""

    device_type: str
    load: Callable[[], DeviceBackend]
    describe: Callable[[bool], Mapping[str, str]]
    status: str


@attrs.frozen
class Capability:
    """One row of the capability report."""

    device_type: str
    op: str
    implementation: str
    status: str


_REGISTRY: dict[str, BackendEntry] = {}
_TABLES: dict[str, dict[str, Callable[..., Any]]] = {}
_NAMES: dict[str, dict[str, str]] = {}
_state = {"allow_native": True}
# (device type, op) -> the candidate's short name a measurement chose (`choose_impl`)
_CHOSEN: dict[tuple[str, str], str] = {}


def register_backend(entry: BackendEntry) -> None:
    """Add or replace the backend for ``entry.device_type``."""
    _REGISTRY[entry.device_type] = entry
    _TABLES.pop(entry.device_type, None)


def lazy(path: str) -> Callable[[], DeviceBackend]:
    """A loader for ``"package.module:Class"``, imported on first use."""
    def load() -> DeviceBackend:
        module, _, name = path.partition(":")
        return getattr(importlib.import_module(module), name)()
    return load


def impl(op: str, device_type: str) -> Callable[..., Any]:
    """The implementation of ``op`` for ``device_type`` (hot path: two dict lookups)."""
    table = _TABLES.get(device_type)
    if table is None:
        table = _resolve(device_type)
    return table[op]


def _resolve(device_type: str) -> dict[str, Callable[..., Any]]:
    entry = _REGISTRY.get(device_type)
    if entry is None:
        raise UnsupportedDeviceError(f"mooncake_ops has no backend for device type "
                                     f"{device_type!r}; registered: {', '.join(sorted(_REGISTRY))}")
    backend = entry.load()
    table = dict(backend.op_table(_state["allow_native"]))
    missing = set(OP_NAMES) - set(table)
    if missing:
        raise UnsupportedDeviceError(f"backend {device_type!r} lacks ops {sorted(missing)}")
    for (chosen_type, op), name in _CHOSEN.items():
        found = _candidates(backend, op) if chosen_type == device_type else {}
        if name in found:  # a choice of a native kernel is void while native kernels are off
            table[op] = found[name]
    _TABLES[device_type] = {op: table[op].fn for op in OP_NAMES}
    _NAMES[device_type] = {op: table[op].name for op in OP_NAMES}
    return _TABLES[device_type]


def _candidates(backend: DeviceBackend, op: str) -> Mapping[str, OpImpl]:
    candidates = getattr(backend, "candidates", None)
    return {} if candidates is None else candidates(op, _state["allow_native"])


def op_candidates(op: str, device_type: str) -> Mapping[str, OpImpl]:
    """The implementations of ``op`` on ``device_type`` a measurement may choose between, by
    short name (e.g. ``native``, ``torch-sdpa``); {} where the backend offers no choice."""
    entry = _REGISTRY.get(device_type)
    if entry is None:
        raise UnsupportedDeviceError(f"mooncake_ops has no backend for device type "
                                     f"{device_type!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _candidates(entry.load(), op)


def choose_impl(op: str, device_type: str, name: str | None) -> None:
    """Run candidate ``name`` (`op_candidates`) for ``op`` on ``device_type`` from now on,
    process-wide; None returns to the backend's default.

    Raises:
        ValueError: ``name`` is not a candidate of ``op`` there.
    """
    if name is None:
        _CHOSEN.pop((device_type, op), None)
    else:
        found = op_candidates(op, device_type)
        if name not in found:
            raise ValueError(f"{name!r} is not an implementation of {op} on {device_type}; "
                             f"candidates: {', '.join(sorted(found)) or 'none'}")
        _CHOSEN[(device_type, op)] = name
    _TABLES.pop(device_type, None)
    _NAMES.pop(device_type, None)


def implementation_name(op: str, device_type: str) -> str:
    """Which implementation ``op`` runs on ``device_type`` now (e.g. ``native-cpp``)."""
    impl(op, device_type)
    return _NAMES[device_type][op]


def use_native(enabled: bool, *, strict: bool = False) -> bool:
    """Allow (default) or forbid native kernels process-wide; returns the previous setting.

    Tests and benchmarks use this to run the PyTorch reference on the same data. With
    ``strict=True`` enabling fails unless the native extension is importable.

    Raises:
        NativeUnavailableError: ``strict`` and the native build is absent or unusable.
    """
    if enabled and strict:
        from mooncake_ops.backends import native
        if not native.is_available():
            raise NativeUnavailableError(f"native kernels unavailable: {native.unavailable_reason()}")
    previous = _state["allow_native"]
    _state["allow_native"] = bool(enabled)
    _TABLES.clear()
    _NAMES.clear()
    return previous


def native_enabled() -> bool:
    return _state["allow_native"]


def dispatch_state() -> tuple[bool, tuple[tuple[tuple[str, str], str], ...]]:
    """The process-wide dispatch settings (`use_native`'s and every `choose_impl` choice), as a
    value `restore_dispatch` takes back: what a test fixture or a benchmark A/B saves first."""
    return _state["allow_native"], tuple(sorted(_CHOSEN.items()))


def restore_dispatch(state: tuple[bool, tuple[tuple[tuple[str, str], str], ...]]) -> None:
    """Put back settings `dispatch_state` saved (a no-op when nothing changed since)."""
    if state == dispatch_state():
        return
    _state["allow_native"] = state[0]
    _CHOSEN.clear()
    _CHOSEN.update(state[1])
    _TABLES.clear()
    _NAMES.clear()


def capabilities() -> tuple[Capability, ...]:
    """Every registered device's ops, the implementation each runs and how it is verified.

    Imports nothing device-specific (torch_npu is never loaded by this call)."""
    rows = []
    for device_type, entry in sorted(_REGISTRY.items()):
        described = entry.describe(_state["allow_native"])
        rows += [Capability(device_type, op, described[op], entry.status) for op in OP_NAMES]
    return tuple(rows)


def _cpu_describe(allow_native: bool) -> Mapping[str, str]:
    from mooncake_ops.backends.devices import CpuBackend
    return {op: i.name for op, i in CpuBackend().op_table(allow_native).items()}


def _cuda_describe(allow_native: bool) -> Mapping[str, str]:
    from mooncake_ops.backends.devices import CudaBackend
    return {op: i.name for op, i in CudaBackend().op_table(allow_native).items()}


def _npu_describe(allow_native: bool) -> Mapping[str, str]:
    from mooncake_ops.backends.devices import NPU_OPS
    return NPU_OPS


register_backend(BackendEntry("cpu", lazy("mooncake_ops.backends.devices:CpuBackend"),
                              _cpu_describe, TESTED))
register_backend(BackendEntry("cuda", lazy("mooncake_ops.backends.devices:CudaBackend"),
                              _cuda_describe, UNVERIFIED))
register_backend(BackendEntry("npu", lazy("mooncake_ops.backends.npu:NpuBackend"),
                              _npu_describe, UNVERIFIED))
