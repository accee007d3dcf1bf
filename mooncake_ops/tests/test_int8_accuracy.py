"""What int8 KV costs in accuracy, on activations shaped like a real Llama layer's.

The figures are printed (``pytest -s``); the bound is derived, not measured. The decode kernel's
error against float64 attention on the exact activations splits in two: the format's (float64
attention over the inputs as the cache holds them: bf16-rounded, or int8-quantised per token
and head), computed here and the same on every CPU; and the kernel's own arithmetic on those
inputs, which float32 sums and at most two bf16 roundings (softmax weights, output) keep within
2u (u = 2^-8, bf16's unit roundoff) relative. Measured on a Zen 5: SmolLM2 shape int8 3.0e-2
(format 3.0e-2; 4 outlier channels squeeze the other channels' int8 steps), bf16 2.6e-3
(format 2.4e-3); Llama-70B per-rank shape 7.9e-3 for both (format 7.7e-3). The benchmark
reports the same measure. The quantiser's own bound (half a step per element) is
test_kv_cache.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _mops_support import IMPLS, using

from mooncake_ops.bench import SHAPES, int8_error, realistic_kv
from mooncake_ops.quant import dequantize_int8, quantize_int8

CONTEXT, SEED = 512, 1
KERNEL_ARITHMETIC = 2 * 2.0**-8  # two bf16 roundings, each within u = 2^-8 relative


def _attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    dim = q.shape[-1]
    return F.scaled_dot_product_attention(
        q.double()[:, :, None], k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None],
        scale=dim ** -0.5, enable_gqa=True)[:, :, 0]


def _format_errors(shape: tuple[int, int, int]) -> dict[str, float]:
    """Relative L2 error of float64 attention over the cached forms of the inputs
    (``int8_error`` writes bf16 K/V, which the int8 cache quantises; q is bf16 for both)."""
    q, k, v = realistic_kv(CONTEXT, shape, SEED)
    exact = _attention64(q, k, v)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    forms = {"bf16": (k, v),
             "int8": (dequantize_int8(*quantize_int8(k)), dequantize_int8(*quantize_int8(v)))}
    return {name: float((_attention64(q, *kv) - exact).norm() / exact.norm())
            for name, kv in forms.items()}


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_int8_kv_error_vs_bf16(name, shape):
    with using(name):
        row = int8_error(CONTEXT, SHAPES[shape], seed=SEED)
        fmt = _format_errors(SHAPES[shape])
    print(f"\n{name} {shape}: bf16 rel L2 {row['bf16_rel_l2']:.2e} (format {fmt['bf16']:.2e}), "
          f"int8 rel L2 {row['int8_rel_l2']:.2e} (format {fmt['int8']:.2e}; max abs "
          f"{row['int8_max_abs']:.2e})")
    assert 0 < fmt["bf16"] and 0 < fmt["int8"]
    assert row["bf16_rel_l2"] <= fmt["bf16"] + KERNEL_ARITHMETIC
    assert row["int8_rel_l2"] <= fmt["int8"] + KERNEL_ARITHMETIC
