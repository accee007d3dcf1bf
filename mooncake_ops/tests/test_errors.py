"""Misuse raises a specific error (subclassing a builtin) before any kernel runs."""

from __future__ import annotations

import pytest
import torch
from _mops_support import IMPLS, using

import mooncake_ops as mo


def decode_args(**over):
    args = dict(q=torch.zeros(2, 6, 64), k_cache=torch.zeros(8, 16, 2, 64),
                v_cache=torch.zeros(8, 16, 2, 64),
                block_tables=torch.zeros(2, 2, dtype=torch.int32),
                context_lens=torch.tensor([5, 32], dtype=torch.int32), scale=0.125)
    args.update(over)
    return args


BAD_DECODE = [
    ("heads", dict(q=torch.zeros(2, 5, 64)), mo.OpsShapeError, "multiple of the cache's 2 KV"),
    ("head_dim", dict(q=torch.zeros(2, 6, 32)), mo.OpsShapeError, "head_dim 32"),
    ("q rank", dict(q=torch.zeros(6, 64)), mo.OpsShapeError, "3-D"),
    ("q dtype", dict(q=torch.zeros(2, 6, 64, dtype=torch.float64)), mo.OpsDTypeError, "allowed"),
    ("cache dtype", dict(k_cache=torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16),
                         v_cache=torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)),
     mo.OpsDTypeError, "same dtype"),
    ("v shape", dict(v_cache=torch.zeros(8, 16, 1, 64)), mo.OpsShapeError, "must match k_cache"),
    ("int8 no scale", dict(k_cache=torch.zeros(8, 16, 2, 64, dtype=torch.int8),
                           v_cache=torch.zeros(8, 16, 2, 64, dtype=torch.int8)),
     mo.OpsDTypeError, "required with int8"),
    ("table dtype", dict(block_tables=torch.zeros(2, 2)), mo.OpsDTypeError, "int32"),
    ("table batch", dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)), mo.OpsShapeError,
     "batch size"),
    ("lens batch", dict(context_lens=torch.tensor([5], dtype=torch.int32)), mo.OpsShapeError,
     "batch size"),
    ("too long", dict(context_lens=torch.tensor([5, 33], dtype=torch.int32)),
     mo.BlockTableError, "2 blocks x 16"),
    ("negative", dict(context_lens=torch.tensor([-1, 3], dtype=torch.int32)),
     mo.BlockTableError, ">= 0"),
    ("bad block", dict(block_tables=torch.tensor([[0, 0], [1, 8]], dtype=torch.int32)),
     mo.BlockTableError, "8 blocks"),
    ("out shape", dict(out=torch.zeros(2, 6, 32)), mo.OpsShapeError, "out must be"),
]


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("case", BAD_DECODE, ids=[c[0] for c in BAD_DECODE])
def test_decode_rejects(name, case):
    _, over, error, message = case
    with using(name), pytest.raises(error, match=message):
        mo.paged_decode_attention(**decode_args(**over))


def test_errors_subclass_builtins():
    assert issubclass(mo.OpsShapeError, ValueError) and issubclass(mo.OpsDTypeError, TypeError)
    assert issubclass(mo.OpsTypeError, TypeError)
    assert issubclass(mo.BlockTableError, ValueError)
    assert issubclass(mo.UnsupportedDeviceError, LookupError)


def test_unused_table_entries_are_never_read():
    args = decode_args(block_tables=torch.tensor([[0, -7], [1, 2]], dtype=torch.int32))
    for name in IMPLS:
        with using(name):
            mo.paged_decode_attention(**args)  # -7 lies past sequence 0's 5 tokens: fine


def prefill_args(**over):
    args = dict(q=torch.zeros(5, 4, 64), k=torch.zeros(5, 2, 64), v=torch.zeros(5, 2, 64),
                k_cache=torch.zeros(4, 16, 2, 64), v_cache=torch.zeros(4, 16, 2, 64),
                block_tables=torch.zeros(2, 0, dtype=torch.int32),
                cached_lens=torch.tensor([0, 0], dtype=torch.int32),
                query_lens=torch.tensor([2, 3], dtype=torch.int32), scale=0.125)
    args.update(over)
    return args


BAD_PREFILL = [
    ("sum", dict(query_lens=torch.tensor([2, 2], dtype=torch.int32)), mo.OpsShapeError, "sum to"),
    ("k heads", dict(k=torch.zeros(5, 1, 64)), mo.OpsShapeError, "heads x head_dim"),
    ("k dtype", dict(k=torch.zeros(5, 2, 64, dtype=torch.bfloat16)), mo.OpsDTypeError, "q's dtype"),
    ("k rows", dict(k=torch.zeros(4, 2, 64)), mo.OpsShapeError, "total_q"),
    ("cached past table", dict(cached_lens=torch.tensor([1, 0], dtype=torch.int32)),
     mo.BlockTableError, "0 blocks"),
    ("lens dtype", dict(query_lens=torch.tensor([2.0, 3.0])), mo.OpsDTypeError, "int32"),
]


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("case", BAD_PREFILL, ids=[c[0] for c in BAD_PREFILL])
def test_prefill_rejects(name, case):
    _, over, error, message = case
    with using(name), pytest.raises(error, match=message):
        mo.paged_prefill_attention(**prefill_args(**over))


BAD_WRITE = [
    ("heads", dict(key=torch.zeros(3, 1, 64)), mo.OpsShapeError, "value"),
    ("slot count", dict(slot_mapping=torch.tensor([0, 1])), mo.OpsShapeError, "num_tokens"),
    ("slot dtype", dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), mo.OpsDTypeError, "int64"),
    ("scale shape", dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.int8),
                         v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.int8),
                         k_scale=torch.zeros(4, 16, 2), v_scale=torch.zeros(4, 16)),
     mo.OpsShapeError, "v_scale"),
]


@pytest.mark.parametrize("case", BAD_WRITE, ids=[c[0] for c in BAD_WRITE])
def test_write_kv_rejects(case):
    _, over, error, message = case
    args = dict(key=torch.zeros(3, 2, 64), value=torch.zeros(3, 2, 64),
                k_cache=torch.zeros(4, 16, 2, 64), v_cache=torch.zeros(4, 16, 2, 64),
                slot_mapping=torch.tensor([0, 1, 2]))
    args.update(over)
    key, value, kc, vc, slots = (args.pop(n) for n in ("key", "value", "k_cache", "v_cache",
                                                       "slot_mapping"))
    with pytest.raises(error, match=message):
        mo.write_kv(key, value, kc, vc, slots, **args)


def test_layer_op_errors():
    with pytest.raises(mo.OpsShapeError, match="weight"):
        mo.rms_norm(torch.zeros(2, 64), torch.ones(32), 1e-6)
    with pytest.raises(mo.OpsShapeError, match="residual"):
        mo.rms_norm(torch.zeros(2, 64), torch.ones(64), 1e-6, torch.zeros(2, 32))
    with pytest.raises(mo.OpsShapeError, match="even"):
        mo.silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(mo.OpsShapeError, match="rotary_dim"):
        mo.rotary_embedding(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, 64),
                            torch.zeros(1, 1, 64), torch.zeros(8, 66))
    with pytest.raises(mo.OpsShapeError, match=r"weight\.t\(\)"):
        mo.matmul_all_reduce(torch.zeros(2, 8), torch.zeros(4, 8))


NOT_TENSORS = [
    ("decode lens list", lambda: mo.paged_decode_attention(**decode_args(context_lens=[5, 32])),
     "context_lens must be a torch.Tensor, 1-D [batch] of int32 or int64; got list [5, 32]; "
     "convert it with torch.tensor(..., dtype=torch.int32) on the op's device"),
    ("decode table tuple",
     lambda: mo.paged_decode_attention(**decode_args(block_tables=((0, 0), (0, 0)))),
     "block_tables must be a torch.Tensor, 2-D [batch, max_blocks_per_seq] of int32 or int64; "
     "got tuple ((0, 0), (0, 0))"),
    ("decode q None", lambda: mo.paged_decode_attention(**decode_args(q=None)),
     "q must be a torch.Tensor, 3-D [batch, num_heads, head_dim]; got None"),
    ("decode scale tensor",
     lambda: mo.paged_decode_attention(**decode_args(scale=torch.tensor(0.125))),
     "scale must be a Python float (usually head_dim ** -0.5); got Tensor"),
    ("decode v_cache list", lambda: mo.paged_decode_attention(**decode_args(v_cache=[0.0])),
     "v_cache must be a torch.Tensor, 4-D [num_blocks, block_size, num_kv_heads, head_dim] of "
     "float32 or bfloat16 or float16 or int8; got list [0.0]"),
    ("decode out list", lambda: mo.paged_decode_attention(**decode_args(out=[])),
     "out must be a torch.Tensor, shaped and typed like q; got list []"),
    ("prefill table list",
     lambda: mo.paged_prefill_attention(**prefill_args(block_tables=[[], []])),
     "block_tables must be a torch.Tensor, 2-D [batch, max_blocks_per_seq] of int32 or int64; "
     "got list [[], []]"),
    ("prefill query_lens list", lambda: mo.paged_prefill_attention(**prefill_args(
        query_lens=[2, 3])), "query_lens must be a torch.Tensor, 1-D [batch] of int32 or int64"),
    ("write slots list", lambda: mo.write_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64),
                                             torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64),
                                             [0, 1, 2]),
     "slot_mapping must be a torch.Tensor, 1-D [num_tokens] of int64 or int32; got list "
     "[0, 1, 2]; convert it with torch.tensor(..., dtype=torch.int64)"),
    ("write value array", lambda: mo.write_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64).numpy(),
                                              torch.zeros(4, 16, 2, 64),
                                              torch.zeros(4, 16, 2, 64), torch.tensor([0, 1, 2])),
     "value must be a torch.Tensor, shaped and typed like key; got ndarray"),
    ("write int8 scale list", lambda: mo.write_kv(
        torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), torch.zeros(4, 16, 2, 64, dtype=torch.int8),
        torch.zeros(4, 16, 2, 64, dtype=torch.int8), torch.tensor([0, 1, 2]),
        k_scale=[1.0], v_scale=torch.zeros(4, 16, 2)),
     "k_scale must be a torch.Tensor, [num_blocks, block_size, num_kv_heads] of float32; "
     "got list [1.0]"),
    ("quantize list", lambda: mo.quantize_int8([1.0, 2.0]),
     "x must be a torch.Tensor, floating point [..., head_dim]; got list [1.0, 2.0]"),
    ("dequantize scale list", lambda: mo.dequantize_int8(torch.zeros(2, 4, dtype=torch.int8),
                                                         [1.0, 1.0]),
     "scale must be a torch.Tensor, [...] (q.shape[:-1]) of float32; got list [1.0, 1.0]"),
    ("dequantize dtype str", lambda: mo.dequantize_int8(torch.zeros(2, 4, dtype=torch.int8),
                                                        torch.ones(2), "bfloat16"),
     "dtype must be a torch.dtype (e.g. torch.bfloat16); got str 'bfloat16'"),
    ("gather one tensor", lambda: mo.gather_blocks(torch.zeros(4, 16), [0]),
     "caches must be a sequence of [num_blocks, ...] tensors; got one Tensor"),
    ("gather cache list", lambda: mo.gather_blocks([torch.zeros(4, 16), [0.0]], [0]),
     "caches[1] must be a torch.Tensor, [num_blocks, ...]; got list [0.0]"),
]


@pytest.mark.parametrize("case", NOT_TENSORS, ids=[c[0] for c in NOT_TENSORS])
def test_a_non_tensor_argument_is_named_with_what_was_given(case):
    _, call, message = case
    with pytest.raises(mo.OpsTypeError) as caught:
        call()
    assert str(caught.value).startswith(message)


def test_int8_ops_check_dtype_and_shape():
    with pytest.raises(mo.OpsDTypeError, match="quantize_int8 takes a floating point"):
        mo.quantize_int8(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(mo.OpsDTypeError, match="takes quantize_int8's int8 q"):
        mo.dequantize_int8(torch.zeros(2, 4), torch.ones(2))
    with pytest.raises(mo.OpsShapeError, match=r"q.shape\[:-1\] = \(2,\); got \(4,\)"):
        mo.dequantize_int8(torch.zeros(2, 4, dtype=torch.int8), torch.ones(4))
