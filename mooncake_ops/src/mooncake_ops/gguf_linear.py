"""GGUF quantized matmul (``GGUF_WEIGHT_ONLY``, ``--quantization gguf``): a GGUF file's Q8_0,
Q4_0, Q4_1, Q4_K, Q5_K and Q6_K weights kept as the file stores them and dequantised in
registers inside the matmul.

    packed = pack_gguf_weight(reader_tensor_bytes, "Q4_1")   # uint8 [N, K / 32, 20], as stored
    y = gguf_linear(x, packed, bias)                          # x @ dequantize_gguf(packed)^T

Activations stay fp32 / bf16 / fp16: every weight value is dequantised to exactly the float32 the
reference (`mooncake_ops.gguf_quants.dequantize_gguf`, and the gguf package) gives, and the
products are summed in fp32, so ``y`` equals the dequantised model's matmul up to the order of
the sums (and one rounding to x's dtype). Decode-sized calls (up to `GGUF_MAX_OP_ROWS` rows,
`GGUF_BF16_MAX_OP_ROWS` for bf16 rows where the next path runs) take the native ``gguf_linear``
(``native/csrc/linear_gguf.cpp``, ``native/csrc_avx2/linear_gguf_avx2.cpp``), which reads each
weight byte once per call: a Q4_1 weight is 0.625 bytes per value against bf16's 2. Larger calls
are compute-bound: the weight is dequantised once per call, straight into the native bf16
matmul's packed layout for bf16 rows over a grouped weight on an AVX512_BF16 build, else to x's
dtype for torch's matmul (bf16 rows on a CPU without bf16 arithmetic: fp32 over dequantised
slices, as `mooncake_ops.linear_int8`). The bf16 paths round the weight to bf16 first, as the
dequantised bf16 model does; the native decode kernel keeps it in fp32.

`GGUF_WEIGHT_ONLY` is the `LinearKernel` a model swaps in; its ``pack`` takes a packed GGUF
weight as it is, and keeps a dense float weight dense (a GGUF file's F16 / BF16 / F32 tensors:
``linear`` runs F.linear on those). `GGUF_DEQUANT_DENSE` dequantises on every call (the
``kernels="torch"`` choice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mooncake_ops.dispatch import native_enabled
from mooncake_ops.errors import OpsDTypeError, OpsShapeError
from mooncake_ops.gguf_quants import (
    GROUP_ROWS,
    GGUFType,
    dequantize_gguf,
    gguf_out_features,
    gguf_type_of,
    is_grouped,
)
from mooncake_ops.linear import (
    NATIVE_PACKED_BF16,
    LinearKernel,
    fp32_sliced_linear,
    native_bf16_linear_available,
    native_dense_linear,
    native_module,
    onednn_bf16_available,
)

__all__ = ["GGUF_BF16_MAX_OP_ROWS", "GGUF_DEQUANT_DENSE", "GGUF_MAX_OP_ROWS", "GGUF_WEIGHT_ONLY",
           "dense_gguf_kernel", "gguf_linear", "gguf_linear_reference", "native_gguf_available"]

# Calls of more rows dequantise the weight once per call and run a dense matmul. The native
# kernel decodes each weight block again for every 4 x rows, the dense path dequantises it once
# (~0.2 ms for the default model's 3072 x 576 gate/up weight). Measured on a Zen 4 (1 thread,
# that weight): bf16 rows over a grouped weight where the native bf16 matmul runs cross over
# between 4 rows (native 0.19 ms, dequantised 0.26) and 8 (0.39 against 0.32); fp32 rows,
# whose dense path is torch's fp32 matmul over an fp32 copy, favour the native kernel to 64
# rows (2.2 against 3.6 ms). See docs/mooncake_ops.md.
GGUF_MAX_OP_ROWS = 64
GGUF_BF16_MAX_OP_ROWS = 6


def native_gguf_available() -> bool:
    """Whether the native GGUF kernels run here (a build with ``gguf_linear`` is loaded and
    mooncake_ops may use it)."""
    if not native_enabled() or native_module() is None:
        return False
    from mooncake_ops.backends import native

    return native.has("gguf_linear") and native.has("gguf_dequantize")


def gguf_linear(x: torch.Tensor, packed: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize_gguf(packed), bias)`` in x's dtype, up to the rounding of fp32
    sums (`mooncake_ops.gguf_linear` says how far); x ``[..., K]``. A dense float ``packed`` (a
    GGUF F16 / F32 tensor, or bf16 that `dense_gguf_kernel` packed) runs the bf16 matmul the
    fused decode step runs here, else F.linear (`_dense_linear`).

    Raises:
        OpsShapeError: x's last dim is not the weight's K; ``packed`` is neither a packed GGUF
            weight nor a dense one.
        OpsDTypeError: x is not floating point.
    """
    if packed.is_floating_point():
        return _dense_linear(x, packed, bias)
    kind = _check_call(x, packed)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = None
    if rows.device.type == "cpu" and (rows.shape[0] <= GGUF_BF16_MAX_OP_ROWS or (
            rows.shape[0] <= GGUF_MAX_OP_ROWS and not _packed_bf16_runs(rows, packed))):
        native = _native_entry("gguf_linear")  # on every decode matmul: no more than this
        if native is not None:
            out = native(rows, packed, kind.type_id,
                         bias if bias is None or bias.dtype == rows.dtype else bias.to(rows.dtype))
    if out is None:
        out = _dequantized_linear(rows, packed, kind, bias)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def gguf_linear_reference(x: torch.Tensor, packed: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: fp32 F.linear over `dequantize_gguf`, rounded once to x's dtype."""
    _check_call(x, packed)
    y = F.linear(x.float(), dequantize_gguf(packed), None if bias is None else bias.float())
    return y.to(x.dtype)


def _check_call(x: torch.Tensor, packed: torch.Tensor) -> GGUFType:
    kind = gguf_type_of(packed)
    if not x.is_floating_point():
        raise OpsDTypeError(f"x has dtype {x.dtype}; gguf_linear takes a floating point x")
    k = packed.shape[1] * kind.block_size
    if x.shape[-1] != k:
        raise OpsShapeError(f"x has {x.shape[-1]} features; the {kind.name} weight takes {k} "
                            f"(packed {tuple(packed.shape)})")
    return kind


def _native_entry(name: str) -> Callable[..., Any] | None:
    """The loaded build's entry ``name``, or None (no build, native kernels switched off)."""
    if not native_enabled():
        return None
    module = native_module()
    return None if module is None else getattr(module, name, None)


def _dequantize(packed: torch.Tensor, dtype: torch.dtype,
                    kind: GGUFType | None = None) -> torch.Tensor:
    """`dequantize_gguf` (the same values), natively where the build runs."""
    kind = kind or gguf_type_of(packed)
    native = _native_entry("gguf_dequantize") if packed.device.type == "cpu" else None
    if native is not None:
        out = torch.empty(gguf_out_features(packed), packed.shape[1] * kind.block_size,
                          dtype=dtype)
        if native(packed, kind.type_id, out):
            return out
    return dequantize_gguf(packed, dtype)


def _dequantized_linear(rows: torch.Tensor, packed: torch.Tensor, kind: GGUFType,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """Prefill-sized calls: the weight dequantised once per call, then a dense matmul: the
    native bf16 one for bf16 rows over a grouped weight where it runs (`_packed_bf16_linear`),
    fp32 over dequantised slices for bf16 rows on a CPU without bf16 arithmetic, else torch's."""
    k, n = rows.shape[1], gguf_out_features(packed)
    bias = None if bias is None else bias.to(rows.dtype)
    if rows.dtype == torch.bfloat16 and rows.device.type == "cpu":
        out = _packed_bf16_linear(rows, packed, kind, bias)
        if out is not None:
            return out
        if not onednn_bf16_available():
            per = GROUP_ROWS if is_grouped(packed) else 1  # slices start at multiples of 64 rows
            return fp32_sliced_linear(rows, k, n, bias, lambda n0, n1: _dequantize(
                packed[n0 // per:-(-n1 // per)], torch.float32, kind))
    return F.linear(rows, _dequantize(packed, rows.dtype, kind), bias)


def _packed_bf16_runs(rows: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether `_packed_bf16_linear` runs this call (bf16 rows, a grouped weight, the native
    bf16 matmul and dequantiser loaded)."""
    return (rows.dtype == torch.bfloat16 and is_grouped(packed)
            and _native_entry("gguf_dequantize") is not None and native_bf16_linear_available())


def _packed_bf16_linear(rows: torch.Tensor, packed: torch.Tensor, kind: GGUFType,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
    """bf16 rows over a grouped weight on an AVX512_BF16 build: the weight dequantised straight
    into the native bf16 matmul's layout ([N / 16, K / 2, 16, 2], each value the reference's
    rounded to bf16) and run by it; None where that does not run."""
    if not _packed_bf16_runs(rows, packed):
        return None
    n, k = gguf_out_features(packed), rows.shape[1]
    weight = torch.empty(n // GROUP_ROWS, k // 2, GROUP_ROWS, 2, dtype=torch.bfloat16)
    if not _native_entry("gguf_dequantize")(packed, kind.type_id, weight):
        return None
    return native_module().bf16_linear(rows, weight, bias)


def _dequant_dense_linear(x: torch.Tensor, packed: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """Every call: the weight dequantised, then torch's matmul."""
    if packed.is_floating_point():
        return F.linear(x, packed.to(x.dtype), None if bias is None else bias.to(x.dtype))
    kind = _check_call(x, packed)
    out = _dequantized_linear(x.reshape(-1, x.shape[-1]), packed, kind, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """A packed GGUF weight as it is (checked); a dense float weight stays dense."""
    if weight.is_floating_point():
        return weight.detach().contiguous()
    gguf_type_of(weight)
    return weight.contiguous()


GGUF_WEIGHT_ONLY = LinearKernel("gguf", _pack, gguf_linear)


def _dense_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """A weight the file gave no blocks for, by the bf16 matmul the fused decode step runs on
    this build (so the step and the op chain agree bit for bit): the native packed one for a
    weight `dense_gguf_kernel` packed; the AVX2 build's dense one for bf16 (where loaded);
    else F.linear."""
    if weight.dim() == 4:
        return NATIVE_PACKED_BF16.linear(x, weight, bias)
    if x.dtype == weight.dtype == torch.bfloat16:
        y = native_dense_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        if y is not None:
            return y.reshape(*x.shape[:-1], y.shape[-1])
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _dense_pack(weight: torch.Tensor) -> torch.Tensor:
    """`NATIVE_PACKED_BF16`'s layout where the weight fits it (out_features a multiple of 16,
    in_features even); else dense, as it is (F.linear: `gguf_linear` reads no other layout)."""
    if weight.shape[0] % 16 or weight.shape[1] % 2:
        return _pack(weight)
    return NATIVE_PACKED_BF16.pack(weight)


def dense_gguf_kernel(sample: torch.Tensor) -> LinearKernel | None:
    """How `GGUF_WEIGHT_ONLY` lays out the bf16 weights a GGUF file gives it no blocks for (a
    type the native matmul does not read, an F16 tensor, a fused weight whose parts differ in
    type): the native bf16 matmul's packing and fused SwiGLU input, so that the fused decode
    step takes a model of mixed weights; `gguf_linear` runs what it packs. None (dense weights,
    F.linear) for other dtypes and devices, and where the native bf16 matmul does not run.

    Args:
        sample: one of the model's weights: its device and dtype decide."""
    if sample.device.type != "cpu" or sample.dtype != torch.bfloat16 or \
            not native_bf16_linear_available():
        return None
    return LinearKernel("gguf-dense-bf16", _dense_pack, gguf_linear,
                        NATIVE_PACKED_BF16.pack_gate_up, NATIVE_PACKED_BF16.gate_up_silu)
GGUF_DEQUANT_DENSE = LinearKernel("gguf-dequant-dense", _pack, _dequant_dense_linear)
