"""GGUF quantized matmul: the block formats against the gguf package, both packed layouts, and
every kernel against a float64 matmul over the same dequantised weight, within a derived bound.

The bound (`_bound`). Each output is a sum of products x_j w_j (w_j = a_b q_j + c_b of block
b's float32 scale terms). The kernels form it as fp32 FMAs and sums in their own grouping (the
grouped layout computes a_b * sum_j x_j q_j + c_b * sum_j x_j), so every x_j enters the result
through at most n = K + 2 K / 32 + 4 rounded operations, and Higham's bound for a sum of
products evaluated in any order gives |y - y64| <= gamma_n * sum_j |x_j| (|a_b q_j| + |c_b|),
gamma_n = n u / (1 - n u), u = 2^-24: the magnitudes of the terms as the kernel splits them, not
|w_j| (Q4_1's d q and m may cancel). A bf16 or fp16 output adds its own rounding (2^-8 or 2^-11
relative), and a prefill-sized bf16 call, which runs torch's matmul over the weight rounded to
bf16, adds 2^-8 * sum |x_j w_j|. Nothing here is measured: the same bound holds on every CPU.
"""

from __future__ import annotations

import pytest
import torch
from _mops_support import IMPLS, random_blocks, using

import mooncake_ops as mo
from mooncake_ops.gguf_linear import GGUF_BF16_MAX_OP_ROWS, GGUF_MAX_OP_ROWS, native_gguf_available
from mooncake_ops.gguf_quants import GROUP_ROWS, is_grouped, raw_blocks

U32 = 2.0**-24
UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
def magnitudes(packed: torch.Tensor) -> torch.Tensor:
    """|a q| + |c| per weight value (see the module docstring): the blocks dequantised with
    every fp16 scale made positive, for the types whose kernel adds c separately (Q4_1); |w|
    for the others (their kernels multiply by a * q exactly as dequantised)."""
    kind = mo.gguf_type_of(packed)
    if kind.name != "Q4_1":
        return mo.dequantize_gguf(packed).abs().double()
    blocks = raw_blocks(packed).clone()
    blocks[..., 1] &= 0x7F  # the sign bits of d and m (little-endian fp16)
    blocks[..., 3] &= 0x7F
    return mo.dequantize_gguf(mo.pack_gguf_weight(blocks, kind, grouped=False)).double()


def _bound(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           expected: torch.Tensor, prefill_bf16: bool) -> torch.Tensor:
    k = x.shape[-1]
    n = k + 2 * k // 32 + 4
    gamma = n * U32 / (1 - n * U32)
    xa = x.double().abs()
    fp32 = gamma * (xa @ magnitudes(packed).T + (0 if bias is None else bias.double().abs()))
    if prefill_bf16:
        fp32 = fp32 + UNIT[torch.bfloat16] * (xa @ mo.dequantize_gguf(packed).double().abs().T)
    return fp32 + UNIT[x.dtype] * (expected.abs() + fp32) + 1e-30


def check_against_float64(got: torch.Tensor, x: torch.Tensor, packed: torch.Tensor,
                          bias: torch.Tensor | None, prefill_bf16: bool = False) -> None:
    weight = mo.dequantize_gguf(packed).double()
    expected = x.double() @ weight.T + (0 if bias is None else bias.double())
    assert got.dtype == x.dtype and got.shape == expected.shape
    excess = (got.double() - expected).abs() - _bound(x, packed, bias, expected, prefill_bf16)
    assert excess.max() <= 0, f"over the bound by {excess.max():.3g}"


@pytest.mark.parametrize("kind", list(mo.GGUF_TYPES))
@pytest.mark.parametrize("rows", [GROUP_ROWS * 2, 7])
def test_dequantize_is_bit_equal_to_the_gguf_package_in_both_layouts(kind, rows):
    gguf_quants = pytest.importorskip("gguf.quants")
    gguf_constants = pytest.importorskip("gguf.constants")
    gen = torch.Generator().manual_seed(rows)
    raw = random_blocks(kind, rows, 512, gen)
    expected = gguf_quants.dequantize(raw.numpy(), gguf_constants.GGMLQuantizationType[kind])
    for grouped in (True, False):
        packed = mo.pack_gguf_weight(raw, kind, 512, grouped=grouped)
        got = mo.dequantize_gguf(packed)
        assert torch.equal(got.view(torch.int32), torch.from_numpy(expected).view(torch.int32))
        assert torch.equal(raw_blocks(packed).reshape(rows, -1), raw)


@pytest.mark.parametrize("kind", list(mo.GGUF_TYPES))
def test_the_grouped_layout_is_used_where_the_type_and_rows_allow(kind):
    gen = torch.Generator().manual_seed(1)
    groupable = mo.GGUF_TYPES[kind].is_groupable
    for rows, expect_grouped in ((48, groupable), (40, False)):
        packed = mo.pack_gguf_weight(random_blocks(kind, rows, 256, gen), kind)
        assert is_grouped(packed) == expect_grouped
        assert mo.gguf_linear(torch.randn(2, 256), packed).shape == (2, rows)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", list(mo.GGUF_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, GGUF_BF16_MAX_OP_ROWS, GGUF_BF16_MAX_OP_ROWS + 3,
                                  GGUF_MAX_OP_ROWS + 9])
def test_gguf_linear_matches_float64_within_the_derived_bound(impl, kind, dtype, rows):
    """Fresh random inputs per case; out_features 48 (grouped where the type has it) and 36
    (rows layout, a partial 4-row block), with and without bias, 2-D and 3-D x; row counts on
    both sides of each native / dequantised switch."""
    gen = torch.Generator().manual_seed(list(mo.GGUF_TYPES).index(kind) * 100 + rows)
    in_features = 512
    with using(impl):
        for out_features, with_bias in ((48, True), (36, False)):
            packed = mo.pack_gguf_weight(random_blocks(kind, out_features, in_features, gen),
                                         kind)
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
            # bf16 rows past the native rows run a dense bf16 matmul (the weight in bf16)
            prefill_bf16 = dtype == torch.bfloat16 and (rows > GGUF_BF16_MAX_OP_ROWS
                                                        or impl == "reference")
            check_against_float64(mo.gguf_linear(x, packed, bias), x, packed, bias, prefill_bf16)
            got3 = mo.gguf_linear(x.unsqueeze(0), packed, bias)
            assert got3.shape == (1, rows, out_features)
            assert torch.equal(got3[0], mo.gguf_linear(x, packed, bias))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", list(mo.GGUF_TYPES))
def test_native_gguf_kernel_itself_matches_float64(threads, kind):
    """The loaded build's entry called directly (a declined call fails), fp32 / bf16 / fp16 x,
    both layouts, and a weight past the one-thread bound (threads split the rows)."""
    if not native_gguf_available():
        pytest.skip("the native GGUF kernels are not built")
    module = mo.linear.native_module()
    gen = torch.Generator().manual_seed(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, out_features, in_features in ((1, 2048, 1024), (4, 64, 256), (6, 20, 512)):
            raw = random_blocks(kind, out_features, in_features, gen)
            for grouped in (True, False):
                packed = mo.pack_gguf_weight(raw, kind, grouped=grouped)
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    x = torch.randn(rows, in_features, generator=gen).to(dtype)
                    got = module.gguf_linear(x, packed, mo.gguf_type(kind).type_id)
                    assert got is not None, f"the {kind} kernel declined"
                    check_against_float64(got, x, packed, None)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kind", list(mo.GGUF_TYPES))
def test_native_dequantize_gives_the_reference_values(kind):
    if not native_gguf_available():
        pytest.skip("the native GGUF kernels are not built")
    gen = torch.Generator().manual_seed(3)
    packed = mo.pack_gguf_weight(random_blocks(kind, 64, 512, gen), kind)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(64, 512, dtype=dtype)
        assert mo.linear.native_module().gguf_dequantize(packed, mo.gguf_type(kind).type_id, out)
        assert torch.equal(out, mo.dequantize_gguf(packed, dtype))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_native_dequantize_into_the_bf16_matmuls_layout(kind):
    """A grouped weight dequantised straight into bf16_linear's [N / 16, K / 2, 16, 2]: the
    reference's values rounded to bf16, laid out as bf16_pack_weight lays them out."""
    if not (native_gguf_available() and mo.linear.native_bf16_linear_available()):
        pytest.skip("the native GGUF and bf16 kernels are not both built for this CPU")
    packed = mo.pack_gguf_weight(random_blocks(kind, 64, 512, torch.Generator()), kind)
    out = torch.empty(4, 256, 16, 2, dtype=torch.bfloat16)
    assert mo.linear.native_module().gguf_dequantize(packed, mo.gguf_type(kind).type_id, out)
    expected = mo.dequantize_gguf(packed, torch.bfloat16)
    assert torch.equal(mo.linear.unpack_native_bf16_weight(out), expected)
    assert torch.equal(out, mo.linear.native_module().bf16_pack_weight(expected))


def test_dense_weights_stay_dense_and_run_f_linear():
    weight = torch.randn(8, 32)
    packed = mo.GGUF_WEIGHT_ONLY.pack(weight)
    assert packed.dtype == torch.float32 and torch.equal(packed, weight)
    x = torch.randn(3, 32)
    assert torch.equal(mo.GGUF_WEIGHT_ONLY.linear(x, packed), torch.nn.functional.linear(x, weight))


def test_gguf_refuses_what_it_cannot_run():
    gen = torch.Generator().manual_seed(0)
    packed = mo.pack_gguf_weight(random_blocks("Q4_1", 16, 64, gen), "Q4_1")
    with pytest.raises(mo.OpsShapeError, match="x has 32 features; the Q4_1 weight takes 64"):
        mo.gguf_linear(torch.randn(2, 32), packed)
    with pytest.raises(mo.OpsDTypeError, match="gguf_linear takes a floating point x"):
        mo.gguf_linear(torch.ones(2, 64, dtype=torch.int32), packed)
    with pytest.raises(mo.OpsShapeError, match="packed by pack_gguf_weight"):
        mo.gguf_linear(torch.randn(2, 64), torch.zeros(16, 2, 7, dtype=torch.uint8))
    with pytest.raises(mo.OpsDTypeError, match="'Q5_0' has no quantized matmul here; allowed: "
                                               "Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K"):
        mo.pack_gguf_weight(torch.zeros(4, 22, dtype=torch.uint8), "Q5_0")
    with pytest.raises(mo.OpsShapeError, match="Q4_1 rows are whole blocks of 20 bytes"):
        mo.pack_gguf_weight(torch.zeros(4, 30, dtype=torch.uint8), "Q4_1")
    with pytest.raises(mo.OpsShapeError, match="hold 32 values; expected 64"):
        mo.pack_gguf_weight(torch.zeros(4, 20, dtype=torch.uint8), "Q4_1", 64)
    with pytest.raises(mo.OpsDTypeError, match="raw bytes"):
        mo.pack_gguf_weight(torch.zeros(4, 20), "Q4_1")


def test_native_gguf_refuses_bad_values():
    if not native_gguf_available():
        pytest.skip("the native GGUF kernels are not built")
    module = mo.linear.native_module()
    packed = mo.pack_gguf_weight(random_blocks("Q8_0", 16, 64, torch.Generator()), "Q8_0")
    with pytest.raises(ValueError, match=r"GGUF type 99 has no kernel; allowed: Q4_0 \(2\)"):
        module.gguf_linear(torch.randn(1, 64), packed, 99)
    with pytest.raises(ValueError, match="a weight of GGUF type 3 is uint8"):
        module.gguf_linear(torch.randn(1, 64), packed, 3)  # Q8_0 bytes called Q4_1
    with pytest.raises(ValueError, match="x has 32 features; the weight's 2 blocks"):
        module.gguf_linear(torch.randn(1, 32), packed, 8)


def test_dense_weights_of_a_gguf_model_run_the_native_bf16_matmul_gguf_linear_hands_them():
    """`dense_gguf_kernel`: a bf16 weight the GGUF file gave no blocks for is packed as the bf16
    model packs it, and `gguf_linear` runs the same kernel on it (the same result, bit for bit);
    a shape outside that layout stays dense (F.linear, bit for bit), and fp32 gets no packing."""
    torch.manual_seed(0)
    w, odd = torch.randn(64, 96).bfloat16(), torch.randn(40, 96).bfloat16()  # 40: not 16k rows
    x = torch.randn(3, 96).bfloat16()
    assert mo.dense_gguf_kernel(w.float()) is None
    kernel = mo.dense_gguf_kernel(w)
    if kernel is None:  # no native bf16 matmul on this CPU: the weights stay dense
        assert not mo.linear.native_bf16_linear_available()
        return
    packed = kernel.pack(w)
    assert packed.dim() == 4
    want = mo.linear.NATIVE_PACKED_BF16.linear(x, mo.linear.NATIVE_PACKED_BF16.pack(w))
    assert torch.equal(mo.gguf_linear(x, packed), want)
    kept = kernel.pack(odd)
    assert kept.dim() == 2 and torch.equal(mo.gguf_linear(x, kept), torch.nn.functional.linear(x, odd))
