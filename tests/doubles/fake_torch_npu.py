"""TEST DOUBLE for ``torch_npu``: records every call; accepts only the documented keywords.

Each op accepts the keyword names that the torch_npu API reference lists for the release line
the fake claims (``__version__``), and raises ``TypeError`` on any other name, as the real
binding does. It computes nothing an NPU would: outputs are CPU tensors of the right shape, so
the code under test can keep going. Passing against this double says the adapter spells the
documented call; it is never evidence that torch_npu or an NPU behaves so.

Sources for the keyword sets (docs/accelerators.md lists them with URLs):
npu_fused_infer_attention_score — Ascend Extension for PyTorch 6.0.0 (``scale_value``) and 7.0.0
(``scale``) API lists; the MC2 ops — the same lists (6.0.RC2..7.0.0: ``reduce_op``, ``bias``,
``gather_index``, ``gather_output``, ``comm_turn`` unchanged); norm ops — ``epsilon``.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

_FIA_COMMON = {
    "pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "dequant_scale1",
    "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2", "antiquant_scale",
    "antiquant_offset", "block_table", "query_padding_size", "kv_padding_size",
    "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
    "value_antiquant_offset", "key_shared_prefix", "value_shared_prefix",
    "actual_shared_prefix_len", "num_heads", "pre_tokens", "next_tokens", "input_layout",
    "num_key_value_heads", "sparse_mode", "inner_precise", "block_size", "antiquant_mode",
    "softmax_lse_flag", "key_antiquant_mode", "value_antiquant_mode",
}
KEYWORDS = {  # op -> keyword-only names per release line
    "npu_fused_infer_attention_score": {"6.0": _FIA_COMMON | {"scale_value"},
                                        "7.0+": _FIA_COMMON | {"scale", "query_rope", "key_rope",
                                                               "key_rope_antiquant_scale"}},
    "npu_scatter_pa_kv_cache": {"*": {"compress_lens", "compress_seq_offsets", "seq_lens",
                                      "cache_mode"}},
    "npu_rms_norm": {"*": {"epsilon"}},
    "npu_add_rms_norm": {"*": {"epsilon"}},
    "npu_swiglu": {"*": {"dim"}},
    "npu_mm_all_reduce_base": {"*": {"reduce_op", "bias", "antiquant_scale", "antiquant_offset",
                                     "x3", "dequant_scale", "pertoken_scale", "comm_turn",
                                     "antiquant_group_size"}},
    "npu_all_gather_base_mm": {"*": {"bias", "gather_index", "gather_output", "comm_turn"}},
    "npu_mm_reduce_scatter_base": {"*": {"reduce_op", "bias", "comm_turn"}},
}


def line_of(version: str) -> str:
    """The release line the double claims for a version (the same table as the adapter's
    docstring, written out again here so the test does not trust the code it checks)."""
    table = {"2.1.0.post10": "6.0", "2.1.0.post12": "7.0+", "2.3.1.post4": "6.0",
             "2.3.1.post6": "7.0+", "2.4.0.post2": "6.0", "2.4.0.post4": "7.0+",
             "2.2.0.post2": "6.0", "2.5.1": "7.0+", "2.6.0.post5": "7.0+", "2.9.0": "7.0+"}
    return table[version]


class Recorder:
    """The fake module's call log: (op, positional args, keyword args) in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]

    def last(self, name: str) -> tuple[tuple, dict]:
        for op, args, kwargs in reversed(self.calls):
            if op == name:
                return args, kwargs
        raise AssertionError(f"{name} was never called; calls: {self.names()}")


def _outputs(op: str, args: tuple, kwargs: dict) -> Any:
    if op == "npu_fused_infer_attention_score":
        return torch.zeros_like(args[0]), None
    if op == "npu_rms_norm":
        return args[0].clone(), args[0].new_zeros(())
    if op == "npu_add_rms_norm":
        return args[0].clone(), args[0].new_zeros(()), args[0] + args[1]
    if op == "npu_swiglu":
        half = args[0].shape[-1] // 2
        return args[0][..., :half].clone()
    if op == "npu_mm_all_reduce_base":
        return args[0] @ args[1]
    if op == "npu_all_gather_base_mm":
        gathered = torch.cat([args[0]] * args[3])
        return gathered @ args[1], gathered
    if op == "npu_mm_reduce_scatter_base":
        product = args[0] @ args[1]
        return product[: product.shape[0] // args[3]]
    return None


def make_module(version: str, recorder: Recorder, missing: tuple[str, ...] = ()
                ) -> types.ModuleType:
    """A ``torch_npu`` double claiming ``version``; ops in ``missing`` are left out."""
    module = types.ModuleType("torch_npu")
    module.__version__ = version
    module.__doc__ = "TEST DOUBLE of torch_npu (tests/doubles/fake_torch_npu.py)"
    line = line_of(version)

    def op_for(name: str):
        allowed = KEYWORDS[name].get(line) or KEYWORDS[name]["*"]

        def op(*args: Any, **kwargs: Any) -> Any:
            unknown = set(kwargs) - allowed
            if unknown:
                raise TypeError(f"{name}() got unexpected keyword argument(s) {sorted(unknown)} "
                                f"(torch_npu {version}, release line {line})")
            recorder.calls.append((name, args, kwargs))
            return _outputs(name, args, kwargs)

        return op

    for name in KEYWORDS:
        if name not in missing:
            setattr(module, name, op_for(name))
    module.npu = types.SimpleNamespace(
        set_device=lambda device: recorder.calls.append(("npu.set_device", (device,), {})))
    return module


def install(monkeypatch: Any, version: str, missing: tuple[str, ...] = ()) -> Recorder:
    """Put the double in ``sys.modules["torch_npu"]`` and reset the adapter's cached load
    (the caller clears it again at teardown: ``torch_npu_api.load.cache_clear()``)."""
    from mooncake_ops.backends import torch_npu_api

    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "torch_npu", make_module(version, recorder, missing))
    torch_npu_api.load.cache_clear()
    return recorder
