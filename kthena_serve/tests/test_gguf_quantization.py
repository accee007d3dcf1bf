"""``--quantization gguf``: the default model served with its GGUF file's own blocks (Q4_1
layers, the Q8_0 embedding as the tied LM head) against the same model dequantised (today's
float checkpoint), and the refusals.

The GGUF kernels dequantise to exactly the float32 values the checkpoint holds and sum in fp32
(mooncake_ops/tests/test_gguf_linear.py bounds each matmul), so in float32 the two models differ
only by the order of fp32 sums: the greedy tokens must be the same.
"""

from __future__ import annotations

import pytest
import torch
from _greedy_agreement import GREEDY, chat_prompts
from _tiny import finish_all

import mooncake_ops as mo
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import ConfigError, EngineConfig
from kthena_serve.model import load_model
from kthena_serve.model.loader import gguf_matmul_blocks, gguf_source
from kthena_serve.model.tp import TensorParallel

MATMULS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


@pytest.fixture(scope="module")
def models():
    """{None: the dequantised model, "gguf": the GGUF-block one}, float32, each with its
    tokenizer; one intra-op thread for the module (the engines too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {q: load_model("default", dtype=torch.float32, quantization=q, kernels="native")
           for q in (None, "gguf")}
    torch.set_num_threads(threads)


def _served(model, tokenizer, quantization, prompts):  # noqa: ANN001, ANN202
    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory="32MiB", num_threads=1,
                                                dtype="float32", quantization=quantization),
                                   model=model, tokenizer=tokenizer)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"q{i}", prompt, GREEDY)
        done = finish_all(engine)
        return [done[f"q{i}"].token_ids for i in range(len(prompts))]
    finally:
        engine.close()


def test_gguf_weights_give_the_dequantised_models_greedy_tokens_in_fp32(models):
    prompts = chat_prompts(models[None][1])
    dense = _served(*models[None], None, prompts)
    gguf = _served(*models["gguf"], "gguf", prompts)
    assert gguf == dense


def test_the_matmul_weights_are_the_files_blocks_and_the_embedding_stays_dense(models):
    model = models["gguf"][0]
    assert model.kernel_choice.linear_decode == mo.GGUF_WEIGHT_ONLY.name
    for layer in model.layers:
        for module in (layer.self_attn, layer.mlp):
            for name in MATMULS:
                if hasattr(module, name):
                    assert mo.gguf_type_of(getattr(module, name)).name == "Q4_1"
            assert module.matmul is mo.GGUF_WEIGHT_ONLY.linear
    assert mo.gguf_type_of(model.lm_head_weight).name == "Q8_0"  # token_embd, tied
    assert model.embed_weight.dtype == torch.float32
    dense = models[None][0]
    assert torch.equal(model.embed_weight, dense.embed_weight)


def test_a_tp_shard_of_the_blocks_dequantises_to_the_dense_shard():
    """Rank 1 of 3 (SmolLM2's 9 heads, 1536 columns: whole 32-value blocks per rank): each
    packed weight, Q/K rows un-permuted and columns cut at block boundaries, dequantises to
    exactly the weight the dense loader put there."""
    model, _ = load_model("default", dtype=torch.float32, tp=TensorParallel(1, 3),
                          pack_weights=False, kernels="torch")
    blocks = gguf_matmul_blocks(model, gguf_source("default"))
    assert len(blocks) == 4 * len(model.layers) + 1
    for name, packed in blocks.items():
        module, _, attr = name.rpartition(".")
        dense = getattr(model.get_submodule(module) if module else model, attr)
        assert torch.equal(mo.dequantize_gguf(packed), dense), name


def test_gguf_is_refused_for_a_model_that_is_not_a_gguf_file(tmp_path):
    for model in (str(tmp_path), "HuggingFaceTB/SmolLM2-135M-Instruct"):
        with pytest.raises(ConfigError, match=r"quantization must be 'gguf' only with model "
                                              r"'default' or a \.gguf file"):
            EngineConfig(model=model, quantization="gguf")
    with pytest.raises(ValueError, match="the model must be 'default' or a .gguf file"):
        load_model(str(tmp_path), quantization="gguf")
    with pytest.raises(ValueError, match="None or 'int8' .*, or 'gguf'"):
        load_model("default", quantization="q4_1")
    with pytest.raises(ConfigError, match="'int8' .*, or 'gguf'"):
        EngineConfig(quantization="q4_1")
    assert EngineConfig(quantization="gguf").quantization == "gguf"
