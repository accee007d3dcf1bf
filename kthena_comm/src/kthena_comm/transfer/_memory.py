"""Raw memory helpers: the address and size of a tensor or buffer (copies live in batch.py)."""

from __future__ import annotations

import ctypes
from typing import Any

import attrs


@attrs.frozen
class RawBuffer:
    """Address and size of caller memory, plus the object that keeps it alive."""

    addr: int
    nbytes: int
    keepalive: Any = attrs.field(eq=False, repr=False)


def raw_buffer(memory: Any) -> RawBuffer:
    """Address of a contiguous CPU tensor or a writable buffer (bytearray, mmap, numpy ...).

    Raises:
        ValueError: the memory is empty, read-only, not contiguous or not in host memory.
    """
    if hasattr(memory, "data_ptr"):
        return _tensor_buffer(memory)
    try:
        view = memoryview(memory).cast("B")
    except TypeError as exc:
        raise ValueError(f"cannot register {type(memory).__name__}: pass a contiguous CPU tensor "
                         "or a writable buffer (bytearray, mmap, numpy array)") from exc
    if view.readonly or view.nbytes == 0:
        raise ValueError("cannot register a read-only or empty buffer; pass writable memory")
    anchor = (ctypes.c_char * view.nbytes).from_buffer(view)
    return RawBuffer(ctypes.addressof(anchor), view.nbytes, (memory, anchor))


def _tensor_buffer(tensor: Any) -> RawBuffer:
    if tensor.device.type != "cpu":
        raise ValueError(f"cannot register a {tensor.device.type} tensor with a host backend; "
                         "pass a CPU tensor (device memory needs a device transport)")
    if not tensor.is_contiguous() or tensor.numel() == 0:
        raise ValueError("cannot register a non-contiguous or empty tensor; call .contiguous()")
    return RawBuffer(tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor)
