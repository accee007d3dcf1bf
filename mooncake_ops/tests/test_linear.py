"""select_linear_kernel: the packed oneDNN bf16 matmul against a float64 F.linear, and when it is chosen."""

from __future__ import annotations

import pytest
import torch
from _mops_support import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_ops as mo

BF16_KERNEL = mo.select_linear_kernel(torch.empty(1, dtype=torch.bfloat16))


@pytest.mark.skipif(BF16_KERNEL is None, reason="this CPU's oneDNN has no bf16 kernels")
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


@pytest.mark.skipif(BF16_KERNEL is None, reason="this CPU's oneDNN has no bf16 kernels")
@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(rows=st.integers(17, 700), seed=st.integers(0, 999))
def test_padded_rows_do_not_change_the_real_rows(rows, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    weight = torch.randn(80, 64, generator=gen).bfloat16()
    got = BF16_KERNEL.linear(x, BF16_KERNEL.pack(weight))
    assert got.shape == (rows, 80) and got.is_contiguous()
    assert_close(got, torch.nn.functional.linear(x.double(), weight.double()), torch.bfloat16)
