"""MoE families (Mixtral, Qwen3-MoE, DeepSeek-V2/V3 with MLA) on tiny random checkpoints that
transformers builds and saves (`_moe_families`).

Each family's own transformers class draws the weights (routers drawn wide, so each token's
expert choice has a clear margin and float32's rounding cannot flip it; norms from [0.5, 1.5]),
and saves them as safetensors in its own tensor names. Against it:

* prefill logits within float32's own rounding, its yardstick measured in the run
  (transformers' float32 logits against its float64 ones, same weights and prompts), with a
  negative control: the same model routed by another family's rule lands far outside;
* greedy tokens, identical: one prompt at a time, batched, chunked prefill, prefix hits;
* bf16 logits within transformers' own bf16 distance;
* every TP rank holding its shard of each expert; the engine over two real ranks (TP=2,
  TP=2 with SP, uneven PP=2 over 3 layers) giving transformers' tokens (SP with MLA: refused,
  the ranks cleaned up); the OpenAI API of ``kthena serve --model``;
* the refusals: options not implemented, a checkpoint missing an expert, int8 weights.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from _model_testing import (
    assert_bf16_within_transformers_rounding,
    assert_greedy_on_every_path,
    hf_last_logits,
    load_ours,
    prefill_logits,
)
from _moe_families import FAMILIES, NEW_TOKENS, PROMPTS, SPARSE_LAYERS, hf_greedy, save_family

from kthena_serve.model import (
    CheckpointError,
    ModelConfig,
    TensorParallel,
    TensorParallelError,
    UnsupportedModelError,
)
from kthena_serve.model.loader import expected_weight_names
from kthena_serve.model.moe import SparseMoE
from kthena_serve.model.tp import plan_shards

# As in test_qwen3: one float32 evaluation in another summation order (fused QKV and gate/up,
# the grouped expert matmul, a paged cache, TP's partial sums) has an error of the size of
# transformers' own float32 distance from float64, not a multiple of it: 4x is room for an
# unlucky order.
ROUNDING_ROOM = 4.0

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_family(folder, request.param)


def test_config_and_each_tp_rank_holds_its_share_of_every_expert(family):
    name, folder, hf = family
    config = ModelConfig.from_pretrained(folder)
    moe = config.moe
    options = FAMILIES[name][2]
    experts = options.get("num_local_experts") or options.get("num_experts") or \
        options.get("n_routed_experts")
    assert moe is not None and moe.num_experts == experts
    sparse = [i for i in range(3) if moe.is_sparse(i)]
    assert sparse == SPARSE_LAYERS[name]
    names = expected_weight_names(config)
    last = moe.num_experts - 1
    expert = f"model.layers.{sparse[0]}.{moe.prefix}.experts.{last}.{moe.expert_names[2]}.weight"
    assert expert in names and f"model.layers.{sparse[0]}.mlp.down_proj.weight" not in names
    width = moe.intermediate_size
    full = load_ours(folder)
    for rank in (0, 1):  # loading needs no collective
        model = load_ours(folder, TensorParallel(rank, 2))
        ours, whole = model.layers[sparse[0]].mlp, full.layers[sparse[0]].mlp
        assert isinstance(ours, SparseMoE)
        cols = range(rank * width // 2, (rank + 1) * width // 2)
        assert torch.equal(ours.router_weight, whole.router_weight)
        assert torch.equal(ours.experts_gate_up[:, :width // 2], whole.experts_gate_up[:, cols])
        assert torch.equal(ours.experts_down, whole.experts_down[:, :, cols])
        held = load_ours(folder, TensorParallel(rank, 2), expert_parallel=True)
        ours = held.layers[sparse[0]].mlp  # expert parallelism: half the experts, whole
        mine = range(rank * moe.num_experts // 2, (rank + 1) * moe.num_experts // 2)
        assert ours.expert_start == mine.start
        assert torch.equal(ours.experts_gate_up, whole.experts_gate_up[mine.start:mine.stop])
        assert torch.equal(ours.experts_down, whole.experts_down[mine.start:mine.stop])


def test_prefill_logits_are_within_float32_rounding(family):
    _, folder, hf = family
    exact = hf_last_logits(hf, PROMPTS, torch.float64)
    yardstick = float((hf_last_logits(hf, PROMPTS, torch.float32) - exact).abs().max())
    bound = ROUNDING_ROOM * yardstick
    model = load_ours(folder)
    error = float((prefill_logits(model, PROMPTS).double() - exact).abs().max())
    print(f"\nfloat32 logits vs float64: ours {error:.3g}, transformers {yardstick:.3g}")
    assert 0 < yardstick and error <= bound
    for layer in model.layers:  # the negative control: top-1 routing, not the family's top-k
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.rule = attrs.evolve(layer.mlp.rule, top_k=1)
    assert float((prefill_logits(model, PROMPTS).double() - exact).abs().max()) > 100 * bound


def test_bf16_logits_are_within_transformers_bf16_rounding(family):
    _, folder, hf = family
    assert_bf16_within_transformers_rounding(hf, folder, PROMPTS, ROUNDING_ROOM)


def test_greedy_tokens_match_transformers_batched_chunked_and_prefix_cached(family):
    _, folder, hf = family
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    assert_greedy_on_every_path(load_ours(folder), PROMPTS, expected, NEW_TOKENS,
                                computed_after_first=4 + 3 + (22 - 16))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sp": 2, "sp_min_tokens": 16},
                                    {"pp": 2, "pipeline_split_points": (2,)},
                                    {"tp": 2, "expert_parallel": True}],
                         ids=["tp2", "tp2-sp2", "pp2-uneven", "tp2-ep2"])
def test_engine_over_two_ranks_gives_transformers_tokens(family, layout):
    """The serving engine (scheduler, spawned ranks, each loading its share of every expert)
    gives transformers' greedy tokens."""
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    name, folder, hf = family
    if "sp" in layout and name.startswith("deepseek"):  # refused, and the ranks cleaned up
        with pytest.raises(TensorParallelError, match="sequence parallelism with latent "
                                                      r"attention \(MLA\) is not wired"):
            LLM(str(folder), dtype="float32", num_kv_blocks=64, kernels="native", **layout)
        return
    expected = [hf_greedy(hf, p) for p in PROMPTS]
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
    assert got["choices"][0]["token_ids"] == hf_greedy(hf, PROMPTS[0])


# Per family: config.json changes the model does not implement, and the refusal's words.
REFUSALS = {
    "mixtral": [({"num_experts_per_tok": 7}, r"num_experts_per_tok=7 must be in 1\.\.4"),
                ({"num_local_experts": None}, "lacks the required key 'num_local_experts'")],
    "qwen3_moe": [({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be >= 1"),
                  ({"num_experts": None, "num_local_experts": None},
                   "lacks the required key 'num_experts' \\(or 'num_local_experts'\\)")],
    "deepseek_v2": [({"norm_topk_prob": True}, "DeepseekV2ForCausalLM with norm_topk_prob=true"),
                    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported; "
                                                  "allowed: greedy, group_limited_greedy"),
                    ({"num_experts_per_tok": 7}, "top_k=7 exceeds the 4 experts the 2 chosen "
                                                 "groups hold"),
                    ({"attention_bias": True}, "DeepseekV2ForCausalLM with attention_bias=true")],
    "deepseek_v3": [({"topk_method": "greedy"}, "topk_method='greedy' is not supported; "
                                                "allowed: noaux_tc"),
                    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
                    ({"n_group": 3}, "8 experts do not split into num_groups=3 equal groups")],
}


def test_options_not_implemented_are_refused_by_name(family):
    name, folder, _ = family
    hf = json.loads((folder / "config.json").read_text())
    for change, words in REFUSALS[name]:
        changed = {k: v for k, v in {**hf, **change}.items() if v is not None}
        with pytest.raises((UnsupportedModelError, CheckpointError), match=words):
            ModelConfig.from_dict(changed)
    with pytest.raises(UnsupportedModelError, match="int8 weights for an MoE model are not wired"):
        load_ours(folder).quantize_linear_weights("torch")


def test_expert_parallelism_is_refused_where_it_cannot_split(family):
    _, folder, _ = family
    config = ModelConfig.from_pretrained(folder)
    six = attrs.evolve(config, moe=attrs.evolve(config.moe, num_experts=6))
    with pytest.raises(TensorParallelError, match=r"expert parallelism over tp=4 ranks: 6 "
                                                  r"experts do not split evenly; allowed tp: "
                                                  r"\[1, 2, 3, 6\]"):
        plan_shards(six, TensorParallel(0, 4), expert_parallel=True)
    dense = attrs.evolve(config, moe=None)
    with pytest.raises(TensorParallelError, match="expert parallelism needs an MoE model"):
        plan_shards(dense, TensorParallel(0, 2), expert_parallel=True)


def test_a_checkpoint_without_an_expert_is_refused(family, tmp_path):
    _, folder, _ = family
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if ".experts.3." not in k}
    safetensors_torch.save_file(kept, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"lacks \d+ weights the model needs, e\.g\. "
                                              r"model\.layers\.\d\.\w+\.experts\.3\."):
        load_ours(tmp_path)
