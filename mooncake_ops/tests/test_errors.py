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
