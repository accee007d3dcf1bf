"""Raw memory helpers: the address, size and location of caller memory (copies: batch.py)."""

from __future__ import annotations

import ctypes
from typing import Any

import attrs

from kthena_comm.transfer.memory import HOST, DeviceBuffer, MemoryLocation, location_of


@attrs.frozen
class RawBuffer:
    """Address, size and location of caller memory, plus the object that keeps it alive."""

    addr: int
    nbytes: int
    keepalive: Any = attrs.field(eq=False, repr=False)
    location: MemoryLocation = HOST


def raw_buffer(memory: Any, location: MemoryLocation | None = None) -> RawBuffer:
    """Address of a contiguous tensor (any device), a ``DeviceBuffer`` or a writable buffer.

    ``location``, when given, must agree with where the memory is (it is read from the tensor).

    Raises:
        ValueError: the memory is empty, read-only or not contiguous, or ``location`` disagrees.
    """
    found = location_of(memory)
    if location is not None and location != found:
        raise ValueError(f"register(location={location}) but the memory is in {found}; "
                         "omit location for tensors (it is read from tensor.device)")
    if isinstance(memory, DeviceBuffer):
        return RawBuffer(memory.addr, memory.nbytes, memory, memory.location)
    if hasattr(memory, "data_ptr"):
        return _tensor_buffer(memory, found)
    try:
        view = memoryview(memory).cast("B")
    except TypeError as exc:
        raise ValueError(f"cannot register {type(memory).__name__}: pass a contiguous tensor, "
                         "a DeviceBuffer or a writable buffer (bytearray, mmap, numpy array)"
                         ) from exc
    if view.readonly or view.nbytes == 0:
        raise ValueError("cannot register a read-only or empty buffer; pass writable memory")
    anchor = (ctypes.c_char * view.nbytes).from_buffer(view)
    return RawBuffer(ctypes.addressof(anchor), view.nbytes, (memory, anchor))


def _tensor_buffer(tensor: Any, location: MemoryLocation) -> RawBuffer:
    if not tensor.is_contiguous() or tensor.numel() == 0:
        raise ValueError("cannot register a non-contiguous or empty tensor; call .contiguous()")
    return RawBuffer(tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor, location)
