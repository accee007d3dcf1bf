"""Which kernel runs a linear layer's matmul on CPU: oneDNN over pre-packed bf16 weights, or F.linear.

On CPUs whose oneDNN has bf16 kernels (AMX / AVX512-BF16) a batch-1 ``F.linear`` in bf16 runs at
half the memory bandwidth of fp32 (the generic path converts as it goes), and a 56 MB LM head
alone costs ~10 ms. oneDNN's ``_linear_pointwise`` over a weight re-ordered once into its blocked
layout streams the weight at full speed: ~3-4x faster per decode matmul. The packed tensors are
opaque (no slicing, no state_dict), so a model packs its weights as the last step of loading,
after TP sharding.

    kernel = select_linear_kernel(weight)       # None: keep F.linear
    packed = kernel.pack(weight)                # once, at load
    y = kernel.linear(x, packed, bias)          # == F.linear(x, weight, bias)

oneDNN builds one primitive per input shape and keeps it in two caches (its own primitive cache
and ideep's LRU above it, 1024 entries each by default), about 0.3 MiB per entry with its
buffers. A server's batches have a new row count almost every step (prefill chunks plus decode
tokens), so a long-running server's RSS climbed by about 2 MiB/s until both caches were full
(measured: ``kthena bench soak``, docs/bench_serve.md). The packed kernel therefore runs on
row counts from a fixed set (`row_bucket`: exact up to 16 rows, then 8 sizes per power of two,
fewer than 16 or 12.5% padding rows), so the caches hold a few hundred primitives and stop growing, and
the primitive for a recurring size is built once instead of every step. Matmuls smaller than
`ONE_THREAD_MAX_MACS` run on the calling thread alone (see there).

Weight-only int8 (``INT8_WEIGHT_ONLY``, ``--quantization int8``) halves the bytes a decode step
reads. `pack_int8_weight` quantises each output channel symmetrically (``mooncake_ops.quant``:
scale = absmax / 127) into one int8 tensor [N, K + 4]: a row's K values, then its float32
scale's 4 bytes. `int8_linear` runs decode-sized calls (up to `INT8_MAX_OP_ROWS` rows)
through the native kernel, which reads the int8 bytes in place (half bf16's bytes), and larger
calls (prefill, compute-bound) through F.linear over the weight dequantised to x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from mooncake_ops.dispatch import impl
from mooncake_ops.errors import OpsDTypeError, OpsShapeError
from mooncake_ops.quant import quantize_int8, unpack_int8_rows

__all__ = ["INT8_MAX_OP_ROWS", "INT8_WEIGHT_ONLY", "ONE_THREAD_MAX_MACS", "LinearKernel", "dequantize_int8_weight",
           "int8_linear", "pack_int8_weight", "row_bucket", "select_linear_kernel"]


@attrs.frozen
class LinearKernel:
    """A matmul over weights re-laid-out once: ``linear(x, pack(w), b)`` computes ``F.linear(x, w, b)``.

    Attributes:
        name: for reports, e.g. ``onednn-packed-bf16``.
        pack: a dense ``[out_features, in_features]`` weight -> the kernel's opaque layout.
        linear: ``(x, packed_weight, bias=None) -> y``, the F.linear signature.
    """

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


# Matmuls of fewer multiply-adds run on the calling thread alone: waking the other OpenMP
# threads costs more than they save (a decode step's per-layer matmuls, ~0.5-2 M each, ran
# ~3x slower on 2 threads than on 1 on this project's shared 2-core machines; its LM head,
# 28 M, runs ~2x faster on 2). Measured end to end: batch-1 decode 24 tok/s on 2 threads,
# 30 on 1 (`kthena bench serve --cases a --threads 1|2`).
ONE_THREAD_MAX_MACS = 1 << 21


def row_bucket(rows: int) -> int:
    """The row count a packed matmul of ``rows`` rows runs with (>= rows; zero rows padded).

    Exact up to 16 rows (decode batches); above, rounded up to a multiple of 1/8 of the power
    of two below it (16 from 17 to 255, 32 to 511, 64 to 1023, ...): 8 sizes per octave, fewer
    than max(16, rows / 8) extra rows.
    """
    if rows <= 16:
        return rows
    granule = max(16, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // granule) * granule


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    padded = row_bucket(rows) if x.dim() == 2 else rows
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    threads = torch.get_num_threads()
    if threads > 1 and padded * weight.shape[0] * weight.shape[1] < ONE_THREAD_MAX_MACS:
        torch.set_num_threads(1)  # this calling thread's OpenMP setting; ~0.3 us each way
        try:
            y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")
        finally:
            torch.set_num_threads(threads)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")
    return y if padded == rows else y[:rows]


ONEDNN_PACKED_BF16 = LinearKernel("onednn-packed-bf16", _onednn_pack, _onednn_linear)


def select_linear_kernel(weight: torch.Tensor) -> LinearKernel | None:
    """The packed-weight kernel for weights like ``weight`` on this host, if one beats F.linear.

    Args:
        weight: a representative weight: its device and dtype decide.

    Returns:
        `ONEDNN_PACKED_BF16` for a bf16 weight on a CPU whose oneDNN has bf16 kernels; None
        otherwise (keep ``F.linear`` and the dense weights).
    """
    if (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return ONEDNN_PACKED_BF16
    return None


# ---- weight-only int8 ----------------------------------------------------------------------------
INT8_MAX_OP_ROWS = 64


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] -> int8 [N, K + 4]: each row quantised per output channel, its
    float32 scale's bytes after its values.

    Raises:
        OpsShapeError: not 2-D.  OpsDTypeError: not floating point.
    """
    if weight.dim() != 2:
        raise OpsShapeError(f"pack_int8_weight takes a 2-D weight [out_features, in_features]; "
                            f"got {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise OpsDTypeError(f"pack_int8_weight takes a floating point weight; got {weight.dtype}")
    q, scale = quantize_int8(weight.detach())
    return torch.cat([q, scale.reshape(-1, 1).view(torch.int8)], dim=1).contiguous()


def dequantize_int8_weight(packed: torch.Tensor, dtype: torch.dtype = torch.float32
                           ) -> torch.Tensor:
    """The dense [N, K] weight a packed int8 weight stands for (q * scale), in ``dtype``."""
    _check_packed(packed)
    q, scale = unpack_int8_rows(packed)
    return (q.float() * scale).to(dtype)


def int8_linear(x: torch.Tensor, packed: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize_int8_weight(packed), bias)`` in x's dtype; x [M, K] (or [..., K]).

    Up to `INT8_MAX_OP_ROWS` rows (decode batches) run the ``int8_linear`` op: the native kernel
    on AVX-512 CPUs, else the fp32 reference. More rows (prefill chunks, compute-bound) run
    F.linear over the weight dequantised to x's dtype: as fast as the native kernel there, and
    x keeps its own precision.

    Raises:
        OpsShapeError: x's last dim is not the weight's K; the weight is not packed int8.
    """
    _check_packed(packed)
    if not x.is_floating_point():
        raise OpsDTypeError(f"x has dtype {x.dtype}; int8_linear takes a floating point x")
    if x.shape[-1] != packed.shape[1] - 4:
        raise OpsShapeError(f"x has {x.shape[-1]} features; the weight takes "
                            f"{packed.shape[1] - 4} (packed [N, K + 4] = {tuple(packed.shape)})")
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > INT8_MAX_OP_ROWS:
        out = F.linear(rows, dequantize_int8_weight(packed, x.dtype), bias)
    else:
        out = impl("int8_linear", x.device.type)(rows, packed, bias)
    return out.reshape(*x.shape[:-1], packed.shape[0])


def _check_packed(packed: torch.Tensor) -> None:
    if packed.dim() != 2 or packed.dtype != torch.int8 or packed.shape[1] < 5:
        raise OpsShapeError(f"an int8 weight is packed by pack_int8_weight: int8 [N, K + 4]; got "
                            f"{packed.dtype} {tuple(packed.shape)}")


INT8_WEIGHT_ONLY = LinearKernel("int8-weight-only", pack_int8_weight, int8_linear)
