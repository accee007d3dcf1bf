"""Weight-only int8 matmul (``INT8_WEIGHT_ONLY``, ``--quantization int8``): half the bytes a decode
step reads of bf16 weights.

`pack_int8_weight` quantises each output channel symmetrically (``mooncake_ops.quant``:
scale = absmax / 127) into one int8 tensor [N, K + 4]: a row's K values, then its float32
scale's 4 bytes. Where the AVX-512 build runs, bf16 calls of at least `INT8_PANEL_MIN_ROWS`
rows (batched decode, prefill chunks) take its panel-dequantising bf16 matmul
(``bf16_int8_weight_linear``; ``bf16_int8_weight_gate_up_silu`` for the MLP's fused SwiGLU
input). Other calls of up to `INT8_MAX_OP_ROWS` rows run the ``int8_linear`` op, which reads
the int8 bytes in place (half bf16's bytes); larger ones F.linear over the weight dequantised to
x's dtype (bf16 x on a CPU without bf16 arithmetic: in fp32 over weight slices dequantised to
fp32, as `mooncake_ops.linear.FP32_COMPUTE_BF16` slices its weights).

`INT8_OP`, `INT8_NATIVE_PANEL` and `INT8_DEQUANT_DENSE` run one of those paths on every call,
over the same packed weights, for kernel choice by measurement (`mooncake_ops.selection`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mooncake_ops.dispatch import impl, native_enabled
from mooncake_ops.errors import OpsDTypeError, OpsShapeError
from mooncake_ops.layers import silu_and_mul
from mooncake_ops.linear import (
    LinearKernel,
    fp32_sliced_linear,
    native_module,
    onednn_bf16_available,
)
from mooncake_ops.quant import quantize_int8, unpack_int8_rows

__all__ = ["INT8_DEQUANT_DENSE", "INT8_MAX_OP_ROWS", "INT8_NATIVE_PANEL", "INT8_OP",
           "INT8_PANEL_MIN_ROWS", "INT8_WEIGHT_ONLY", "dequantize_int8_weight", "int8_linear",
           "int8_panel_available", "pack_int8_weight"]

INT8_MAX_OP_ROWS = 64
# bf16 calls of at least this many rows run the AVX-512 build's panel-dequantising matmul where
# it runs: per SmolLM2 step (30 layers' matmuls, cold weights, Zen 5, 2 threads) it ties the
# int8 op at 8 rows (8.3 ms) and wins from there (16 rows 10.8 against 12.7 ms, 32 rows 14.7
# against 20.0); at 4 rows the op, which reads each int8 byte once, takes 3.9 against 9.7.
INT8_PANEL_MIN_ROWS = 9


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

    bf16 x on CPU of at least `INT8_PANEL_MIN_ROWS` rows (batched decode, prefill chunks) runs
    the AVX-512 build's ``bf16_int8_weight_linear`` where it runs (the bf16 matmul's
    micro-kernel over each 64-output panel dequantised into a per-thread buffer: the weight
    rounded to bf16 exactly as ``dequantize_int8_weight(packed, torch.bfloat16)``). Otherwise
    up to `INT8_MAX_OP_ROWS` rows run the ``int8_linear`` op: the native kernel (either build),
    else the fp32 reference; more rows F.linear over the weight dequantised to x's dtype, or,
    for bf16 x on a CPU without bf16 arithmetic, fp32 over weight slices dequantised to fp32
    (`_int8_linear_fp32`), rounded once into bf16.

    Raises:
        OpsShapeError: x's last dim is not the weight's K; the weight is not packed int8.
        OpsDTypeError: x is not floating point.
    """
    _check_int8_call(x, packed)
    out = _int8_matmul(x.reshape(-1, x.shape[-1]), packed, bias)
    return out.reshape(*x.shape[:-1], packed.shape[0])


def _int8_matmul(rows: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """`int8_linear` of checked 2-D rows: the choice of path its docstring describes."""
    out = None
    if rows.shape[0] >= INT8_PANEL_MIN_ROWS:
        out = _native_int8_rows("bf16_int8_weight_linear", rows, packed, bias)
    if out is None and rows.shape[0] <= INT8_MAX_OP_ROWS:
        out = impl("int8_linear", rows.device.type)(rows, packed, bias)
    elif out is None:
        out = _int8_linear_rows(rows, packed, bias)
    return out


def _check_int8_call(x: torch.Tensor, packed: torch.Tensor) -> None:
    _check_packed(packed)
    if not x.is_floating_point():
        raise OpsDTypeError(f"x has dtype {x.dtype}; int8_linear takes a floating point x")
    if x.shape[-1] != packed.shape[1] - 4:
        raise OpsShapeError(f"x has {x.shape[-1]} features; the weight takes "
                            f"{packed.shape[1] - 4} (packed [N, K + 4] = {tuple(packed.shape)})")


def _native_int8_rows(entry: str, rows: torch.Tensor, *args: torch.Tensor | None
                      ) -> torch.Tensor | None:
    """The AVX-512 build's prefill-sized int8 matmul ``entry`` on bf16 CPU rows; None where it
    does not run (native off or not built, no AVX512_BF16, shapes outside its layout)."""
    if rows.dtype != torch.bfloat16 or rows.device.type != "cpu" or not native_enabled():
        return None
    from mooncake_ops.backends import native

    if not native.has(entry):
        return None
    return getattr(native_module(), entry)(rows, *args)


def _int8_linear_rows(rows: torch.Tensor, packed: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """A prefill-sized (more than `INT8_MAX_OP_ROWS` rows) int8 matmul the panel kernel did not
    take; see `int8_linear`."""
    if rows.dtype == torch.bfloat16 and rows.device.type == "cpu" and not onednn_bf16_available():
        return _int8_linear_fp32(rows, packed, bias)
    return F.linear(rows, dequantize_int8_weight(packed, rows.dtype), bias)


def _int8_gate_up_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul(int8_linear(x, packed))`` for a packed [gate; up] weight; bf16 calls of at
    least `INT8_PANEL_MIN_ROWS` rows in one pass where the AVX-512 build runs
    (``bf16_int8_weight_gate_up_silu``: the [rows, 2W] half-way never written, each sum rounded
    to bf16 first as the unfused path rounds it)."""
    _check_int8_call(x, packed)
    rows = x.reshape(-1, x.shape[-1])
    out = None
    if rows.shape[0] >= INT8_PANEL_MIN_ROWS:
        out = _native_int8_rows("bf16_int8_weight_gate_up_silu", rows, packed)
    if out is None:
        out = silu_and_mul(_int8_matmul(rows, packed, None))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _int8_linear_fp32(rows: torch.Tensor, packed: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """A prefill-sized int8 matmul of bf16 rows where the CPU has no bf16 arithmetic: fp32
    F.linear over slices of the weight dequantised to fp32 (L3-sized, as
    `FP32_COMPUTE_BF16` slices its weights), each slice's y rounded into the bf16 output."""
    return fp32_sliced_linear(rows, packed.shape[1] - 4, packed.shape[0], bias,
                              lambda n0, n1: dequantize_int8_weight(packed[n0:n1]))


def _check_packed(packed: torch.Tensor) -> None:
    if packed.dim() != 2 or packed.dtype != torch.int8 or packed.shape[1] < 5:
        raise OpsShapeError(f"an int8 weight is packed by pack_int8_weight: int8 [N, K + 4]; got "
                            f"{packed.dtype} {tuple(packed.shape)}")


INT8_WEIGHT_ONLY = LinearKernel("int8-weight-only", pack_int8_weight, int8_linear,
                                pack_int8_weight, _int8_gate_up_silu)


# The int8 paths one at a time, over the same packed int8 weights, for kernel choice by
# measurement (`mooncake_ops.selection`): INT8_WEIGHT_ONLY above mixes them by fixed row counts.
def _int8_op_linear(x: torch.Tensor, packed: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Every call through the ``int8_linear`` op (reads the int8 bytes in place)."""
    _check_int8_call(x, packed)
    rows = x.reshape(-1, x.shape[-1])
    return impl("int8_linear", rows.device.type)(rows, packed, bias).reshape(
        *x.shape[:-1], packed.shape[0])


def _int8_panel_linear(x: torch.Tensor, packed: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Every call through the AVX-512 build's panel-dequantising bf16 matmul."""
    _check_int8_call(x, packed)
    out = _native_int8_rows("bf16_int8_weight_linear", x.reshape(-1, x.shape[-1]), packed, bias)
    if out is None:
        raise OpsDTypeError("the native panel-dequantising int8 matmul does not run here (it "
                            "takes bf16 CPU rows on an AVX512_BF16 build)")
    return out.reshape(*x.shape[:-1], packed.shape[0])


def _int8_panel_gate_up_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    _check_int8_call(x, packed)
    out = _native_int8_rows("bf16_int8_weight_gate_up_silu", x.reshape(-1, x.shape[-1]), packed)
    if out is None:
        raise OpsDTypeError("the native fused int8 SwiGLU matmul does not run here (it takes "
                            "bf16 CPU rows on an AVX512_BF16 build)")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _int8_dequant_linear(x: torch.Tensor, packed: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Every call: the weight dequantised, then torch's matmul (fp32 slices where the CPU has
    no bf16 arithmetic)."""
    _check_int8_call(x, packed)
    out = _int8_linear_rows(x.reshape(-1, x.shape[-1]), packed, bias)
    return out.reshape(*x.shape[:-1], packed.shape[0])


def _unfused_gate_up(linear: Callable[..., torch.Tensor]
                     ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def gate_up_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(linear(x, packed))
    return gate_up_silu


INT8_OP = LinearKernel("int8-op", pack_int8_weight, _int8_op_linear, pack_int8_weight,
                       _unfused_gate_up(_int8_op_linear))
INT8_NATIVE_PANEL = LinearKernel("int8-native-panel", pack_int8_weight, _int8_panel_linear,
                                 pack_int8_weight, _int8_panel_gate_up_silu)
INT8_DEQUANT_DENSE = LinearKernel("int8-dequant-dense", pack_int8_weight, _int8_dequant_linear,
                                  pack_int8_weight, _unfused_gate_up(_int8_dequant_linear))


def int8_panel_available() -> bool:
    """Whether `INT8_NATIVE_PANEL` runs here (bf16 rows on the AVX-512 build)."""
    if not native_enabled() or native_module() is None:
        return False
    from mooncake_ops.backends import native

    return native.has("bf16_int8_weight_linear") and native.has("bf16_int8_weight_gate_up_silu")
