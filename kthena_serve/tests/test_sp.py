"""Sequence parallelism over the TP group (`kthena_serve.model.sp`): greedy parity in float32.

Two gloo processes (`_sp_worker.py`) run the same prompts on one rank with the whole model, on
TP=2 and on TP=2 with SP, over a tiny random Llama with SmolLM2's uneven head split (9 query / 3
KV heads: 6 + 3 and 2 + 1 on two ranks) and on the real default model: a batch whose 97 tokens
split 49 + 48, a 101-token prompt (not a multiple of the block size) whole and in chunks, a
prompt below the SP threshold, and prefix-cache hits. Tokens must be identical, and the
all-gather counts say which forwards SP split (prefill ones of >= 16 tokens; decode never). The
engine-level run (spawned ranks, scheduler) is at the end.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from _ranks import HERE, run_two_ranks
from _serve_process import start_serve
from _tiny import tiny_checkpoint

from kthena_core.shape import ModelShape
from kthena_serve.model import (
    LlamaForCausalLM,
    ModelConfig,
    PipelineStage,
    SequenceParallel,
    TensorParallel,
    TensorParallelError,
)
from kthena_serve.model.sp import TokenShards

UNEVEN_HEADS = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8,
                "hidden_size": 72, "intermediate_size": 144}


@pytest.fixture(scope="module")
def uneven_checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny93"), **UNEVEN_HEADS)


@pytest.fixture(scope="module")
def parity(uneven_checkpoint, tmp_path_factory):
    """Both ranks' results (see _sp_worker.py), after both exited cleanly."""
    out = tmp_path_factory.mktemp("sp_parity")
    run_two_ranks(lambda rank, port: [os.path.join(HERE, "_sp_worker.py"), str(rank), port,
                                      str(uneven_checkpoint), str(out / f"rank{rank}.json"),
                                      "real"])
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


TINY = ["batched_uneven", "single_101", "chunked_101", "short", "prefix_hit"]


@pytest.mark.slow
def test_each_rank_holds_its_share_of_the_uneven_heads(parity):
    assert [(r["q_heads"], r["kv_heads"]) for r in parity] == [(6, 2), (3, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [*TINY, "real_batched_uneven"])
def test_sp_tokens_equal_tp_and_one_rank(parity, scenario):
    for rank in parity:
        runs = rank[scenario]
        assert runs["sp"]["tokens"] == runs["tp"]["tokens"] == runs["tp1"]["tokens"]
        assert len(runs["sp"]["tokens"][0]) == 8
        assert runs["sp"]["computed"] == runs["tp"]["computed"]


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "sp_forwards"), [
    ("batched_uneven", 1),  # one prefill of 97 tokens; the 7 decode steps run as TP
    ("single_101", 1),
    ("chunked_101", 4),  # chunks of 24, 24, 24, 24 split; the last of 5 tokens runs as TP
    ("short", 0),  # 12 tokens, under the threshold of 16
    ("prefix_hit", 3),  # 43 tokens; then 20 + 15 and 17 + 0 after the two cached blocks
])
def test_sp_splits_prefill_forwards_at_or_over_the_threshold_only(parity, scenario,
                                                                  sp_forwards):
    for rank in parity:
        runs = rank[scenario]
        # two all-gathers per layer (before qkv and before gate/up) in each split forward
        assert runs["sp"]["all_gathers"] == 2 * rank["layers"] * sp_forwards
        assert runs["tp"]["all_gathers"] == 0


@pytest.mark.slow
def test_prefix_hit_computes_fewer_prompt_tokens(parity):
    runs = parity[0]["prefix_hit"]
    assert runs["sp"]["computed"] == 43 + (69 - 32) + (47 - 32)


@pytest.mark.slow
def test_real_model_runs_sp_in_every_layer(parity):
    assert parity[0]["real_batched_uneven"]["sp"]["all_gathers"] == 2 * 30


@pytest.mark.parametrize(("tokens", "world", "sizes"), [
    (97, 2, [49, 48]), (100, 2, [50, 50]), (5, 4, [2, 2, 1, 0]), (16, 3, [6, 6, 4]),
])
def test_token_shards_cover_the_tokens_once_in_order(tokens, world, sizes):
    ids = torch.arange(tokens)
    parts = [TokenShards(TensorParallel(rank, world), tokens).local(ids) for rank in range(world)]
    shard = TokenShards(TensorParallel(0, world), tokens)
    assert all(len(p) == shard.size for p in parts)
    assert shard.padded == shard.size * world >= tokens
    joined = torch.cat(parts)
    assert joined[:tokens].tolist() == list(range(tokens))
    assert joined[tokens:].tolist() == [0] * (shard.padded - tokens)  # pad rows
    assert [min(max(tokens - r * shard.size, 0), shard.size) for r in range(world)] == sizes


def test_sp_threshold_and_decode_choose_plain_tp():
    sp, tp = SequenceParallel(min_tokens=64), TensorParallel(0, 2)
    assert sp.shards(tp, 63, is_decode_only=False) is None
    assert sp.shards(tp, 64, is_decode_only=True) is None
    assert sp.shards(TensorParallel(), 4096, is_decode_only=False) is None  # one rank
    assert sp.shards(tp, 64, is_decode_only=False) == TokenShards(tp, 64)


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "64"])
def test_a_bad_threshold_is_refused_by_name(value):
    with pytest.raises(TensorParallelError, match="SequenceParallel.min_tokens must be a "
                                                  "positive int"):
        SequenceParallel(min_tokens=value)


def test_sp_with_pipeline_stages_is_refused():
    config = ModelConfig(ModelShape(num_layers=2, num_attention_heads=2, num_kv_heads=2, head_dim=8,
                                    hidden_size=16, intermediate_size=32, vocab_size=64),
                         max_position_embeddings=64)
    with torch.device("meta"), pytest.raises(TensorParallelError,
                                             match=r"pipeline parallelism \(pp=2\) is not wired"):
        LlamaForCausalLM(config, TensorParallel(0, 2), PipelineStage.of(2, 2, 0),
                         SequenceParallel())


def engine_prompts() -> list[list[int]]:
    """A 101-token prompt (prefilled in chunks) and a 23-token one beside it."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (101, 23)]


def engine_tokens(checkpoint, prompts, wired=lambda model: model.sp, **layout):  # noqa: ANN001, ANN202
    """Greedy tokens through the serving engine: spawned ranks, scheduler, chunked prefill
    (at most 48 tokens a step), prefix cache. Returns what ``wired`` reads off rank 0's shard
    of the model (what the config wired in: its SequenceParallel here, test_tp_overlap's fused
    collectives), each prompt's tokens, and the first prompt's tokens run again."""
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=128, block_size=16,
              max_num_batched_tokens=48, **layout)
    try:
        found = wired(llm.engine.runner.model)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
        again = llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))
    finally:
        llm.close()
    return found, [list(o.token_ids) for o in outs], list(again[0].token_ids)


@pytest.mark.slow
def test_engine_with_sp_matches_plain_tp(uneven_checkpoint):
    """TP=2 with SP (threshold 16 tokens) against TP=2 through the engine: a 101-token prompt
    prefilled in chunks with a 23-token one beside it, then the first again (a prefix hit)."""
    prompts = engine_prompts()
    sp, *with_sp = engine_tokens(uneven_checkpoint, prompts, tp=2, sp=2, sp_min_tokens=16)
    assert sp == SequenceParallel(16)
    none, *plain = engine_tokens(uneven_checkpoint, prompts, tp=2)
    assert none is None
    assert with_sp == plain
    assert with_sp[1] == with_sp[0][0]  # the prefix hit changes no token


@pytest.mark.parametrize(("flags", "message"), [
    ({"tp": 2, "sp": 2, "mode": "pd"}, "--sp 2 is not supported in PD mode: sequence "
                                       "parallelism is not run in PD workers"),
    ({"tp": 2, "pp": 2, "sp": 2}, "--sp: EngineConfig.sp must be 1 with pp > 1 (got 2); "
                                  "sequence parallelism with pipeline parallelism (pp=2) is "
                                  "not wired"),
    ({"sp": 2}, "--sp: EngineConfig.sp must be 1 or tp (1) (got 2); sequence parallelism "
                "splits a long prompt's tokens over the TP group, so sp = tp; a separate SP "
                "group with replicated weights (sp > 1 at tp = 1) is not wired"),
    ({"tp": 2, "sp": 2, "sp_min_tokens": 0}, "--sp-min-tokens: EngineConfig.sp_min_tokens "
                                             "must be a positive int"),
    ({"tp": 2, "sp": 2, "max_num_batched_tokens": 256},
     "--sp-min-tokens: EngineConfig.sp_min_tokens must be at most max_num_batched_tokens (256) "
     "when sp > 1 (got 512); a forward holds at most max_num_batched_tokens tokens"),
])
def test_serve_refuses_sp_where_it_is_not_wired_naming_the_flag(flags, message):
    from kthena_serve.spec import ServeSpec

    with pytest.raises(ValueError) as error:
        ServeSpec.resolve(flags)
    assert str(error.value).startswith(message), str(error.value)


def test_serve_spec_reports_sp():
    from kthena_serve.spec import ServeSpec

    spec = ServeSpec.resolve({"tp": 2, "sp": 2})
    assert spec.served() == {"tp": 2, "pp": 1, "dp": 1, "sp": 2, "mode": "colocated"}
    assert ServeSpec.from_json(spec.to_json()) == spec


def _start_server(checkpoint, *flags):  # noqa: ANN001, ANN202
    """``kthena serve`` of ``checkpoint`` in fp32; (process, base url, its output)."""
    return start_serve("--model", str(checkpoint), "--port", "0", "--dtype", "float32",
                       "--kv-cache-memory", "32MiB", *flags, timeout=180)


@pytest.fixture
def sp_server(uneven_checkpoint, request):
    proc, url, text = _start_server(uneven_checkpoint, "--tp", "2", "--sp", "2",
                                    "--sp-min-tokens", "16")

    def stop() -> None:
        proc.send_signal(__import__("signal").SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    request.addfinalizer(stop)
    return url, text


@pytest.mark.slow
def test_served_tp2_sp2_answers_the_openai_client_as_one_rank_does(sp_server,
                                                                   uneven_checkpoint):
    import httpx
    import openai

    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    url, text = sp_server
    assert "serving layout tp=2 pp=1 dp=1 sp=2 mode=colocated" in text, text
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 49152, (83,), generator=g).tolist()
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = api.models.list().data[0].id
    reply = api.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens == 83 and reply.usage.completion_tokens == 8
    llm = LLM(str(uneven_checkpoint), dtype="float32", num_kv_blocks=64, num_threads=1)
    try:
        expected = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].text
    finally:
        llm.close()
    assert reply.choices[0].text == expected
    assert httpx.get(f"{url}/plan", timeout=30).json()["served"] == {
        "tp": 2, "pp": 1, "dp": 1, "sp": 2, "mode": "colocated"}
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'kthena_deployment_info{dp="1",mode="colocated",pp="1",sp="2",tp="2"} 1.0' in metrics


def test_the_configs_sp_keys_are_served(tmp_path):
    """``sequence_parallel_enabled`` / ``sequence_parallel_group_size`` in a kthena_config.yaml
    become the engine's sp, and the served layout and /plan's plan carry it."""
    from kthena_core.cli import build_parser
    from kthena_serve.cli import spec_from_args

    path = tmp_path / "kthena_config.yaml"
    path.write_text("cluster: {topology: 'auto:cores', world_size: 2}\n"
                    "parallelism: {strategy: tp, tensor_parallel_size: 2,\n"
                    "              sequence_parallel_enabled: true,\n"
                    "              sequence_parallel_group_size: 2}\n")
    spec = spec_from_args(build_parser().parse_args(["serve", "--config", str(path)]))
    assert (spec.engine.tp, spec.engine.sp) == (2, 2)
    assert spec.served()["sp"] == 2 and spec.plan["layout"]["sp"] == 2
