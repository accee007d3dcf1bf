"""The model on tiny random checkpoints: maths against transformers, paged paths, TP plan, errors.

Fast (no real model): transformers builds a random Llama / Qwen2 of a few thousand weights and
saves it as a checkpoint; our model loads the folder and must give the same logits (float32).
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from _model_testing import GreedyRunner, load_ours

from kthena_serve.model import (
    BatchError,
    CheckpointError,
    ModelConfig,
    TensorParallel,
    TensorParallelError,
    UnsupportedModelError,
    plan_shards,
)
from mooncake_kv.paged import paged_batch

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=3, head_dim=8, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0)


def _save_hf(folder, arch: str, **overrides):
    torch.manual_seed(0)
    if arch == "qwen2":
        config = transformers.Qwen2Config(**{**TINY, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**{**TINY, **overrides})
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random norms, so a wrong norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.eval().save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=["llama-tied", "llama-untied", "qwen2-bias"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    arch, tied = request.param.split("-")[0], request.param.endswith("tied") and "untied" not in request.param
    hf = _save_hf(folder, arch, tie_word_embeddings=tied)
    return folder, hf


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 17, 33, 2, 9, 40, 41, 42, 11, 3, 60, 61, 62, 63, 1, 7, 8, 9, 22, 23],
           [70, 71, 72], [5, 17, 33, 2, 9, 40, 41, 42, 11, 3, 60, 61, 62, 63, 1, 7, 8, 9, 90, 91, 92, 93]]


def test_prefill_logits_match_transformers(tiny):
    folder, hf = tiny
    model = load_ours(folder)
    runner = GreedyRunner(model, block_size=4, num_blocks=64)
    ours = runner.step([(p, 0, list(range(i * 8, i * 8 + 8))) for i, p in enumerate(PROMPTS)])
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers_batched_chunked_and_prefix_cached(tiny):
    folder, hf = tiny
    model = load_ours(folder)
    expected = [_hf_greedy(hf, p, 12) for p in PROMPTS]
    assert [GreedyRunner(model, block_size=4).generate([p], 12)[0] for p in PROMPTS] == expected
    assert GreedyRunner(model, block_size=4).generate(PROMPTS, 12) == expected
    assert GreedyRunner(model, block_size=4).generate(PROMPTS, 12, prefill_chunk=3) == expected
    runner = GreedyRunner(model, block_size=4)
    runner.generate(PROMPTS[:1], 12)
    before = runner.num_computed_prompt_tokens
    assert runner.generate(PROMPTS, 12, reuse_prefix=True) == expected
    # prompt 0 again: 16 of 20 cached; prompt 2 shares 16 tokens with it; prompt 1 is 3 tokens.
    assert runner.num_computed_prompt_tokens - before == 4 + 3 + (22 - 16)


def test_packed_bf16_matmuls_give_the_dense_logits(tiny):
    folder, _ = tiny
    dense, packed = (load_ours(folder).to(torch.bfloat16) for _ in range(2))
    for model in (dense, packed):
        model.reset_rope_cache()  # .to() cast the float32 RoPE table too
    if not packed.pack_linear_weights():
        pytest.skip("no packed linear kernel for bf16 on this CPU (F.linear stays)")
    weights = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight", "lm_head_weight")
    assert not [n for n, _ in packed.named_parameters() if n.endswith(weights)]
    assert packed.embed_weight.shape == (TINY["vocab_size"], TINY["hidden_size"])  # stays dense
    from mooncake_ops.linear import NATIVE_PACKED_BF16, select_linear_kernel

    if select_linear_kernel(packed.embed_weight) is NATIVE_PACKED_BF16:  # the fused SwiGLU input
        width = TINY["intermediate_size"]
        fused = width % 16 == 0 and TINY["hidden_size"] % 2 == 0
        assert all((layer.mlp.gate_up_silu is not None) == fused for layer in packed.layers)
    seqs = [(p, 0, list(range(i * 8, i * 8 + 8))) for i, p in enumerate(PROMPTS)]
    got = GreedyRunner(packed, block_size=4, num_blocks=64).step(seqs)
    expected = GreedyRunner(dense, block_size=4, num_blocks=64).step(seqs)
    torch.testing.assert_close(got, expected, atol=5e-2, rtol=5e-2)


class _ThreadAllReduce:
    """all_reduce across threads, summing in rank order so every rank gets identical bits."""

    def __init__(self, world: int) -> None:
        self.barrier, self.parts = threading.Barrier(world, timeout=60), [None] * world

    def for_rank(self, rank: int):
        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            return tensor.copy_(total)
        return reduce


@pytest.mark.parametrize("world", [2, 3, 6])
def test_tensor_parallel_shards_sum_to_the_full_model(tiny, world):
    """3 KV heads over 2 ranks (uneven), 3 (one each) and 6 (each KV head on two ranks)."""
    folder, _ = tiny
    expected = GreedyRunner(load_ours(folder), block_size=4).generate(PROMPTS, 8)
    reduce = _ThreadAllReduce(world)
    results, errors = [None] * world, []

    def run(rank: int) -> None:
        try:
            model = load_ours(folder, TensorParallel(rank, world, reduce.for_rank(rank)))
            results[rank] = GreedyRunner(model, block_size=4).generate(PROMPTS, 8)
        except Exception as e:  # surfaced below
            errors.append(e)
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == [expected] * world


def test_plan_matches_kthena_core_rule_and_covers_every_head_once():
    from kthena_core.shape import ModelShape, allowed_tp_sizes, kv_head_range, kv_heads_per_rank

    for heads, kv, inter in [(32, 8, 11008), (9, 3, 1536), (28, 4, 18944), (64, 8, 28672)]:
        config = ModelConfig(ModelShape(num_layers=1, num_attention_heads=heads, num_kv_heads=kv,
                                        head_dim=4, hidden_size=heads * 4, intermediate_size=inter,
                                        vocab_size=8))
        for world in range(1, heads + 1):
            try:
                plans = [plan_shards(config, TensorParallel(r, world)) for r in range(world)]
            except TensorParallelError:
                assert world > kv and world % kv and world not in allowed_tp_sizes(heads, kv)
                continue
            assert sorted(h for p in plans for h in p.q_heads) == list(range(heads))
            assert sorted(c for p in plans for c in p.intermediate) == list(range(inter))
            for r, p in enumerate(plans):  # a rank's q heads all read one of its own KV heads
                assert {h // (heads // kv) for h in p.q_heads} <= set(p.kv_heads)
                assert p.kv_heads == kv_head_range(kv, world, r)
            # every rank's pool is sized for the largest share (3 KV heads over 2 ranks: 2)
            assert max(len(p.kv_heads) for p in plans) == kv_heads_per_rank(kv, world)


def test_tensor_parallel_and_plan_errors():
    config = ModelConfig.from_dict(TINY)
    with pytest.raises(TensorParallelError, match="rank 2 of world_size 2"):
        TensorParallel(2, 2)
    with pytest.raises(TensorParallelError, match="multiple of it"):
        plan_shards(config, TensorParallel(0, 4))
    with pytest.raises(TensorParallelError, match="exceeds num_attention_heads"):
        plan_shards(config, TensorParallel(0, 7))


def test_config_from_dict_and_errors(tmp_path):
    without_theta = {k: v for k, v in TINY.items() if k != "rope_theta"}
    config = ModelConfig.from_dict({**without_theta, "architectures": ["LlamaForCausalLM"], "eos_token_id": [2, 7],
                                    "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert config.eos_token_ids == {2, 7} and config.rope_theta == 5e5 and config.rope_scaling is None
    # the sizes come from kthena_core's parser; ModelConfig.shape is its ModelShape
    assert (config.shape.num_layers, config.shape.num_kv_heads, config.shape.dtype) == (2, 3, "bf16")
    assert ModelConfig.from_dict({**TINY, "torch_dtype": "float32"}).dtype == torch.float32
    with pytest.raises(UnsupportedModelError, match="unknown dtype 'float64'"):
        ModelConfig.from_dict({**TINY, "torch_dtype": "float64"})
    assert ModelConfig.from_dict({**TINY, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    # Llama's attention_bias puts a bias on o_proj too, which the model would silently drop
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM with attention_bias=true"):
        ModelConfig.from_dict({**TINY, "architectures": ["LlamaForCausalLM"], "attention_bias": True})
    with pytest.raises(UnsupportedModelError, match="allowed: .*LlamaForCausalLM"):
        ModelConfig.from_dict({**TINY, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(CheckpointError, match="'hidden_size'"):
        ModelConfig.from_dict({k: v for k, v in TINY.items() if k != "hidden_size"})
    with pytest.raises(UnsupportedModelError, match="multiple of num_key_value_heads"):
        ModelConfig.from_dict({**TINY, "num_key_value_heads": 4})
    with pytest.raises(CheckpointError, match="config.json is missing"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_a_sliding_window_below_the_context_caps_it():
    """Attention spans the whole context, which equals sliding-window attention within the
    window only: the context length stops at the window."""
    mistral = {**TINY, "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_dict({**mistral, "sliding_window": 64}).max_position_embeddings == 64
    assert ModelConfig.from_dict({**mistral, "sliding_window": 4096}).max_position_embeddings == 256
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).max_position_embeddings == 256
    qwen = {**TINY, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).max_position_embeddings == 256
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": True}).max_position_embeddings == 32
    with pytest.raises(UnsupportedModelError, match="sliding_window 'wide' is not supported"):
        ModelConfig.from_dict({**mistral, "sliding_window": "wide"})


def test_load_errors_name_the_problem(tmp_path, tiny):
    from kthena_serve.model import load_model

    with pytest.raises(CheckpointError, match="missing: config.json, tokenizer.json, \\*.safetensors"):
        load_model(tmp_path)
    folder, _ = tiny
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="does config.json match the weights"):
        load_ours(bad)


def test_forward_input_errors(tiny):
    """A malformed PagedBatch itself is refused by mooncake_kv (test_paged.py); the model
    refuses inputs that disagree with a well-formed one."""
    i64 = torch.int64
    batch = paged_batch([((0,), 0, 2), ((1,), 0, 1)], block_size=4)  # 3 tokens, 2 sequences
    model = load_ours(tiny[0])
    with pytest.raises(BatchError, match="one \\(k_cache, v_cache\\) pair per layer"):
        model(torch.zeros(3, dtype=i64), torch.zeros(3, dtype=i64), batch, [])
    with pytest.raises(BatchError, match="must all be \\[num_tokens\\]"):
        model(torch.zeros(2, dtype=i64), torch.zeros(2, dtype=i64), batch, [])
