"""The kernel choice as the server uses it: flag, config field and its environment default,
the start-up line, the ``kthena_kernels_info`` gauge and the model's packed matmuls
(`mooncake_ops.selection` has the selection logic's own tests)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kthena_serve.engine.config import ConfigError, EngineConfig


def test_the_config_and_the_flag_refuse_an_unknown_mode(capsys):
    from kthena_core.cli import build_parser

    with pytest.raises(ConfigError, match="kernels"):
        EngineConfig(kernels="amx")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kernels", "amx"])
    assert "--kernels: invalid choice: 'amx' (choose from 'auto', 'native', 'torch')" in (
        capsys.readouterr().err)


def test_the_flag_reaches_the_engine_config(monkeypatch):
    from kthena_core.cli import build_parser
    from kthena_serve.cli import spec_from_args

    monkeypatch.delenv("KTHENA_KERNELS", raising=False)
    args = build_parser().parse_args(["serve", "--kernels", "torch"])
    assert spec_from_args(args).engine.kernels == "torch"
    assert spec_from_args(build_parser().parse_args(["serve"])).engine.kernels == "auto"


def test_an_unknown_environment_default_stops_the_config_with_its_name(monkeypatch):
    monkeypatch.setenv("KTHENA_KERNELS", "fast")
    with pytest.raises(ValueError, match="KTHENA_KERNELS='fast': the kernel choice is one of "
                                         "auto, native, torch"):
        EngineConfig()
    monkeypatch.setenv("KTHENA_KERNELS", "fastest")
    with pytest.raises(ValueError, match="KTHENA_KERNELS='fastest': the kernel choice is one "
                                         "of auto, native, torch"):
        EngineConfig(dtype="float32")


def test_the_environment_is_the_default_and_never_overrides_a_given_mode(monkeypatch):
    from kthena_core.cli import build_parser
    from kthena_serve.cli import spec_from_args

    monkeypatch.setenv("KTHENA_KERNELS", "torch")
    assert EngineConfig().kernels == "torch"
    assert EngineConfig(kernels="native").kernels == "native"
    assert EngineConfig.from_json(EngineConfig(kernels="auto").to_json()).kernels == "auto"
    assert spec_from_args(build_parser().parse_args(["serve"])).engine.kernels == "torch"
    args = build_parser().parse_args(["serve", "--kernels", "native"])
    assert spec_from_args(args).engine.kernels == "native"
    monkeypatch.setenv("KTHENA_KERNELS", "fast")  # a bad default does not matter once given
    assert EngineConfig(kernels="auto").kernels == "auto"


def test_torch_mode_keeps_dense_weights_and_sdpa_attention(monkeypatch):
    from kthena_serve.model import load_model
    from mooncake_ops import dispatch

    monkeypatch.delenv("KTHENA_KERNELS", raising=False)
    model, _ = load_model("default", kernels="torch")
    try:
        labels = model.kernel_choice.labels()
        assert labels == {"mode": "torch", "source": "fixed", "matmul_decode": "torch-dense",
                          "matmul_prefill": "torch-dense", "decode_attention": "torch-sdpa",
                          "prefill_attention": "torch-sdpa"}
        layer = model.layers[0].self_attn
        assert layer.qkv_weight.dim() == 2 and layer.qkv_weight.dtype == torch.bfloat16
        assert dispatch.implementation_name("paged_decode_attention", "cpu") == "torch-sdpa"
    finally:
        dispatch.choose_impl("paged_decode_attention", "cpu", None)
        dispatch.choose_impl("paged_prefill_attention", "cpu", None)


def test_the_engine_reports_its_kernels_in_limits_and_metrics():
    from _tiny import default_tokenizer, tiny_llama

    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.engine import LLMEngine
    from kthena_serve.server.metrics import ServerMetrics

    model = tiny_llama()
    model.pack_linear_weights("native")  # fp32: no packed kernel, no timing, defaults kept
    config = EngineConfig(dtype="float32", num_kv_blocks=32, block_size=4, num_threads=1)
    engine = AsyncLLM(LLMEngine.from_config(config, model=model, tokenizer=default_tokenizer()))
    try:
        assert engine.processor.limits.kernels["mode"] == "native"
        text = ServerMetrics(engine).render().decode()
    finally:
        engine.shutdown()
    assert ('kthena_kernels_info{decode_attention="default",decode_step="ops",'
            'matmul_decode="F.linear",matmul_prefill="F.linear",mode="native",'
            'prefill_attention="default",source="fixed"} 1.0') in text, text


def test_a_bad_kernels_variable_is_the_config_s_error_not_the_import_s():
    """Reading the config module (flag parsing does) works whatever KTHENA_KERNELS holds; only
    an EngineConfig built without a mode refuses the value."""
    code = ("import kthena_serve.engine.config as c\n"
            "try:\n    c.EngineConfig()\nexcept ValueError as e:\n    print(e)\n"
            "print(c.EngineConfig(kernels='torch').kernels)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "KTHENA_KERNELS": "bogus"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "KTHENA_KERNELS='bogus': the kernel choice is one of auto, native, torch", "torch"]
