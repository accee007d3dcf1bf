"""KV pool: the torch buffer holding every layer's K and V, in process or in POSIX shared memory.

One uint8 buffer per pool, laid out by a `KVLayout`; typed, strided views give attention
kernels the usual per-layer caches whatever the physical order:

    k_cache(layer), v_cache(layer)   [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale(layer), v_scale(layer)   [num_blocks, block_size, num_kv_heads]  float32, int8 only

A latent pool (``KVShape.num_parts`` 1, MLA) has ``k_cache`` only: one vector per token and layer.

A shared pool is a file in /dev/shm (mode 0600) mapped MAP_SHARED. Another process on the host
attaches with the pool's `KVPoolHandle` (name + layout, picklable) and sees the same bytes: a
prefill worker writes KV straight into blocks the decode worker reads, with no copy.

Lifetime: the creator unlinks the file on `close()` (idempotent), on leaving a `with` block,
and through a `weakref.finalize` when the pool is collected or the interpreter exits, so an
owner that dies with an exception does not leak /dev/shm. Views taken before close stay valid
(the mapping lives until the last tensor goes); a SIGKILLed owner leaves its file behind.

Imports torch; `mooncake_kv` itself does not, so import this module only where a pool is needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import weakref
from collections.abc import Iterable
from pathlib import Path

import attrs
import torch

from mooncake_kv._shm_names import SHM_DIR, default_pool_name
from mooncake_kv.layout import ByteRange, KVLayout, KVPart
from mooncake_kv.sizing import KVDtype
from mooncake_kv.types import BlockId, KVCacheError

__all__ = [
    "SHM_DIR",
    "BlockPayloadError",
    "KVPool",
    "KVPoolHandle",
    "PoolClosedError",
    "PoolExistsError",
    "PoolMismatchError",
    "PoolNotFoundError",
    "torch_dtype",
]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_TORCH_DTYPES = {
    KVDtype.BF16: torch.bfloat16,
    KVDtype.FP16: torch.float16,
    KVDtype.FP32: torch.float32,
    KVDtype.INT8: torch.int8,
}


class PoolClosedError(KVCacheError, RuntimeError):
    """The pool was closed; its views and blocks can no longer be used through it."""


class PoolExistsError(KVCacheError, FileExistsError):
    """A shared pool of that name already exists."""


class PoolNotFoundError(KVCacheError, FileNotFoundError):
    """No shared pool of that name exists (never created, or its owner closed it)."""


class PoolMismatchError(KVCacheError, ValueError):
    """A shared pool whose size does not match the layout it is attached with."""


class BlockPayloadError(KVCacheError, ValueError):
    """Block bytes of the wrong length for this layout."""


def torch_dtype(dtype: KVDtype | str) -> torch.dtype:
    """The torch element type of a KV dtype."""
    return _TORCH_DTYPES[KVDtype.parse(dtype)]


@attrs.frozen
class KVPoolHandle:
    """What another process needs to attach to a shared pool: its name and layout."""

    name: str
    layout: KVLayout


def _check_name(name: str) -> Path:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"shared pool name {name!r} is not allowed; use 1-200 characters from "
            "letters, digits, '_', '.', '-' (no '/')"
        )
    return SHM_DIR / name


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _create_shm(path: Path, num_bytes: int) -> torch.Tensor:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        raise PoolExistsError(
            f"shared pool {path.name!r} already exists; pick another name or attach to it"
        ) from None
    try:
        os.ftruncate(fd, num_bytes)
        return torch.from_file(str(path), shared=True, size=num_bytes, dtype=torch.uint8)
    except BaseException:
        _unlink_quietly(path)
        raise
    finally:
        os.close(fd)


def _attach_shm(path: Path, layout: KVLayout) -> torch.Tensor:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise PoolNotFoundError(
            f"no shared pool named {path.name!r} in {SHM_DIR}; its owner must create it "
            "(KVPool.create(..., shared=True)) and keep it open"
        ) from None
    if size != layout.total_bytes:
        raise PoolMismatchError(
            f"shared pool {path.name!r} has {size} bytes but the layout needs "
            f"{layout.total_bytes}; attach with the handle its owner published"
        )
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


class KVPool:
    """K and V for all layers in one buffer (ordinary or shared memory). See module docs.

    Build with `KVPool.create(layout, shared=...)` or `KVPool.attach(handle)`.
    Threading: views may be used from any thread; `close()` belongs to the owner thread.
    """

    def __init__(self, layout: KVLayout, buffer: torch.Tensor, name: str | None, is_owner: bool):
        self._layout = layout
        self._buffer: torch.Tensor | None = buffer
        self._name = name
        self._is_owner = is_owner
        self._finalizer = None
        if name is not None and is_owner:
            self._finalizer = weakref.finalize(self, _unlink_quietly, SHM_DIR / name)
        self._views = self._build_views(buffer)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        layout: KVLayout,
        *,
        shared: bool = False,
        name: str | None = None,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        """A zeroed pool for `layout`.

        Args:
            layout: the byte geometry.
            shared: put the buffer in /dev/shm so other processes can attach.
            name: shm name (shared only); when omitted, a unique ``mooncake_kv.<pid>.<random>``
                that `shared_pool_paths` finds.
            device: where an unshared pool lives; shared pools are host memory.
        Raises:
            PoolExistsError: `name` is taken.
            ValueError: a name for an unshared pool, a bad name, or shared off the CPU.
        """
        if not shared:
            if name is not None:
                raise ValueError("only shared pools have a name; pass shared=True or drop name")
            buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
            return cls(layout, buffer, None, is_owner=True)
        if torch.device(device).type != "cpu":
            raise ValueError(f"shared pools live in host memory; use device='cpu', not {device}")
        name = name or default_pool_name()
        return cls(layout, _create_shm(_check_name(name), layout.total_bytes), name, True)

    @classmethod
    def attach(cls, handle: KVPoolHandle) -> KVPool:
        """Map an existing shared pool. Closing it never unlinks: the creator owns the name.

        Raises:
            PoolNotFoundError: nothing of that name (yet, or any more).
            PoolMismatchError: the file's size disagrees with `handle.layout`.
        """
        path = _check_name(handle.name)
        return cls(handle.layout, _attach_shm(path, handle.layout), handle.name, is_owner=False)

    def _build_views(self, buffer: torch.Tensor) -> dict[tuple[str, int, KVPart], torch.Tensor]:
        layout = self._layout
        shape = layout.shape
        data = buffer[: layout.data_bytes].view(torch_dtype(shape.dtype))
        inner = (shape.block_size, shape.num_kv_heads, shape.head_dim)
        views = self._unit_views("kv", data, layout.unit_elements, inner)
        if shape.dtype.is_quantized:
            scales = buffer[layout.scale_offset : layout.total_bytes].view(torch.float32)
            views |= self._unit_views("scale", scales, layout.scale_unit_elements, inner[:2])
        return views

    def _unit_views(self, kind: str, typed: torch.Tensor, unit: int, inner: tuple[int, ...]):
        """Per (layer, part) strided views [num_blocks, *inner] over `typed` units."""
        layout = self._layout
        block_stride = layout.unit_strides()[0] * unit
        inner_strides = tuple(_contiguous_strides(inner))
        views = {}
        for layer in range(layout.shape.num_layers):
            for part in layout.parts:
                start = typed.storage_offset() + layout.unit_index(0, layer, part) * unit
                views[(kind, layer, part)] = typed.as_strided(
                    (layout.num_blocks, *inner), (block_stride, *inner_strides), start
                )
        return views

    # ---- properties ------------------------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def name(self) -> str | None:
        """The /dev/shm name of a shared pool; None for an unshared one."""
        return self._name

    @property
    def is_shared(self) -> bool:
        return self._name is not None

    @property
    def is_owner(self) -> bool:
        return self._is_owner

    @property
    def closed(self) -> bool:
        return self._buffer is None

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool as uint8, offsets as in the layout."""
        if self._buffer is None:
            raise PoolClosedError(f"pool {self._name or '(unshared)'} is closed; make a new one")
        return self._buffer

    @property
    def base_address(self) -> int:
        """Address of byte 0: add layout offsets to get what a transfer engine registers."""
        return self.buffer.data_ptr()

    @property
    def handle(self) -> KVPoolHandle:
        """The descriptor another process attaches with (shared pools only)."""
        if self._name is None:
            raise ValueError("an unshared pool has no handle; create it with shared=True")
        return KVPoolHandle(self._name, self._layout)

    # ---- per-layer views -------------------------------------------------------------------
    def k_cache(self, layer: int) -> torch.Tensor:
        """K of `layer`: [num_blocks, block_size, num_kv_heads, head_dim] (strided view)."""
        return self._view("kv", layer, KVPart.K)

    def v_cache(self, layer: int) -> torch.Tensor:
        """V of `layer`: [num_blocks, block_size, num_kv_heads, head_dim] (strided view).

        Raises:
            TypeError: a latent pool (num_parts 1) has no V; its vectors are `k_cache`."""
        if self._layout.shape.num_parts == 1:
            raise TypeError("a latent pool (num_parts=1, MLA) has no V cache; its one vector "
                            "per token and layer is k_cache(layer)")
        return self._view("kv", layer, KVPart.V)

    def k_scale(self, layer: int) -> torch.Tensor:
        """float32 K scales of `layer`: [num_blocks, block_size, num_kv_heads] (int8 only)."""
        return self._view("scale", layer, KVPart.K)

    def v_scale(self, layer: int) -> torch.Tensor:
        """float32 V scales of `layer`: [num_blocks, block_size, num_kv_heads] (int8 only)."""
        return self._view("scale", layer, KVPart.V)

    def _view(self, kind: str, layer: int, part: KVPart) -> torch.Tensor:
        self.buffer  # noqa: B018 - raises PoolClosedError once closed
        self._layout.check_layer(layer)
        if kind == "scale" and not self._layout.shape.dtype.is_quantized:
            raise TypeError(
                f"a {self._layout.shape.dtype.value} pool has no scales; only int8 pools do"
            )
        return self._views[(kind, layer, part)]

    # ---- block bytes (tiers, tests) -----------------------------------------------------------
    def batch_addresses(self, block_ids: Iterable[BlockId]) -> tuple[tuple[int, int], ...]:
        """(address, length) of the coalesced ranges of these blocks, for a transfer engine."""
        base = self.base_address
        return tuple((base + r.offset, r.length) for r in self._layout.batch_ranges(block_ids))

    def read_block(self, block_id: BlockId) -> bytes:
        """A copy of everything one block holds (all layers, K, V, scales), in range order."""
        ranges = self._layout.block_ranges(block_id)
        if self.buffer.device.type == "cpu":
            base = self.base_address
            return b"".join(ctypes.string_at(base + r.offset, r.length) for r in ranges)
        gathered = torch.cat([self.buffer[r.offset : r.end] for r in ranges]).cpu()
        return ctypes.string_at(gathered.data_ptr(), gathered.numel())

    def write_block(self, block_id: BlockId, payload: bytes) -> None:
        """Overwrite one block with bytes from `read_block` of a pool with the same shape.

        Raises:
            BlockPayloadError: payload length differs from the layout's bytes per block.
        """
        ranges = self._layout.block_ranges(block_id)
        if len(payload) != self._layout.bytes_per_block:
            raise BlockPayloadError(
                f"block payload has {len(payload)} bytes; this {self._layout.shape.fingerprint()}"
                f" pool needs exactly {self._layout.bytes_per_block}"
            )
        if self.buffer.device.type == "cpu":
            self._write_cpu(ranges, bytes(payload))
            return
        source = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.buffer.device)
        self._copy_ranges(ranges, source)

    def _write_cpu(self, ranges: tuple[ByteRange, ...], payload: bytes) -> None:
        source = ctypes.cast(ctypes.c_char_p(payload), ctypes.c_void_p).value
        base, position = self.base_address, 0
        for r in ranges:
            ctypes.memmove(base + r.offset, source + position, r.length)
            position += r.length

    def _copy_ranges(self, ranges: tuple[ByteRange, ...], source: torch.Tensor) -> None:
        position = 0
        for r in ranges:
            self.buffer[r.offset : r.end].copy_(source[position : position + r.length])
            position += r.length

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the buffer; the creator of a shared pool unlinks its name. Safe to repeat."""
        self._buffer = None
        self._views = {}
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"shm {self._name!r}" if self._name else "private"
        state = "closed" if self.closed else f"{self._layout.total_bytes} bytes"
        return f"KVPool({self._layout.shape.fingerprint()}, {self._layout.kind.value}, {where}, {state})"


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return list(reversed(strides))
