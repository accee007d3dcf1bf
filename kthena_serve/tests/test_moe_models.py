"""MoE families (Mixtral, Qwen3-MoE) on tiny random checkpoints that transformers builds and saves.

Each family's own transformers class draws the weights (routers drawn wide, so each token's
expert choice has a clear margin and float32's rounding cannot flip it; norms from [0.5, 1.5]),
and saves them as safetensors in its own tensor names. Against it:

* prefill logits within float32's own rounding, its yardstick measured in the run
  (transformers' float32 logits against its float64 ones, same weights and prompts), with a
  negative control: the same model routed by another family's rule lands far outside;
* greedy tokens, identical: one prompt at a time, batched, chunked prefill, prefix hits;
* bf16 logits within transformers' own bf16 distance;
* every TP rank holding its shard of each expert; the engine over two real ranks (TP=2,
  TP=2 with SP, PP=2) giving transformers' tokens; the OpenAI API of ``kthena serve --model``;
* the refusals: options not implemented, a checkpoint missing an expert, int8 weights.
"""

from __future__ import annotations

import copy
import json

import attrs
import pytest
import torch
from _model_testing import GreedyRunner, load_ours

from kthena_serve.model import CheckpointError, ModelConfig, TensorParallel, UnsupportedModelError
from kthena_serve.model.loader import expected_weight_names
from kthena_serve.model.moe import SparseMoE

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BASE = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6)
FAMILIES = {
    # Mixtral: every layer sparse, 4 experts of width intermediate_size, top-2 renormalised
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    # Qwen3-MoE: q/k norms, explicit head_dim, layer 1 dense (mlp_only_layers), top-3 of 6
    # renormalised (norm_topk_prob)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
                       norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                       head_dim=32)),
}
PROMPTS = [[5, 17, 33, 2, 9, 40, 41, 42, 11, 3, 60, 61, 62, 63, 1, 7, 8, 9, 22, 23],
           [70, 71, 72], [5, 17, 33, 2, 9, 40, 41, 42, 11, 3, 60, 61, 62, 63, 1, 7, 8, 9, 90,
                          91, 92, 93]]
NEW_TOKENS = 12
# As in test_qwen3: one float32 evaluation in another summation order (fused QKV and gate/up,
# the grouped expert matmul, a paged cache, TP's partial sums) has an error of the size of
# transformers' own float32 distance from float64, not a multiple of it: 4x is room for an
# unlucky order.
ROUNDING_ROOM = 4.0


def _write_tokenizer(folder) -> None:
    """A byte-level tokenizer with no merges (256 byte tokens, 3 specials): enough for the
    engine and the server to load the folder; the tests feed token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))


def save_family(folder, family: str, **overrides):
    """transformers' model of ``family`` with random weights, saved with a tokenizer; returns it."""
    config_cls, model_cls, options = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **options, **overrides})
    config._experts_implementation = "eager"  # its grouped_mm takes no float64 (the yardstick)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight") and param.dim() == 2:  # a router
                param.normal_(0.0, 1.0)
    model.eval().save_pretrained(folder)
    _write_tokenizer(folder)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_family(folder, request.param)


def _hf_last_logits(hf, dtype: torch.dtype) -> torch.Tensor:
    model = copy.deepcopy(hf).to(dtype)
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1].double() for p in PROMPTS])


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                      min_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _prefill(model) -> torch.Tensor:
    runner = GreedyRunner(model, block_size=4, num_blocks=64)
    return runner.step([(p, 0, list(range(i * 8, i * 8 + 8))) for i, p in enumerate(PROMPTS)])


def test_config_and_each_tp_rank_holds_its_share_of_every_expert(family):
    name, folder, hf = family
    config = ModelConfig.from_pretrained(folder)
    moe = config.moe
    assert moe is not None and moe.num_experts == hf.config.num_local_experts
    sparse = [i for i in range(3) if moe.is_sparse(i)]
    assert sparse == ([0, 1, 2] if name == "mixtral" else [0, 2])
    names = expected_weight_names(config)
    expert = f"model.layers.0.{moe.prefix}.experts.{moe.num_experts - 1}.{moe.expert_names[2]}.weight"
    assert expert in names and "model.layers.0.mlp.down_proj.weight" not in names
    width = moe.intermediate_size
    full = load_ours(folder)
    for rank in (0, 1):  # loading needs no collective
        model = load_ours(folder, TensorParallel(rank, 2))
        ours, whole = model.layers[0].mlp, full.layers[0].mlp
        assert isinstance(ours, SparseMoE)
        cols = range(rank * width // 2, (rank + 1) * width // 2)
        assert torch.equal(ours.router_weight, whole.router_weight)
        assert torch.equal(ours.experts_gate_up[:, :width // 2], whole.experts_gate_up[:, cols])
        assert torch.equal(ours.experts_down, whole.experts_down[:, :, cols])


def test_prefill_logits_are_within_float32_rounding(family):
    _, folder, hf = family
    exact = _hf_last_logits(hf, torch.float64)
    yardstick = float((_hf_last_logits(hf, torch.float32) - exact).abs().max())
    bound = ROUNDING_ROOM * yardstick
    model = load_ours(folder)
    error = float((_prefill(model).double() - exact).abs().max())
    print(f"\nfloat32 logits vs float64: ours {error:.3g}, transformers {yardstick:.3g}")
    assert 0 < yardstick and error <= bound
    for layer in model.layers:  # the negative control: top-1 routing, not the family's top-k
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.rule = attrs.evolve(layer.mlp.rule, top_k=1)
    assert float((_prefill(model).double() - exact).abs().max()) > 100 * bound


def test_bf16_logits_are_within_transformers_bf16_rounding(family):
    _, folder, hf = family
    exact = _hf_last_logits(hf, torch.float64)
    yardstick = float((_hf_last_logits(hf, torch.bfloat16) - exact).abs().max())
    model = load_ours(folder).to(torch.bfloat16)
    model.reset_rope_cache()  # .to() cast the float32 RoPE table too
    error = float((_prefill(model).double() - exact).abs().max())
    print(f"\nbf16 logits vs float64: ours {error:.3g}, transformers {yardstick:.3g}")
    assert error <= ROUNDING_ROOM * yardstick


def test_greedy_tokens_match_transformers_batched_chunked_and_prefix_cached(family):
    _, folder, hf = family
    model = load_ours(folder)
    expected = [_hf_greedy(hf, p) for p in PROMPTS]
    assert [GreedyRunner(model, block_size=4).generate([p], NEW_TOKENS)[0]
            for p in PROMPTS] == expected
    assert GreedyRunner(model, block_size=4).generate(PROMPTS, NEW_TOKENS) == expected
    assert GreedyRunner(model, block_size=4).generate(PROMPTS, NEW_TOKENS,
                                                      prefill_chunk=3) == expected
    runner = GreedyRunner(model, block_size=4)
    runner.generate(PROMPTS[:1], NEW_TOKENS)
    before = runner.num_computed_prompt_tokens
    assert runner.generate(PROMPTS, NEW_TOKENS, reuse_prefix=True) == expected
    assert runner.num_computed_prompt_tokens - before == 4 + 3 + (22 - 16)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sp": 2, "sp_min_tokens": 16},
                                    {"pp": 2, "pipeline_split_points": (2,)}],
                         ids=["tp2", "tp2-sp2", "pp2-uneven"])
def test_engine_over_two_ranks_gives_transformers_tokens(family, layout):
    """The serving engine (scheduler, spawned ranks, each loading its share of every expert)
    gives transformers' greedy tokens."""
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    _, folder, hf = family
    expected = [_hf_greedy(hf, p) for p in PROMPTS]
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, kernels="native", **layout)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True))
    finally:
        llm.close()
    assert [list(o.token_ids) for o in outs] == expected


@pytest.mark.slow
def test_openai_api_of_kthena_serve_model_dir(family):
    """``kthena serve --model DIR`` serves the family: /v1/completions on token ids gives
    transformers' greedy tokens (vLLM's return_token_ids)."""
    import httpx
    from _serve_process import start_serve, stop

    _, folder, hf = family
    proc, url, _ = start_serve("--model", str(folder), "--port", "0", "--dtype", "float32",
                               "--kv-cache-memory", "16MiB", timeout=180)
    try:
        body = {"model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
                "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    finally:
        stop(proc)
    assert got["choices"][0]["token_ids"] == _hf_greedy(hf, PROMPTS[0])


def test_options_not_implemented_are_refused_by_name(family):
    name, folder, _ = family
    hf = json.loads((folder / "config.json").read_text())
    experts_key = "num_local_experts" if name == "mixtral" else "num_experts"
    with pytest.raises(UnsupportedModelError, match=r"num_experts_per_tok=7 must be in 1\.\.[46]"):
        ModelConfig.from_dict({**hf, "num_experts_per_tok": 7})
    with pytest.raises(CheckpointError, match=f"lacks the required key '{experts_key}'"):
        ModelConfig.from_dict({k: v for k, v in hf.items()
                               if k not in ("num_experts", "num_local_experts")})
    with pytest.raises(UnsupportedModelError, match="int8 weights for an MoE model are not wired"):
        load_ours(folder).quantize_linear_weights("torch")


def test_a_checkpoint_without_an_expert_is_refused(family, tmp_path):
    _, folder, _ = family
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if ".experts.3." not in k}
    safetensors_torch.save_file(kept, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"lacks \d+ weights the model needs, e\.g\. "
                                              r"model\.layers\.\d\.\w+\.experts\.3\."):
        load_ours(tmp_path)
