"""Which kernel runs a linear layer's matmul on CPU: a kernel over pre-packed bf16 weights
(native AVX512_BF16, else oneDNN), bf16 weights computed in fp32 where the CPU has no bf16
arithmetic (`FP32_COMPUTE_BF16`: decode-sized calls through the AVX2 build's dense kernel where
it is loaded), or F.linear.

A batch-1 ``F.linear`` in bf16 runs at half the memory bandwidth of fp32 (the generic path
converts as it goes), and a 56 MB LM head alone costs ~10 ms. Where the native build runs on a
CPU with AVX512_BF16, `NATIVE_PACKED_BF16` (``native/csrc/linear_bf16.cpp``) lays each weight out
as bf16 pairs for 16 outputs side by side ([N/16, K/2, 16, 2]) and runs every row count on it:
decode rows stream the weight once, prefill chunks run a register-tiled GEMM. Elsewhere
oneDNN's ``_linear_pointwise`` over a weight re-ordered once into its blocked layout streams the
weight at full speed: ~3-4x faster per decode matmul than F.linear. Packed tensors are not
plain weights (no slicing; oneDNN's are opaque), so a model packs its weights as the last step
of loading, after TP sharding.

    kernel = select_linear_kernel(weight)       # None: keep F.linear
    packed = kernel.pack(weight)                # once, at load
    y = kernel.linear(x, packed, bias)          # == F.linear(x, weight, bias)

oneDNN builds one primitive per input shape and keeps it in two caches (its own primitive cache
and ideep's LRU above it, 1024 entries each by default), about 0.3 MiB per entry with its
buffers. A server's batches have a new row count almost every step (prefill chunks plus decode
tokens), so a long-running server's RSS climbed by about 2 MiB/s until both caches were full
(measured: ``kthena bench soak``, docs/bench_serve.md). The oneDNN kernel therefore runs on
row counts from a fixed set (`row_bucket`: exact up to 16 rows, then 8 sizes per power of two,
fewer than 16 or 12.5% padding rows), so the caches hold a few hundred primitives and stop growing, and
the primitive for a recurring size is built once instead of every step. Matmuls smaller than
`ONE_THREAD_MAX_MACS` run on the calling thread alone (see there).

`TORCH_DENSE` is plain F.linear over the dense weight, as a kernel (``--kernels torch``).
Weight-only int8 kernels live in `mooncake_ops.linear_int8`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import attrs
import torch
import torch.nn.functional as F

from mooncake_ops.dispatch import native_enabled
from mooncake_ops.layers import silu_and_mul

__all__ = ["FP32_COMPUTE_BF16", "FP32_MIN_ROWS", "NATIVE_PACKED_BF16", "ONEDNN_PACKED_BF16",
           "ONE_THREAD_MAX_MACS", "TORCH_DENSE", "LinearKernel", "fp32_sliced_linear",
           "native_bf16_linear_available", "native_module", "onednn_bf16_available",
           "row_bucket", "select_linear_kernel", "unpack_native_bf16_weight"]


@attrs.frozen
class LinearKernel:
    """A matmul over weights re-laid-out once: ``linear(x, pack(w), b)`` computes ``F.linear(x, w, b)``.

    Attributes:
        name: for reports, e.g. ``onednn-packed-bf16``.
        pack: a dense ``[out_features, in_features]`` weight -> the kernel's opaque layout.
        linear: ``(x, packed_weight, bias=None) -> y``, the F.linear signature.
        pack_gate_up, gate_up_silu: optional fused SwiGLU input: ``pack_gate_up(w)`` takes a
            ``[2W, in_features]`` weight (gate rows, then up rows) and returns its packed form,
            or None when this weight does not fit; ``gate_up_silu(x, packed)`` computes
            ``silu_and_mul(linear(x, w))`` ([rows, W]) without writing the [rows, 2W] half-way.
    """

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    pack_gate_up: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    gate_up_silu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def _dense_pack(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().contiguous()


TORCH_DENSE = LinearKernel("torch-dense", _dense_pack, F.linear)


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN has bf16 kernels here: this CPU has bf16 arithmetic for torch (AVX-512 at
    least); without it (e.g. AMD Zen 3) a bf16 F.linear of many rows runs ~9 GFLOP/s."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


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


# ---- bf16 weights computed in fp32 (CPUs without bf16 arithmetic) -------------------------------
# Where neither the native kernel nor oneDNN has bf16 instructions to run (x86 without AVX-512,
# e.g. AMD Zen 3), a bf16 F.linear converts as it goes and its time grows with every row: a
# 1,024-row matmul of this project's default model's gate/up shape ran at ~9 GFLOP/s on one Zen 3
# thread, ~80 in fp32. One row is a weight stream, where bf16's half bytes win (the 49,152 x 576
# LM head: 3.5 ms in bf16, 11.5 from an fp32 copy, 2 threads). So the weight stays bf16 (the
# bytes a plan counts) and calls of `FP32_MIN_ROWS` rows or more upcast it a slice of at most
# 2^22 elements at a time (16 MB, within the L3: no 113 MB fp32 LM head is allocated for bf16
# x), in multiples of 64 rows, and run F.linear in fp32 on x upcast, each slice's y rounded into
# the bf16 output. Measured, 2 threads, ms (bf16 F.linear / fp32 copy of the weight / sliced
# upcast): gate_up 32 rows 6.7 / 1.9 / 2.3; qkv 1,024 rows - / 10.1 / 10.6; LM head 32 rows
# 107 / 42 / 25. Slices of 2^20 elements cut the 3,072-row gate/up weight at row 1,820; its
# 967-row prefill matmul took 43 ms so, 31 cut at row 1,792 and 26-27 in one slice (Zen 3).
# Where the AVX2 native build is loaded, every call runs its ``dense_linear`` instead
# (``native/csrc_avx2/linear_avx2.cpp``) over the dense bf16 weight as it is, widened to fp32
# inside the kernel: no fp32 copy of a weight slice is made. Measured on a Zen 3 (2 threads,
# this model's shapes, the same run, weights cycling through 30 copies so they come from DRAM
# as in a decode step; GFLOP/s, native / the sliced upcast below): 32 rows 73-93 / 44-59, the
# LM head at 32 rows 83 / 35; 64 rows 95-106 / 51-71; 967 rows (a prefill chunk) 113-133 /
# 118-135. Up to 2 rows (one weight stream) the native kernel reads ~8.5 GB/s per thread
# against ~4.5 for bf16 F.linear: the LM head at 1 row, one thread, 7.8 ms against 14.3.
FP32_MIN_ROWS = 5
_FP32_SLICE_ELEMENTS = 1 << 22


def native_dense_linear(rows: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor | None:
    """The AVX2 build's ``dense_linear`` over ``rows`` [M, K], or None where it does not run
    (no such build, native kernels switched off, or a call it declines). On every matmul: no
    imports or lookups beyond the cached module's attribute."""
    if not native_enabled():
        return None
    dense = getattr(native_module(), "dense_linear", None)  # None: no build, or not the AVX2 one
    if dense is None:
        return None
    return dense(rows, weight, None if bias is None else bias.to(rows.dtype))


def _fp32_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = native_dense_linear(rows, weight, bias)
    if y is not None:
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if rows.shape[0] < FP32_MIN_ROWS or x.dtype != torch.bfloat16:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    n, k = weight.shape
    y = fp32_sliced_linear(rows, k, n, bias, lambda n0, n1: weight[n0:n1].float())
    return y.reshape(*x.shape[:-1], n)


def fp32_sliced_linear(rows: torch.Tensor, k: int, n: int, bias: torch.Tensor | None,
                       weight_rows: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """F.linear of ``rows`` [M, K] in fp32 over ``n`` outputs, one L3-sized slice of the weight at
    a time (at most `_FP32_SLICE_ELEMENTS` elements, whole multiples of 64 outputs):
    ``weight_rows(n0, n1)`` is the weight's rows n0..n1 in fp32. Each slice's y is rounded into
    the output, in ``rows``' dtype."""
    step = max(64, _FP32_SLICE_ELEMENTS // max(k, 1) // 64 * 64)
    x32 = rows.float()
    y = rows.new_empty(rows.shape[0], n)
    for n0 in range(0, n, step):
        part = None if bias is None else bias[n0:n0 + step].float()
        y[:, n0:n0 + step] = F.linear(x32, weight_rows(n0, n0 + step), part)
    return y


FP32_COMPUTE_BF16 = LinearKernel("bf16-fp32-compute", _dense_pack, _fp32_linear)


# ---- native bf16 (AVX512_BF16) -------------------------------------------------------------------
_NATIVE: dict[str, object] = {}


def native_module() -> ModuleType | None:
    """The native extension module, or None when no build loads here."""
    if "module" not in _NATIVE:
        from mooncake_ops.backends import native

        _NATIVE["module"] = native._load()
    return _NATIVE["module"]


def native_bf16_linear_available() -> bool:
    """Whether the native bf16 matmul runs here: the AVX-512 build is loaded, mooncake_ops may
    use it (``use_native``), and the CPU has AVX512_BF16 (the AVX2 build has no packed bf16 matmul:
    its ``dense_linear`` runs inside `FP32_COMPUTE_BF16`)."""
    from mooncake_ops.backends import native

    module = native_module() if native_enabled() else None
    return (module is not None and native.has("bf16_linear_supported")
            and bool(module.bf16_linear_supported()))


def _native_pack(weight: torch.Tensor) -> torch.Tensor:
    w = weight.detach()
    if w.shape[0] % 16 or w.shape[1] % 2:  # outside the kernel's layout: oneDNN's packing
        return _onednn_pack(w)
    return native_module().bf16_pack_weight(w.contiguous())


def unpack_native_bf16_weight(packed: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight of a natively packed [N/16, K/2, 16, 2] one."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)


def _native_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dim() != 4:  # a weight _native_pack left to oneDNN
        return _onednn_linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    y = native_module().bf16_linear(rows, weight, bias)
    if y is None:  # a call the kernel does not take (e.g. a float32 x): the dense weight
        y = F.linear(rows, unpack_native_bf16_weight(weight).to(x.dtype),
                     None if bias is None else bias.to(x.dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows -> 16-row blocks alternating gate block j, up block j."""
    width, k = weight.shape[0] // 2, weight.shape[1]
    return weight.reshape(2, width // 16, 16, k).transpose(0, 1).reshape(2 * width, k)


def _deinterleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of `_interleave_gate_up`: back to [gate; up] rows."""
    width, k = weight.shape[0] // 2, weight.shape[1]
    return weight.reshape(width // 16, 2, 16, k).transpose(0, 1).reshape(2 * width, k)


def _native_pack_gate_up(weight: torch.Tensor) -> torch.Tensor | None:
    w = weight.detach()
    if w.shape[0] % 32 or w.shape[1] % 2:
        return None
    return native_module().bf16_pack_weight(_interleave_gate_up(w).contiguous())


def _native_gate_up_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = native_module().bf16_gate_up_silu(rows, packed)
    if y is None:  # a call the kernel does not take (e.g. a float32 x): unfused, dense weight
        dense = _deinterleave_gate_up(unpack_native_bf16_weight(packed))
        y = silu_and_mul(F.linear(rows, dense.to(x.dtype)))
    return y.reshape(*x.shape[:-1], y.shape[-1])


NATIVE_PACKED_BF16 = LinearKernel("native-packed-bf16", _native_pack, _native_linear,
                                  _native_pack_gate_up, _native_gate_up_silu)


def select_linear_kernel(weight: torch.Tensor) -> LinearKernel | None:
    """The packed-weight kernel for weights like ``weight`` on this host, if one beats F.linear.

    Args:
        weight: a representative weight: its device and dtype decide.

    Returns:
        For a bf16 weight on CPU: `NATIVE_PACKED_BF16` where `native_bf16_linear_available`
        (weights whose out_features is not a multiple of 16 or in_features odd get oneDNN's
        packing inside it), else `ONEDNN_PACKED_BF16` where oneDNN has bf16 kernels, else
        `FP32_COMPUTE_BF16` (no bf16 arithmetic on this CPU: matmuls of several rows in fp32).
        None for other dtypes and devices (keep ``F.linear`` and the dense weights).
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if native_bf16_linear_available():
        return NATIVE_PACKED_BF16
    if onednn_bf16_available():
        return ONEDNN_PACKED_BF16
    return FP32_COMPUTE_BF16
