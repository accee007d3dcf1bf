"""Sizing: bytes per token with num_key_value_heads, known answers, per-rank shapes, budgets."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_kv.sizing import (
    KVDtype,
    KVShape,
    SizingError,
    kv_cache_max_tokens,
    max_num_blocks,
    max_num_tokens,
)

MiB = 1 << 20
GiB = 1 << 30


def llama2_70b(num_kv_heads: int = 8, **overrides) -> KVShape:
    """Llama-2-70B's cache on one rank holding `num_kv_heads` of its 8 KV heads."""
    return KVShape(num_layers=80, num_kv_heads=num_kv_heads, head_dim=128, **overrides)


def test_llama2_70b_is_320_kib_per_token_in_bf16():
    assert llama2_70b().bytes_per_token == 327_680 == 320 * 1024


def test_llama2_70b_128_tokens_are_40_mib():
    shape = llama2_70b()
    assert 128 * shape.bytes_per_token == 40 * MiB
    assert max_num_tokens(shape, 40 * MiB) == 128
    assert max_num_tokens(shape, 40 * MiB - 1) == 112  # one block short: whole blocks only


def test_counting_attention_heads_would_overstate_eightfold():
    wrong = KVShape(num_layers=80, num_kv_heads=64, head_dim=128)
    assert wrong.bytes_per_token == 8 * llama2_70b().bytes_per_token


def test_smollm2_135m():
    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64)
    assert shape.bytes_per_token == 23_040
    assert shape.bytes_per_block == 23_040 * 16
    assert shape.fingerprint() == "L30-H3-D64-B16-bf16"


@pytest.mark.parametrize("heads", [8, 4, 3, 2, 1])
def test_bytes_scale_with_the_heads_a_rank_holds(heads):
    # The shape takes a per-rank head count; kthena_core owns the TP split (8 over tp=3: 3, 3, 2).
    assert llama2_70b(heads).bytes_per_token == 327_680 * heads // 8


def test_sizing_has_no_tp_rule_of_its_own():
    import mooncake_kv
    import mooncake_kv.sizing

    assert not hasattr(mooncake_kv.sizing, "kv_heads_per_rank")
    assert "kv_heads_per_rank" not in mooncake_kv.__all__
    assert not hasattr(KVShape, "for_model")


@pytest.mark.parametrize(("dtype", "per_token"), [("fp32", 655_360), ("fp16", 327_680),
                                                  ("bf16", 327_680), ("int8", 163_840 + 5_120)])
def test_dtypes(dtype, per_token):
    assert llama2_70b(dtype=dtype).bytes_per_token == per_token


def test_int8_counts_per_token_per_head_scales():
    shape = llama2_70b(dtype="int8")
    assert shape.element_bytes_per_token == 2 * 80 * 8 * 128
    assert shape.scale_bytes_per_token == 2 * 80 * 8 * 4


def test_dtype_aliases_and_errors():
    assert KVDtype.parse("bfloat16") is KVDtype.BF16
    assert KVDtype.parse("half") is KVDtype.FP16
    with pytest.raises(SizingError, match="unknown KV dtype 'fp8'.*bf16"):
        KVShape(num_layers=1, num_kv_heads=1, head_dim=1, dtype="fp8")


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_shape_fields_must_be_positive_ints(field, value):
    kwargs = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 2, "block_size": 2, field: value}
    with pytest.raises(SizingError, match=field):
        KVShape(**kwargs)


def test_kv_cache_max_tokens_for_a_70b_rank():
    shape = llama2_70b(1)  # tp=8: one KV head and 40 KiB per token per rank
    weights = 140 * GiB // 8
    tokens = kv_cache_max_tokens(shape, device_bytes=80 * GiB, weight_bytes=weights,
                                 memory_utilization=0.9, reserved_bytes=2 * GiB)
    usable = int(80 * GiB * 0.9) - weights - 2 * GiB
    assert tokens == usable // shape.bytes_per_block * 16
    assert tokens % 16 == 0


def test_kv_cache_max_tokens_is_zero_when_weights_fill_the_device():
    assert kv_cache_max_tokens(llama2_70b(), device_bytes=80 * GiB, weight_bytes=140 * GiB) == 0


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_kv_cache_max_tokens_rejects_bad_utilization(utilization):
    with pytest.raises(SizingError, match="memory_utilization"):
        kv_cache_max_tokens(llama2_70b(), device_bytes=GiB, weight_bytes=0,
                            memory_utilization=utilization)


def test_negative_budget_is_refused():
    with pytest.raises(SizingError, match="num_bytes"):
        max_num_blocks(llama2_70b(), -1)


@given(
    layers=st.integers(1, 100), heads=st.integers(1, 16), head_dim=st.integers(1, 256),
    block=st.integers(1, 64), dtype=st.sampled_from(list(KVDtype)),
    budget=st.integers(0, 1 << 40),
)
def test_max_num_blocks_is_the_largest_that_fits(layers, heads, head_dim, block, dtype, budget):
    shape = KVShape(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                    block_size=block, dtype=dtype)
    blocks = max_num_blocks(shape, budget)
    assert blocks * shape.bytes_per_block <= budget < (blocks + 1) * shape.bytes_per_block
