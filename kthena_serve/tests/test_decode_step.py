"""The model's decode step through the fused native call (mooncake_ops.decode_step) against
the same model's op chain: the choice, bit-equal logits and KV over several steps, and the
cases that keep the ops."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_checkpoint

from kthena_serve.model.llama import DecodeStepChoice, choose_decode_step
from kthena_serve.model.loader import gguf_matmul_blocks, gguf_source, load_model
from mooncake_kv.paged import paged_batch
from mooncake_ops import INT8_WEIGHT_ONLY, dense_gguf_kernel
from mooncake_ops.decode_step import fused_decode_available, max_fused_rows

fused_only = pytest.mark.skipif(not fused_decode_available(),
                                reason="no native build with the fused step on this CPU")
BLOCK = 16
# SmolLM2's proportions at a tenth of the size: head_dim 64, GQA 2:1, tied embeddings
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64, "num_hidden_layers": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("decode_step"), seed=3, **SHAPE)


def _caches(model, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (blocks, BLOCK, model.num_kv_heads_per_rank, model.head_dim)
    return [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
            for _ in model.layers]


def _run(model, step: DecodeStepChoice, prompts: list[list[int]], steps: int):
    """Prefill each prompt (ops), then ``steps`` greedy decode steps of the whole batch under
    ``step``; the logits of every step and the caches."""
    model.decode_step = DecodeStepChoice("ops", "prefill")
    per_seq = 8  # blocks: 128 tokens
    caches = _caches(model, per_seq * len(prompts))
    tables = [range(i * per_seq, (i + 1) * per_seq) for i in range(len(prompts))]
    tokens, lengths = [], []
    with torch.inference_mode():
        for table, prompt in zip(tables, prompts, strict=True):
            batch = paged_batch([(table, 0, len(prompt))], BLOCK)
            logits = model(torch.tensor(prompt), batch.positions, batch, caches)
            tokens.append(int(logits.argmax(-1)))
            lengths.append(len(prompt))
        model.decode_step = step
        seen = []
        for _ in range(steps):
            batch = paged_batch([(t, n, 1) for t, n in zip(tables, lengths, strict=True)], BLOCK)
            logits = model(torch.tensor(tokens), batch.positions, batch, caches)
            seen.append(logits)
            tokens = logits.argmax(-1).tolist()
            lengths = [n + 1 for n in lengths]
    return seen, caches


def _check_fused_equals_ops(model, prompts: list[list[int]], steps: int) -> None:
    """The model's chosen (fused) step and the op chain: equal logits at every step, equal KV
    (a batch of at most the rows the step takes: 2 for the AVX2 build's bf16 and int8)."""
    fused = model.decode_step
    prompts = prompts[: fused.max_rows]
    got, got_caches = _run(model, fused, prompts, steps)
    assert model._fused is not None  # the fused step ran (built over these caches)
    assert model._fused[1].has_head  # on to the logits: the final norm and the LM head too
    want, want_caches = _run(model, DecodeStepChoice("ops", "yardstick"), prompts, steps)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(got_caches, want_caches, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@fused_only
def test_native_kernels_choose_the_fused_step_and_it_equals_the_ops(checkpoint):
    model, _ = load_model(checkpoint, dtype=torch.bfloat16, kernels="native")
    fused = model.decode_step
    assert fused.name == "fused", fused
    _check_fused_equals_ops(model, [[1, 5, 9, 200, 31], list(range(40, 77)), [7] * 18], 12)


@fused_only
def test_int8_weights_decode_fused_and_equal_the_ops(checkpoint):
    model, _ = load_model(checkpoint, dtype=torch.bfloat16, quantization="int8", kernels="native")
    fused = model.decode_step
    assert (fused.name, fused.max_rows) == ("fused", max_fused_rows(INT8_WEIGHT_ONLY.name)), fused
    _check_fused_equals_ops(model, [[1, 5, 9, 200, 31], list(range(40, 77)), [7] * 18], 8)


@fused_only
def test_gguf_weights_mixed_with_dense_ones_decode_fused_and_equal_the_ops():
    """A GGUF file whose q / k / v or gate / up the native matmul cannot read as blocks (a type
    such as Q5_0, or parts of different types, as Q4_K_M's attn_v beside q / k): those fused
    weights stay bf16, packed as the bf16 model packs them, and the fused step still runs."""
    model, _ = load_model("default", dtype=torch.bfloat16, pack_weights=False)
    blocks = {name: packed for name, packed in gguf_matmul_blocks(model, gguf_source("default")).items()
              if not name.endswith(("qkv_weight", "gate_up_weight"))}
    model.use_gguf_weights(blocks, "native")
    mlp, attn = model.layers[0].mlp, model.layers[0].self_attn
    assert mlp.down_weight.dtype == attn.o_weight.dtype == torch.uint8  # the file's blocks
    if dense_gguf_kernel(torch.empty(0, dtype=torch.bfloat16)) is not None:
        assert attn.qkv_weight.dim() == 4 and mlp.gate_up_silu is not None  # packed bf16
    fused = model.decode_step
    assert fused.name == "fused", fused
    _check_fused_equals_ops(model, [[1, 5, 9, 200, 31], list(range(40, 97))], 6)


@fused_only
def test_auto_times_both_and_torch_keeps_the_ops(checkpoint):
    model, _ = load_model(checkpoint, dtype=torch.bfloat16, kernels="native")
    auto = choose_decode_step(model, "auto", BLOCK)
    assert set(auto.timings_ms) == {"fused", "ops"} and all(t > 0 for t in auto.timings_ms.values())
    faster = min(auto.timings_ms, key=auto.timings_ms.get)
    assert auto.name == faster
    assert choose_decode_step(model, "torch", BLOCK).name == "ops"


def test_models_the_step_does_not_take_keep_the_ops(checkpoint, tmp_path):
    fp32, _ = load_model(checkpoint, dtype=torch.float32, kernels="native")
    assert fp32.decode_step.name == "ops"  # no packed bf16 matmul
    narrow = tiny_checkpoint(tmp_path / "narrow", seed=1)  # head_dim 16
    model, _ = load_model(narrow, dtype=torch.bfloat16, kernels="native")
    assert model.decode_step.name == "ops"
    if fused_decode_available():
        assert "head_dim" in model.decode_step.reason


@fused_only
def test_an_int8_pool_decodes_through_the_ops(checkpoint):
    model, _ = load_model(checkpoint, dtype=torch.bfloat16, kernels="native")
    shape = (4, BLOCK, model.num_kv_heads_per_rank, model.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
               torch.ones(shape[:3]), torch.ones(shape[:3])) for _ in model.layers]
    batch = paged_batch([(range(4), 5, 1)], BLOCK)
    with torch.inference_mode():
        logits = model(torch.tensor([3]), batch.positions, batch, caches)
    assert logits.shape == (1, model.config.shape.vocab_size) and model._fused is None


@fused_only
def test_the_default_model_s_gguf_weights_decode_fused_and_equal_the_ops():
    """--quantization gguf (Q4_1 layers, Q8_0 head): the fused step over the GGUF matmul,
    for up to the 6 rows that matmul takes for bf16 activations."""
    model, _ = load_model("default", dtype=torch.bfloat16, quantization="gguf", kernels="native")
    fused = model.decode_step
    assert (fused.name, fused.max_rows) == ("fused", 6), fused
    _check_fused_equals_ops(model, [[1, 5, 9, 200, 31], list(range(40, 97))], 6)
