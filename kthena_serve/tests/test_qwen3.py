"""Qwen3 dense (`Qwen3ForCausalLM`) on tiny random checkpoints that transformers builds and saves.

Qwen3 is Qwen2's layout without the q/k/v biases, with an explicit ``head_dim`` (here 32, where
hidden_size / heads = 16) and an RMSNorm over head_dim on each query and key head between the
projection and RoPE (``q_norm`` / ``k_norm``). Against transformers, on weights drawn in the
run (norm weights too, so a norm applied wrong shows):

* prefill logits within float32's own rounding, its yardstick measured in the run:
  transformers' float32 logits against its float64 ones, on the same weights and prompts; a
  model that skips the q/k norm weights is shown to land far outside that bound;
* greedy tokens, identical: batch 1, batched, chunked prefill, prefix hits (untied, tied, and
  YaRN RoPE as transformers 5 writes it, in ``rope_parameters``);
* the serving engine over two real ranks (TP=2, TP=2 with SP, PP=2): the tokens of TP=1 and
  transformers, and first-step logprobs within the same kind of yardstick;
* the refusals, and each TP rank holding the whole (replicated) q/k norm weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from _model_testing import (
    GreedyRunner,
    assert_bf16_within_transformers_rounding,
    assert_greedy_on_every_path,
    hf_last_logits,
    load_ours,
    prefill_logits,
)
from _moe_families import write_tokenizer

from kthena_core.model_spec import ModelSpec
from kthena_serve.model import (
    CheckpointError,
    ModelConfig,
    TensorParallel,
    UnsupportedModelError,
)
from kthena_serve.model.loader import expected_weight_names

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# head_dim 32 on purpose: not hidden_size / num_attention_heads (16)
TINY = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
VARIANTS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                 "original_max_position_embeddings": 64}},
}
PROMPTS = [[5, 17, 33, 2, 9, 40, 41, 42, 11, 3, 60, 61, 62, 63, 1, 7, 8, 9, 22, 23],
           [70, 71, 72], [5, 17, 33, 2, 9, 40, 41, 42, 11, 3, 60, 61, 62, 63, 1, 7, 8, 9, 90,
                          91, 92, 93]]
NEW_TOKENS = 12
# How far one float32 evaluation of these logits may be from the float64 ones, in units of
# transformers' own float32 distance from them (measured in the run). Each float32 evaluation
# rounds at every op; ours sums in other orders (fused QKV and gate/up, a paged cache, the
# native kernels, TP's partial sums), which gives an error of the same size, not a multiple
# of it: 4x is room for an unlucky order. Skipping the q/k norm weights moves the logits about
# five orders of magnitude further (test_prefill_logits_are_within_float32_rounding asserts four).
ROUNDING_ROOM = 4.0


def _save_qwen3(folder, **overrides):
    """transformers' Qwen3ForCausalLM with random weights (norms drawn from [0.5, 1.5], so a
    norm weight applied wrong shows), saved as safetensors with a tokenizer; returns it."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.eval().save_pretrained(folder)
    write_tokenizer(folder)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    return folder, _save_qwen3(folder, **VARIANTS[request.param])


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-engine")
    return folder, _save_qwen3(folder)


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                      min_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_config_reads_qwen3_and_every_tp_rank_holds_the_whole_qk_norms(tiny):
    folder, hf = tiny
    config = ModelConfig.from_pretrained(folder)
    assert config.qk_norm and not config.attention_bias
    assert (config.shape.head_dim, config.shape.hidden_size // 4) == (32, 16)
    names = expected_weight_names(config)
    assert {f"model.layers.{i}.self_attn.{n}.weight" for i in (0, 1)
            for n in ("q_norm", "k_norm")} <= names
    for rank in (0, 1):  # loading needs no collective
        model = load_ours(folder, TensorParallel(rank, 2))
        attn, ref = model.layers[1].self_attn, hf.model.layers[1].self_attn
        assert attn.qkv_weight.shape == ((2 + 1 + 1) * 32, 64)  # 2 q heads, 1 k, 1 v of 32
        assert torch.equal(attn.q_norm, ref.q_norm.weight)
        assert torch.equal(attn.k_norm, ref.k_norm.weight)


def test_prefill_logits_are_within_float32_rounding(tiny):
    folder, hf = tiny
    exact = hf_last_logits(hf, PROMPTS, torch.float64)
    yardstick = float((hf_last_logits(hf, PROMPTS, torch.float32) - exact).abs().max())
    bound = ROUNDING_ROOM * yardstick
    model = load_ours(folder)
    error = float((prefill_logits(model, PROMPTS).double() - exact).abs().max())
    print(f"\nfloat32 logits vs float64: ours {error:.3g}, transformers {yardstick:.3g}")
    assert 0 < yardstick and error <= bound
    with torch.no_grad():  # the negative control: q/k norm weights not applied
        for layer in model.layers:
            layer.self_attn.q_norm.fill_(1.0)
            layer.self_attn.k_norm.fill_(1.0)
    assert float((prefill_logits(model, PROMPTS).double() - exact).abs().max()) > 1e4 * bound


def test_bf16_logits_are_within_transformers_bf16_rounding(tiny):
    folder, hf = tiny
    assert_bf16_within_transformers_rounding(hf, folder, PROMPTS, ROUNDING_ROOM)


def test_greedy_tokens_match_transformers_batched_chunked_and_prefix_cached(tiny):
    folder, hf = tiny
    expected = [_hf_greedy(hf, p) for p in PROMPTS]
    assert_greedy_on_every_path(load_ours(folder), PROMPTS, expected, NEW_TOKENS,
                                computed_after_first=4 + 3 + (22 - 16))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sp": 2, "sp_min_tokens": 16},
                                    {"pp": 2}], ids=["tp2", "tp2-sp2", "pp2"])
def test_engine_over_two_ranks_matches_tp1_and_transformers(untied, layout):
    """The serving engine (scheduler, spawned ranks, each loading its shard with the q/k norms)
    gives TP=1's and transformers' greedy tokens, and its first-step logprobs are within
    float32 rounding (the yardstick: transformers' float32 log-softmax against float64)."""
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    folder, hf = untied
    expected = [_hf_greedy(hf, p) for p in PROMPTS]
    assert GreedyRunner(load_ours(folder), block_size=4).generate(PROMPTS, NEW_TOKENS) == expected
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, kernels="native", **layout)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True, logprobs=5))
    finally:
        llm.close()
    assert [list(o.token_ids) for o in outs] == expected
    exact = torch.log_softmax(hf_last_logits(hf, PROMPTS, torch.float64), -1)
    hf32 = torch.log_softmax(hf_last_logits(hf, PROMPTS, torch.float32).float(), -1).double()
    bound = ROUNDING_ROOM * float((hf32 - exact).abs().max())
    for row, out in zip(exact, outs, strict=True):
        first = out.logprobs[0]
        got = torch.tensor(first.top_logprobs, dtype=torch.float64)
        assert float((got - row[list(first.top_ids)]).abs().max()) <= bound


def test_qwen3_options_not_implemented_are_refused_by_name(untied):
    folder, _ = untied
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM with attention_bias=true "
                                                    r"\(biases on q/k/v and o_proj\)"):
        ModelConfig.from_dict({**hf, "attention_bias": True})
    with pytest.raises(UnsupportedModelError, match="allowed: .*Qwen3ForCausalLM"):
        ModelConfig.from_dict({**hf, "architectures": ["Qwen2MoeForCausalLM"]})
    # the planner reads the same config the same way: its explicit head_dim
    assert ModelSpec.from_hf_config(hf).shape.head_dim == 32


def test_qwen3_sliding_window_caps_the_context_as_qwen2s_does(untied):
    """Attention spans the whole context, which equals sliding-window attention within the
    window, whichever layers max_window_layers makes slide: the context stops at the window."""
    folder, _ = untied
    hf = json.loads((folder / "config.json").read_text())
    assert hf["use_sliding_window"] is False and hf["sliding_window"] is None
    windowed = {**hf, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}
    assert ModelConfig.from_dict(windowed).max_position_embeddings == 32
    assert ModelConfig.from_dict({**windowed, "use_sliding_window": False}
                                 ).max_position_embeddings == 256


def test_a_checkpoint_without_the_qk_norms_is_refused(untied, tmp_path):
    folder, _ = untied
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.endswith("k_norm.weight")}
    safetensors_torch.save_file(kept, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="lacks 2 weights the model needs, e.g. "
                                              r"model\.layers\.0\.self_attn\.k_norm\.weight"):
        load_ours(tmp_path)
