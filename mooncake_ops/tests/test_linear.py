"""select_linear_kernel: the packed bf16 matmuls (native AVX512_BF16, oneDNN, fp32 compute)
against a float64 F.linear, and when each is chosen; the weight-only int8 matmul."""

from __future__ import annotations

import pytest
import torch
from _mops_support import DTYPES, IMPLS, TOLERANCES, assert_close, using
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_ops as mo

BF16_KERNEL = mo.select_linear_kernel(torch.empty(1, dtype=torch.bfloat16))
ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
NATIVE_BF16 = mo.linear.native_bf16_linear_available()


@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(rows=st.integers(1, 9), in_features=st.sampled_from([48, 64, 100]),
       out_features=st.sampled_from([8, 80, 96]), with_bias=st.booleans(), seed=st.integers(0, 999))
def test_packed_linear_matches_float64_linear(rows, in_features, out_features, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    got = BF16_KERNEL.linear(x, BF16_KERNEL.pack(weight), bias)
    expected = torch.nn.functional.linear(x.double(), weight.double(),
                                          None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert_close(got, expected, torch.bfloat16)


@settings(max_examples=max(10, settings.default.max_examples // 4), deadline=None)
@given(rows=st.integers(1, 40), in_features=st.sampled_from([48, 64, 100]),
       out_features=st.sampled_from([8, 80, 96]), with_bias=st.booleans(), batched=st.booleans(),
       slice_elements=st.sampled_from([64, 1 << 20]), seed=st.integers(0, 2**31 - 1))
def test_fp32_compute_bf16_kernel_matches_float64_linear(rows, in_features, out_features,
                                                         with_bias, batched, slice_elements, seed):
    """The kernel for CPUs without bf16 arithmetic, on every CPU: the AVX2 build's dense
    kernel where it is loaded (it declines in_features 100: not a multiple of 8), else the bf16
    weight as it is (bf16 F.linear below FP32_MIN_ROWS rows), else fp32 over weight slices (one
    slice, or several of 64 rows when a slice holds 64 elements)."""
    kernel = mo.linear.FP32_COMPUTE_BF16
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    packed = kernel.pack(weight)
    assert packed.dtype == torch.bfloat16 and torch.equal(packed, weight)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mo.linear, "_FP32_SLICE_ELEMENTS", slice_elements)
        got = kernel.linear(x.unsqueeze(0) if batched else x, packed, bias)
    expected = torch.nn.functional.linear(x.double(), weight.double(),
                                          None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16
    assert got.shape == ((1, rows, out_features) if batched else (rows, out_features))
    assert_close(got.reshape(rows, out_features), expected, torch.bfloat16)
    if rows >= mo.linear.FP32_MIN_ROWS:  # exactly fp32 compute, rounded once
        fp32 = torch.nn.functional.linear(x.float(), weight.float(),
                                          None if bias is None else bias.float())
        torch.testing.assert_close(got.reshape(rows, out_features), fp32.bfloat16(),
                                   atol=1e-3, rtol=2**-7)


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=8, deadline=None)
@given(rows=st.one_of(st.integers(1, 40), st.integers(235, 490)),
       in_features=st.sampled_from([8, 64, 576]),
       out_features=st.integers(1, 70), x_dtype=st.sampled_from(DTYPES),
       w_dtype=st.sampled_from(DTYPES), with_bias=st.booleans(), strided=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_native_dense_linear_itself_matches_float64(threads, rows, in_features, out_features,
                                                    x_dtype, w_dtype, with_bias, strided, seed):
    """The AVX2 build's dense_linear called directly (a declined call fails): rows 1-2 read the
    weight in place 4 rows at a time, more rows run the 16-row weight panels in blocks of 6 x
    rows (and K slices of 256 at in_features 576), past 240 rows in several row chunks; output
    counts that are not a multiple of 4 or 16; every x and weight dtype; weight rows further
    apart than in_features; one thread and two (the LM head-sized call, and the larger row
    counts, cross the kernel's threshold)."""
    from mooncake_ops.backends import native

    if not native.has("dense_linear"):
        pytest.skip("the loaded native build has no dense_linear (only the AVX2 build has it)")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(x_dtype)
    wide = torch.randn(out_features, in_features + (8 if strided else 0), generator=gen)
    weight = wide.to(w_dtype)[:, :in_features]
    bias = torch.randn(out_features, generator=gen).to(x_dtype) if with_bias else None
    big_w = torch.randn(4099, 576, generator=gen).to(w_dtype)  # past the 2^17 thread bound
    big_x = torch.randn(1, 576, generator=gen).to(x_dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native._load().dense_linear(x, weight, bias)
        big = native._load().dense_linear(big_x, big_w, None)
    finally:
        torch.set_num_threads(previous)
    assert got is not None and big is not None, "the AVX2 kernel declined a call it covers"
    assert got.dtype == x_dtype and got.shape == (rows, out_features)
    expected = torch.nn.functional.linear(x.double(), weight.double(),
                                          None if bias is None else bias.double())
    atol, rtol = (1e-4, 1e-4) if x_dtype == torch.float32 else TOLERANCES[x_dtype]
    torch.testing.assert_close(got.double(), expected, atol=atol * in_features ** 0.5, rtol=rtol)
    torch.testing.assert_close(big.double(), big_x.double() @ big_w.double().T,
                               atol=atol * 24, rtol=rtol)


def test_native_dense_linear_declines_or_refuses_what_it_cannot_run():
    from mooncake_ops.backends import native

    if not native.has("dense_linear"):
        pytest.skip("the loaded native build has no dense_linear (only the AVX2 build has it)")
    kernel = native._load().dense_linear
    w = torch.randn(16, 64).bfloat16()
    assert kernel(torch.randn(2, 60).bfloat16(), torch.randn(16, 60).bfloat16(), None) is None
    assert kernel(torch.randn(2, 64).bfloat16(), w.T.contiguous().T, None) is None  # columns
    assert kernel(torch.randn(2, 64, dtype=torch.float64), w, None) is None
    assert kernel(torch.randn(2, 64), w, torch.randn(16).bfloat16()) is None  # bias dtype
    with pytest.raises(ValueError, match=r"dense_linear: weight is \[16, 64\]; x has 32"):
        kernel(torch.randn(2, 32), w, None)


def test_bf16_weights_get_fp32_compute_where_the_cpu_has_no_bf16_arithmetic():
    if NATIVE_BF16:
        assert BF16_KERNEL is mo.linear.NATIVE_PACKED_BF16
    elif ONEDNN_BF16:
        assert BF16_KERNEL is mo.linear.ONEDNN_PACKED_BF16
    else:  # e.g. x86 without AVX-512 (AMD Zen 3): a bf16 F.linear converts as it goes
        assert BF16_KERNEL is mo.linear.FP32_COMPUTE_BF16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_keep_f_linear(dtype):
    assert mo.select_linear_kernel(torch.empty(4, 4, dtype=dtype)) is None


def test_non_cpu_weights_keep_f_linear():
    assert mo.select_linear_kernel(torch.empty(4, 4, dtype=torch.bfloat16, device="meta")) is None


def test_row_buckets_are_few_and_pad_less_than_16_rows_or_an_eighth():
    buckets = {mo.linear.row_bucket(rows) for rows in range(1, 4097)}
    for rows in range(1, 4097):
        padded = mo.linear.row_bucket(rows)
        assert 0 <= padded - rows < max(16, rows / 8), rows
        assert mo.linear.row_bucket(padded) == padded, rows
    # 1..16 exact, multiples of 16 up to 256, then 8 per power of two up to 4096
    assert len(buckets) == 16 + 15 + 8 * 4


@pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU's oneDNN has no bf16 kernels")
@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(rows=st.integers(17, 700), seed=st.integers(0, 999))
def test_padded_rows_do_not_change_the_real_rows(rows, seed):
    kernel = mo.linear.ONEDNN_PACKED_BF16  # the kernel that pads rows to a bucket
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    weight = torch.randn(80, 64, generator=gen).bfloat16()
    got = kernel.linear(x, kernel.pack(weight))
    assert got.shape == (rows, 80) and got.is_contiguous()
    assert_close(got, torch.nn.functional.linear(x.double(), weight.double()), torch.bfloat16)


# ---- native bf16 ------------------------------------------------------------------------------------

native_only = pytest.mark.skipif(not NATIVE_BF16, reason="no native build, or no AVX512_BF16 on this CPU")


@native_only
@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=max(10, settings.default.max_examples // 4), deadline=None)
@given(rows=st.one_of(st.integers(1, 70), st.sampled_from([129, 300])),
       in_features=st.sampled_from([2, 30, 64, 100, 576]),
       blocks=st.integers(1, 13), with_bias=st.booleans(), strided=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_native_bf16_linear_matches_float64_linear(threads, rows, in_features, blocks, with_bias,
                                                   strided, seed):
    """The native kernel itself on fresh random inputs: row counts across its 4-row tiles and
    thread splits (columns, rows, or at 300 rows (panel, 256-row) tasks taken as threads free
    up, the second partial), out_features = 16 x blocks (partial 64-column panels), K not a
    multiple of 32, x as rows of a wider tensor (the model's fused-projection slices)."""
    assert mo.select_linear_kernel(torch.empty(1, dtype=torch.bfloat16)) is mo.linear.NATIVE_PACKED_BF16
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, in_features + (7 if strided else 0), generator=gen).bfloat16()
    x = wide[:, :in_features]
    weight = torch.randn(16 * blocks, in_features, generator=gen).bfloat16()
    bias = torch.randn(16 * blocks, generator=gen).bfloat16() if with_bias else None
    packed = mo.linear.NATIVE_PACKED_BF16.pack(weight)
    assert packed.shape == (blocks, in_features // 2, 16, 2)
    assert torch.equal(mo.linear.unpack_native_bf16_weight(packed), weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = mo.linear.NATIVE_PACKED_BF16.linear(x, packed, bias)
        batched = mo.linear.NATIVE_PACKED_BF16.linear(x.reshape(1, rows, in_features), packed, bias)
    finally:
        torch.set_num_threads(previous)
    expected = torch.nn.functional.linear(x.double(), weight.double(),
                                          None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 16 * blocks)
    assert_close(got, expected, torch.bfloat16)
    assert torch.equal(batched[0], got)


@native_only
def test_native_bf16_weights_outside_its_layout_get_onednn_packing():
    """out_features not a multiple of 16 (or odd in_features): that weight is packed and run by
    oneDNN inside the same kernel, and a float32 x runs the dense weight."""
    gen = torch.Generator().manual_seed(3)
    kernel = mo.linear.NATIVE_PACKED_BF16
    for shape in ((40, 64), (32, 63)):
        weight = torch.randn(*shape, generator=gen).bfloat16()
        packed = kernel.pack(weight)
        assert packed.dim() == 2  # oneDNN's opaque layout, not [N/16, K/2, 16, 2]
        x = torch.randn(5, shape[1], generator=gen).bfloat16()
        assert_close(kernel.linear(x, packed), torch.nn.functional.linear(x.double(), weight.double()),
                     torch.bfloat16)
    weight = torch.randn(32, 64, generator=gen).bfloat16()
    x = torch.randn(3, 64, generator=gen)
    got = kernel.linear(x, kernel.pack(weight))
    assert got.dtype == torch.float32
    assert_close(got, torch.nn.functional.linear(x.double(), weight.double()), torch.float32)


@native_only
@pytest.mark.parametrize("rows", [7, 32, 129, 300, 1024])
def test_native_bf16_linear_gives_two_threads_the_same_answer_as_one(rows):
    """Calls whose 64-column panels do not divide among the threads (9 panels: 576 outputs,
    the model's o and down projections): decode-sized ones (7, 32 rows) give each thread 18
    of the 36 16-column blocks, in panels of 4, 4, 4, 3, 3; prefill-sized ones split each
    panel's rows as well. Every output is still summed by one micro-tile in one order, so two
    threads agree with one bit for bit, and both with float64, on fresh random inputs."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    weight = (torch.randn(576, 576, generator=gen) / 24).bfloat16()
    kernel = mo.linear.NATIVE_PACKED_BF16
    packed = kernel.pack(weight)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.linear(x, packed)
        torch.set_num_threads(2)
        two = kernel.linear(x, packed)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)
    assert_close(two, torch.nn.functional.linear(x.double(), weight.double()), torch.bfloat16)


@native_only
@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=max(10, settings.default.max_examples // 4), deadline=None)
@given(rows=st.one_of(st.integers(1, 40), st.sampled_from([129, 300])),
       width_blocks=st.sampled_from([1, 3, 4, 96]), in_features=st.sampled_from([30, 64, 576]),
       seed=st.integers(0, 2**31 - 1))
def test_native_fused_gate_up_silu_equals_matmul_then_silu_and_mul(threads, rows, width_blocks,
                                                                    in_features, seed):
    """The fused SwiGLU input rounds the gate and up sums to bf16 before silu * up, as the
    unfused matmul's bf16 output does: the two agree bit for bit, on fresh random inputs (an odd
    number of gate/up block pairs leaves a half panel), and both match float64."""
    gen = torch.Generator().manual_seed(seed)
    width = 16 * width_blocks
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = (torch.randn(2 * width, in_features, generator=gen) / in_features ** 0.5).bfloat16()
    kernel = mo.linear.NATIVE_PACKED_BF16
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = kernel.gate_up_silu(x, kernel.pack_gate_up(weight))
        unfused = mo.silu_and_mul(kernel.linear(x, kernel.pack(weight)))
    finally:
        torch.set_num_threads(previous)
    assert fused.shape == (rows, width) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, unfused)
    both = torch.nn.functional.linear(x.double(), weight.double())
    gate, up = both[:, :width], both[:, width:]
    assert_close(fused, gate * torch.sigmoid(gate) * up, torch.bfloat16)


@native_only
def test_native_fused_gate_up_declines_what_it_cannot_lay_out():
    kernel = mo.linear.NATIVE_PACKED_BF16
    assert kernel.pack_gate_up(torch.randn(2 * 24, 64).bfloat16()) is None  # width not 16k
    assert kernel.pack_gate_up(torch.randn(2 * 16, 63).bfloat16()) is None  # odd in_features
    weight = torch.randn(2 * 32, 64).bfloat16()
    x = torch.randn(3, 64)  # float32 x: the unfused path over the dense weight
    got = kernel.gate_up_silu(x, kernel.pack_gate_up(weight))
    both = torch.nn.functional.linear(x.double(), weight.double())
    assert_close(got, both[:, :32] * torch.sigmoid(both[:, :32]) * both[:, 32:], torch.float32)


# ---- weight-only int8 ----------------------------------------------------------------------------

def _int8_oracle(x, packed, bias):
    """By definition, float64: row n of the weight is q[n] * scale[n] (scale from its 4 bytes)."""
    k = x.shape[-1]
    q = packed[:, :k].double()
    scale = torch.tensor([float(packed[n, k:].numpy().view("<f4")[0]) for n in range(len(packed))],
                         dtype=torch.float64)
    out = x.double() @ (q * scale[:, None]).T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(rows=st.integers(1, 16), in_features=st.sampled_from([16, 64, 576]),
       out_features=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       with_bias=st.booleans(), seed=st.integers(0, 999))
def test_int8_linear_matches_the_dequantised_weight(impl, rows, in_features, out_features, dtype,
                                                    with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    packed = mo.pack_int8_weight(weight)
    with using(impl):
        got = mo.int8_linear(x, packed, bias)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    expected = _int8_oracle(x, packed, bias)
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (3e-2, 1e-2)
    torch.testing.assert_close(got.double(), expected, atol=atol * in_features ** 0.5, rtol=rtol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64, 250])
def test_native_int8_linear_itself_matches_float64(threads, rows):
    """The loaded build's int8 kernel called directly (a declined call fails), every x dtype,
    with and without bias, an output count that is not a multiple of its 4-row block, and an
    LM-head-sized weight that crosses its thread threshold."""
    from mooncake_ops.backends import native

    if not native.has("int8_linear"):
        pytest.skip(f"native kernels not built: {native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(rows * 10 + threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in DTYPES:
            for out_features, with_bias in ((70, True), (4099, False)):
                x = torch.randn(rows, 576, generator=gen).to(dtype)
                packed = mo.pack_int8_weight(torch.randn(out_features, 576, generator=gen))
                bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
                got = native._load().int8_linear(x, packed, bias)
                assert got is not None, f"the {native.isa()} int8 kernel declined"
                atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (3e-2, 1e-2)
                torch.testing.assert_close(got.double(), _int8_oracle(x, packed, bias),
                                           atol=atol * 24, rtol=rtol)
    finally:
        torch.set_num_threads(previous)


def test_int8_weight_round_trips_within_half_a_step():
    weight = torch.randn(33, 64) * torch.logspace(-3, 1, 33)[:, None]  # rows of every magnitude
    packed = mo.pack_int8_weight(weight)
    assert packed.dtype == torch.int8 and packed.shape == (33, 68)
    back = mo.dequantize_int8_weight(packed)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((back - weight).abs() <= step / 2 * (1 + 1e-5)).all()
    assert mo.dequantize_int8_weight(mo.pack_int8_weight(torch.zeros(2, 16))).eq(0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_int8_linear_past_the_native_rows_and_in_3d(impl):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 64, generator=gen)
    packed = mo.pack_int8_weight(weight)
    dense = mo.dequantize_int8_weight(packed)
    x = torch.randn(2, 40, 64, generator=gen)  # 80 rows: the dequantise-and-F.linear path
    with using(impl):
        got = mo.int8_linear(x, packed)
        one = mo.int8_linear(x[0, 0], packed)  # a single vector
    torch.testing.assert_close(got, torch.nn.functional.linear(x, dense), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(one, dense @ x[0, 0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_prefill_rows_of_bf16_in_fp32_match_the_oracle(with_bias):
    """The path bf16 rows past INT8_MAX_OP_ROWS take where the CPU has no bf16 arithmetic
    (fp32 over weight slices dequantised to fp32), called directly on every CPU with three
    slices (16, 16 and 8 rows), and int8_linear's own choice for the same call: that path, or
    with bf16 arithmetic a bf16 F.linear over the weight dequantised to bf16 (its oracle takes
    that rounded weight: bf16 rounding of 64 products is not within bf16's 1e-2 of the exact)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(80, 64, generator=gen).bfloat16()
    packed = mo.pack_int8_weight(torch.randn(40, 64, generator=gen))
    bias = torch.randn(40, generator=gen).bfloat16() if with_bias else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mo.linear, "_FP32_SLICE_ELEMENTS", 16 * 64)
        direct = mo.linear_int8._int8_linear_fp32(x, packed, bias)
    chosen = mo.int8_linear(x, packed, bias)
    exact = _int8_oracle(x, packed, bias)
    if mo.linear.onednn_bf16_available():
        weight = mo.dequantize_int8_weight(packed, torch.bfloat16).double()
        bf16_weight = x.double() @ weight.T + (0 if bias is None else bias.double())
    else:
        bf16_weight = exact
    for got, oracle in ((direct, exact), (chosen, bf16_weight)):
        assert got.dtype == torch.bfloat16 and got.shape == (80, 40)
        assert_close(got, oracle, torch.bfloat16)
    fp32 = torch.nn.functional.linear(x.float(), mo.dequantize_int8_weight(packed),
                                      None if bias is None else bias.float())
    torch.testing.assert_close(direct, fp32.bfloat16(), atol=1e-3, rtol=2**-7)


@native_only
@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=max(10, settings.default.max_examples // 4), deadline=None)
@given(rows=st.one_of(st.integers(9, 140), st.sampled_from([300, 600])),
       blocks=st.integers(1, 13), in_features=st.sampled_from([32, 64, 576]),
       with_bias=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_native_int8_weight_prefill_equals_the_bf16_matmul_over_the_dequantised_weight(
        threads, rows, blocks, in_features, with_bias, strided, seed):
    """bf16 int8 calls of INT8_PANEL_MIN_ROWS rows or more (batched decode, prefill chunks) run
    the AVX-512 build's panel-dequantising kernel: on fresh random inputs it gives bit for bit what the native bf16
    matmul gives over ``dequantize_int8_weight(packed, bf16)`` packed (the same micro-tile, the
    weight rounded the same way), and matches the float64 oracle over that rounded weight.
    Row counts across the 256-row tasks, partial 64-output panels, x as rows of a wider tensor."""
    from mooncake_ops.backends import native

    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, in_features + (5 if strided else 0), generator=gen).bfloat16()
    x = wide[:, :in_features]
    packed = mo.pack_int8_weight(torch.randn(16 * blocks, in_features, generator=gen))
    bias = torch.randn(16 * blocks, generator=gen).bfloat16() if with_bias else None
    dense = mo.dequantize_int8_weight(packed, torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        direct = native._load().bf16_int8_weight_linear(x, packed, bias)
        got = mo.int8_linear(x, packed, bias)
        bf16 = mo.linear.NATIVE_PACKED_BF16.linear(x, mo.linear.NATIVE_PACKED_BF16.pack(dense), bias)
    finally:
        torch.set_num_threads(previous)
    assert direct is not None, "the native int8-weight prefill kernel declined"
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 16 * blocks)
    assert torch.equal(direct, got) and torch.equal(got, bf16)
    oracle = x.double() @ dense.double().T + (0 if bias is None else bias.double())
    assert_close(got, oracle, torch.bfloat16)


@native_only
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [3, 16, 65, 300])
@pytest.mark.parametrize("width_blocks", [1, 3, 96])
def test_int8_fused_gate_up_silu_equals_the_unfused_path(threads, rows, width_blocks):
    """INT8_WEIGHT_ONLY's SwiGLU input: bf16 calls of INT8_PANEL_MIN_ROWS rows or more in one
    pass (gate and up sums rounded to bf16 before silu * up), equal bit for bit to the native
    bf16 fused kernel over the dequantised weight and to silu_and_mul over the unfused int8
    matmul; smaller ones (3 rows) are that unfused path. An odd number of gate/up block pairs leaves a half panel."""
    gen = torch.Generator().manual_seed(rows * 100 + width_blocks * 10 + threads)
    width = 16 * width_blocks
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    weight = torch.randn(2 * width, 576, generator=gen) / 24
    kernel = mo.INT8_WEIGHT_ONLY
    packed = kernel.pack_gate_up(weight)
    assert torch.equal(packed, mo.pack_int8_weight(weight))  # the same int8 layout, unfused or not
    dense = mo.dequantize_int8_weight(packed, torch.bfloat16)
    bf16 = mo.linear.NATIVE_PACKED_BF16
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = kernel.gate_up_silu(x, packed)
        unfused = mo.silu_and_mul(mo.int8_linear(x, packed))
        over_dense = bf16.gate_up_silu(x, bf16.pack_gate_up(dense))
    finally:
        torch.set_num_threads(previous)
    assert fused.shape == (rows, width) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, unfused)
    if rows >= mo.linear_int8.INT8_PANEL_MIN_ROWS:
        assert torch.equal(fused, over_dense)
    both = x.double() @ dense.double().T
    gate, up = both[:, :width], both[:, width:]
    assert_close(fused, gate * torch.sigmoid(gate) * up, torch.bfloat16)


@native_only
def test_native_int8_weight_prefill_declines_or_refuses_what_it_cannot_run():
    """Outside its layout (outputs not a multiple of 16, features not of 32, float32 x, a
    float32 bias) the kernel declines, and int8_linear's other path runs the first three; x whose features are
    not the weight's is refused by the kernel itself (ValueError) and by int8_linear first."""
    from mooncake_ops.backends import native

    module = native._load()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(80, 64, generator=gen).bfloat16()
    for packed, xx, bias in ((mo.pack_int8_weight(torch.randn(40, 64, generator=gen)), x, None),
                             (mo.pack_int8_weight(torch.randn(32, 48, generator=gen)), x[:, :48], None),
                             (mo.pack_int8_weight(torch.randn(32, 64, generator=gen)), x.float(), None)):
        assert module.bf16_int8_weight_linear(xx, packed, bias) is None
        got = mo.int8_linear(xx, packed, bias)
        expected = torch.nn.functional.linear(xx, mo.dequantize_int8_weight(packed, xx.dtype))
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
    packed = mo.pack_int8_weight(torch.randn(32, 64, generator=gen))
    assert module.bf16_int8_weight_linear(x, packed, torch.randn(32, generator=gen)) is None
    with pytest.raises(ValueError, match="x has 32 features but the packed int8 weight takes 64"):
        module.bf16_int8_weight_linear(x[:, :32], packed, None)
    with pytest.raises(mo.OpsShapeError, match="x has 32 features; the weight takes 64"):
        mo.INT8_WEIGHT_ONLY.gate_up_silu(x[:, :32], packed)


def test_int8_linear_refuses_what_it_cannot_run():
    packed = mo.pack_int8_weight(torch.randn(8, 32))
    with pytest.raises(mo.OpsShapeError, match="x has 16 features; the weight takes 32"):
        mo.int8_linear(torch.randn(2, 16), packed)
    with pytest.raises(mo.OpsShapeError, match=r"packed by pack_int8_weight: int8 \[N, K \+ 4\]"):
        mo.int8_linear(torch.randn(2, 32), torch.randn(8, 36))
    with pytest.raises(mo.OpsDTypeError, match="int8_linear takes a floating point x"):
        mo.int8_linear(torch.ones(2, 32, dtype=torch.int32), packed)
    with pytest.raises(mo.OpsShapeError, match="2-D weight"):
        mo.pack_int8_weight(torch.randn(2, 3, 4))
    with pytest.raises(mo.OpsDTypeError, match="floating point weight"):
        mo.pack_int8_weight(torch.ones(2, 16, dtype=torch.int8))


@pytest.mark.skipif(BF16_KERNEL is None, reason="this CPU's oneDNN has no bf16 kernels")
def test_small_matmuls_run_on_one_thread_and_give_the_thread_count_back():
    from mooncake_ops.linear import ONE_THREAD_MAX_MACS

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(5)
        for rows, out_features in ((1, 64), (64, ONE_THREAD_MAX_MACS // (64 * 64))):  # below, above
            x = torch.randn(rows, 64, generator=gen).bfloat16()
            weight = torch.randn(out_features, 64, generator=gen).bfloat16()
            got = BF16_KERNEL.linear(x, BF16_KERNEL.pack(weight))
            assert torch.get_num_threads() == 2
            assert_close(got, torch.nn.functional.linear(x.double(), weight.double()), torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
