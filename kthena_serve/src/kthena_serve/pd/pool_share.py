"""How a prefill worker on the decode worker's host opens the decode worker's KV pool, per device.

The hand-off is one code path whatever the device (``PrefillExecutor.submit_shared``): the
prefill worker's paged prefill writes each token's K/V straight into the decode worker's
blocks, and only the first token goes back. What differs is how the peer's pool is opened:

    device  the decode worker exports (in PoolRef)       the prefill worker opens
    ------  -------------------------------------------  --------------------------------------
    cpu     ``shm_name``: its pool is a /dev/shm file      ``KVPool.attach``: maps that file
    cuda    ``device_ipc``: torch's CUDA IPC handle of     the same device memory, mapped into
            the pool's storage (``CudaIpcExport``)         this process by torch (no copy)
    npu     refused (``PDConfig.check_device``): torch has no released IPC for NPU memory

Across hosts nothing is opened: the decode pool, on any device, is registered with Mooncake
(``kthena_comm`` records its memory kind: ``cuda:N``; ``npu:N`` over Mooncake's ascend_direct
transport, transfer.py ``mooncake_config_for``) and the prefill worker puts into it; on npu that
is the only PD route (``--pd-transport mooncake``), written against the documentation only.

CUDA IPC, as torch documents it for sharing CUDA tensors between processes: the consumer
must be another process (started by spawn / forkserver, or unrelated), and the producer must
keep the memory alive while a consumer holds it; the decode worker's pool lives as long as the
worker, and a prefill worker drops a pool it mapped once that worker has restarted. Ordering:
the prefill's first token reaches the host only after the forward's kernels on its stream have
run, so the K/V is in the decode pool before the decode worker hears of the token. None of the
cuda route has run on a GPU yet (docs/accelerators.md; ``scripts/gpu_check.py`` runs it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Any, Protocol

import attrs
import torch

from kthena_serve.pd.config import NOT_WIRED, PoolShareError
from kthena_serve.pd.protocol import PoolRef
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool, KVPoolHandle

__all__ = ["CudaIpcExport", "PoolShare", "PoolShareError", "export_pool",
           "open_pool", "pool_key", "share_for"]


class PoolShare(Protocol):
    """One device type's way to export a decode pool and open it in another process."""

    device_type: str

    def export(self, pool: KVPool) -> dict[str, Any]:
        """The ``PoolRef`` fields that name ``pool`` to a prefill worker on this host."""

    def open(self, ref: PoolRef, layout: KVLayout) -> KVPool:
        """The decode worker's pool, mapped into this process (not owned: close only unmaps).

        Raises:
            PoolShareError: ``ref`` does not name such a pool, or it cannot be opened here.
        """

    def key(self, ref: PoolRef) -> str:
        """Which pool ``ref`` names (a prefill worker maps each pool once)."""


class ShmShare:
    """cpu: the decode pool is a /dev/shm file (``KVPool.create(shared=True)``)."""

    device_type = "cpu"

    def export(self, pool: KVPool) -> dict[str, Any]:
        if pool.name is None:
            raise PoolShareError("a cpu decode pool must be created shared (in /dev/shm) for "
                                 "same-host prefill workers to map it")
        return {"shm_name": pool.name}

    def open(self, ref: PoolRef, layout: KVLayout) -> KVPool:
        if ref.shm_name is None:
            raise PoolShareError("the task names no shared pool; use the mooncake transport")
        return KVPool.attach(KVPoolHandle(ref.shm_name, layout))

    def key(self, ref: PoolRef) -> str:
        return f"shm:{ref.shm_name}"


@attrs.frozen(kw_only=True)
class CudaIpcExport:
    """torch's CUDA IPC description of a pool's storage, as JSON can carry it.

    The fields are those torch's multiprocessing reducer sends for a CUDA tensor
    (``torch.multiprocessing.reductions.reduce_tensor``): the allocation's IPC handle, the
    storage's size and offset in it, the producer's reference-counter slot and its event.
    Byte strings travel base64-encoded.
    """

    device_index: int
    storage_handle: str
    storage_size_bytes: int
    storage_offset_bytes: int
    tensor_offset: int
    num_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool

    @classmethod
    def from_reduction(cls, args: tuple) -> CudaIpcExport:
        """From the argument tuple ``reduce_tensor`` gives for a 1-D uint8 CUDA tensor."""
        (_cls, size, _stride, offset, _storage_cls, _dtype, device, handle, size_bytes,
         offset_bytes, _grad, counter, counter_offset, event, event_sync) = args
        return cls(device_index=int(device), storage_handle=_b64(handle),
                   storage_size_bytes=int(size_bytes), storage_offset_bytes=int(offset_bytes),
                   tensor_offset=int(offset), num_bytes=int(size[0]),
                   ref_counter_handle=_b64(counter), ref_counter_offset=int(counter_offset),
                   event_handle=None if event is None else _b64(event),
                   event_sync_required=bool(event_sync))

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> CudaIpcExport:
        """Read ``to_json``.

        Raises:
            PoolShareError: missing or extra fields, a negative size or offset, bad base64.
        """
        if not isinstance(data, dict):
            raise PoolShareError(f"device_ipc must be an object, got {type(data).__name__}")
        fields = {f.name for f in attrs.fields(cls)}
        if set(data) != fields:
            raise PoolShareError(f"device_ipc fields {sorted(data)}; expected {sorted(fields)}")
        export = cls(**data)
        ints = ("device_index", "storage_size_bytes", "storage_offset_bytes", "tensor_offset",
                "num_bytes", "ref_counter_offset")
        if any(not isinstance(getattr(export, n), int) or getattr(export, n) < 0 for n in ints):
            raise PoolShareError(f"device_ipc: {', '.join(ints)} must be integers >= 0")
        if export.tensor_offset + export.num_bytes > export.storage_size_bytes:
            raise PoolShareError("device_ipc: the pool runs past the end of its storage")
        for name in ("storage_handle", "ref_counter_handle", "event_handle"):
            value = getattr(export, name)
            if value is not None:
                _unb64(value, name)
        return export

    def rebuild_args(self) -> tuple:
        """The argument tuple of torch's ``rebuild_cuda_tensor`` for this pool's uint8 buffer."""
        event = None if self.event_handle is None else _unb64(self.event_handle, "event_handle")
        return (torch.Tensor, (self.num_bytes,), (1,), self.tensor_offset, torch.UntypedStorage,
                torch.uint8, self.device_index, _unb64(self.storage_handle, "storage_handle"),
                self.storage_size_bytes, self.storage_offset_bytes, False,
                _unb64(self.ref_counter_handle, "ref_counter_handle"), self.ref_counter_offset,
                event, self.event_sync_required)


class CudaIpcShare:
    """cuda: the decode pool is ordinary device memory; torch's CUDA IPC maps it elsewhere."""

    device_type = "cuda"

    def export(self, pool: KVPool) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        buffer = pool.buffer
        if buffer.device.type != "cuda":
            raise PoolShareError(f"a CUDA IPC export needs a cuda pool, this one is on "
                                 f"{buffer.device}")
        _rebuild, args = reduce_tensor(buffer)
        return {"device_ipc": CudaIpcExport.from_reduction(args).to_json()}

    def open(self, ref: PoolRef, layout: KVLayout) -> KVPool:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        export = CudaIpcExport.from_json(ref.device_ipc)
        if export.num_bytes != layout.total_bytes:
            raise PoolShareError(f"the decode pool has {export.num_bytes} bytes but its layout "
                                 f"needs {layout.total_bytes}; both workers must run the same "
                                 "model, dtype and block size")
        if not torch.cuda.is_available():
            raise PoolShareError("the decode pool is in CUDA memory but this process has no "
                                 "CUDA device; run the prefill worker on the same GPU host")
        buffer = rebuild_cuda_tensor(*export.rebuild_args())
        return KVPool(layout, buffer, None, is_owner=False)

    def key(self, ref: PoolRef) -> str:
        export = CudaIpcExport.from_json(ref.device_ipc)
        digest = hashlib.sha256(_unb64(export.storage_handle, "storage_handle")).hexdigest()
        return f"cuda:{export.device_index}:{digest[:16]}:{export.storage_offset_bytes}"


_SHARES: dict[str, PoolShare] = {"cpu": ShmShare(), "cuda": CudaIpcShare()}  # config.SAME_HOST_DEVICES


def share_for(device: str | torch.device) -> PoolShare:
    """The ``PoolShare`` of ``device``'s type.

    Raises:
        PoolShareError: no same-host route for that device type (the reason says why).
    """
    kind = _device_type(device)
    if kind in NOT_WIRED:
        raise PoolShareError(NOT_WIRED[kind])
    try:
        return _SHARES[kind]
    except KeyError:
        raise PoolShareError(f"no same-host PD pool route for {kind!r}; use cpu or cuda, or "
                             "the mooncake transport") from None


def export_pool(pool: KVPool) -> dict[str, Any]:
    """The ``PoolRef`` fields naming ``pool`` to prefill workers on this host."""
    return share_for(pool.buffer.device).export(pool)


def _share_of(ref: PoolRef) -> PoolShare:
    if ref.device_ipc is not None:
        return _SHARES["cuda"]
    if ref.shm_name is not None:
        return _SHARES["cpu"]
    raise PoolShareError("the task names no pool this host can open (no shm_name, no "
                         "device_ipc); use the mooncake transport")


def open_pool(ref: PoolRef, layout: KVLayout) -> KVPool:
    """The decode pool ``ref`` names, mapped into this process (see ``PoolShare.open``)."""
    return _share_of(ref).open(ref, layout)


def pool_key(ref: PoolRef) -> str:
    """Which pool ``ref`` names: the key a prefill worker maps each pool under once."""
    return _share_of(ref).key(ref)


def _device_type(device: str | torch.device) -> str:
    """``npu:1`` -> ``npu`` without torch.device (which knows npu only once torch_npu loads)."""
    return device.type if isinstance(device, torch.device) else str(device).partition(":")[0]


def _b64(value: bytes) -> str:
    return base64.b64encode(bytes(value)).decode("ascii")


def _unb64(value: str, name: str) -> bytes:
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (AttributeError, UnicodeEncodeError, binascii.Error):
        raise PoolShareError(f"device_ipc.{name} is not base64") from None
