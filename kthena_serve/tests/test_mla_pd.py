"""MLA's KV is its latent: what the pool holds, what the planner counts and what PD moves.

A tiny DeepSeek-V3 checkpoint (transformers' own, random weights) in float32:

* the engine's pool is a latent layout: layers x (kv_lora_rank + qk_rope_head_dim) x 4 bytes
  per token, one tensor per layer, equal to kthena_core's ``ModelSpec.kv_bytes_per_token``;
* the host KV tier stores and promotes latent blocks as they are;
* a PD hand-off over Mooncake (127.0.0.1), layer by layer and in one batch, moves exactly the
  prompt's latent blocks (``handoff_bytes`` = blocks x the latent block size, half of what a
  K/V pool of that width would move), and the decode engine then gives transformers' greedy
  tokens; the shared-memory (zero-copy) path gives them too. No block is left held.
"""

from __future__ import annotations

import pytest
import torch
from _model_testing import load_ours
from _moe_families import NEW_TOKENS, PROMPTS, hf_greedy, save_family
from _tiny import finish_all
from test_pd_batched_prefill import assert_no_blocks_held, over_mooncake, pool_ref

from kthena_core.model_spec import ModelSpec
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_runner import ModelRunner, create_pool, kv_layout_for
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.model import Tokenizer
from kthena_serve.pd.prefill import PrefillExecutor
from kthena_serve.pd.protocol import PoolRef, PrefillTask, params_to_json

pytest.importorskip("transformers")
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def reserve(decode: LLMEngine, rid: str, ids: list[int], ref: PoolRef) -> PrefillTask:
    """Blocks reserved on the decode side (salted per request: no prefix hit) and the task."""
    request = decode.processor.make_request(rid, ids, PARAMS, cache_salt=rid)
    reservation = decode.reserve(request)
    assert reservation is not None and reservation.num_cached_tokens == 0
    return PrefillTask(rid, tuple(ids), 0, reservation.block_ids, params_to_json(PARAMS), ref,
                       cache_salt=rid)


def decoded_ids(decode: LLMEngine, results) -> dict[str, list[int]]:  # noqa: ANN001
    """Each prefilled request admitted with its first token and decoded: its token ids."""
    for result in results:
        decode.admit_prefilled(result.request_id, result.first_token_id)
    return {rid: list(out.token_ids) for rid, out in finish_all(decode).items()}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v3-pd")
    hf = save_family(folder, "deepseek_v3")
    return folder, hf, load_ours(folder)


@pytest.fixture(scope="module")
def decode(deepseek):  # noqa: ANN001
    folder, _, net = deepseek
    config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                          block_size=4)
    layout = kv_layout_for(net.config.shape.num_layers, net.num_kv_heads_per_rank,
                           net.head_dim, config, num_parts=net.kv_parts)
    engine = LLMEngine(config, ModelRunner(net, create_pool(layout, config, shared=True)),
                       Tokenizer.from_pretrained(folder))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def executor(deepseek):  # noqa: ANN001
    folder, _, net = deepseek
    config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    executor = PrefillExecutor(net, config, own_pool=True)
    yield executor
    executor.close()


def test_the_pool_holds_the_latent_only_as_the_planner_counts_it(deepseek, decode):  # noqa: ANN001
    folder, hf, net = deepseek
    shape = decode.runner.pool.layout.shape
    mla = net.config.mla
    assert (shape.num_parts, shape.num_kv_heads, shape.head_dim) == (1, 1, 32 + 8)
    assert shape.bytes_per_token == 3 * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    spec = ModelSpec.from_hf_config(hf.config.to_dict())
    assert spec.kv_bytes_per_token("fp32") == shape.bytes_per_token
    with pytest.raises(TypeError, match="has no V cache"):
        decode.runner.pool.v_cache(0)


@pytest.mark.parametrize("mode", ["layerwise", "batched"])
def test_a_pd_handoff_moves_the_latent_blocks_only(deepseek, decode, executor, mode):  # noqa: ANN001
    _, hf, _ = deepseek
    with over_mooncake(decode, executor) as (ref, putter):
        layout = executor.layout_for(ref.num_blocks, ref.block_size, ref.dtype)
        assert layout == decode.runner.pool.layout
        tasks = [reserve(decode, f"{mode}-{i}", p, ref) for i, p in enumerate(PROMPTS)]
        results = [executor.submit_local(task, putter.session(
            ref.mooncake_handle, layout, layerwise=mode == "layerwise")).result(timeout=120)
            for task in tasks]
        latent_block = 4 * 3 * (32 + 8) * 4  # tokens x layers x latent values x fp32
        for task, result in zip(tasks, results, strict=True):
            assert result.handoff_bytes == len(task.block_ids) * latent_block
        tokens = decoded_ids(decode, results)
    assert [tokens[t.request_id] for t in tasks] == [hf_greedy(hf, p) for p in PROMPTS]
    assert_no_blocks_held(decode, executor)


def test_the_zero_copy_handoff_gives_transformers_tokens(deepseek, decode, executor):  # noqa: ANN001
    _, hf, _ = deepseek
    tasks = [reserve(decode, f"shm-{i}", p, pool_ref(decode)) for i, p in enumerate(PROMPTS)]
    results = [executor.submit_shared(task).result(timeout=120) for task in tasks]
    assert all(r.handoff_bytes == 0 for r in results)  # the prefill wrote the decode pool
    tokens = decoded_ids(decode, results)
    assert [tokens[t.request_id] for t in tasks] == [hf_greedy(hf, p) for p in PROMPTS]
    assert torch.all(decode.runner.pool.k_cache(0)[tasks[0].block_ids[0]] != 0)
    assert_no_blocks_held(decode, executor)


def test_the_host_tier_keeps_and_promotes_latent_blocks(deepseek):  # noqa: ANN001
    """An evicted prompt's latent blocks come back from the host tier (``--kv-offload``) and
    give transformers' tokens: the tier moves the latent layout's blocks as they are."""
    folder, hf, net = deepseek
    first, second = PROMPTS[0], [(7 * i + 3) % 250 for i in range(32)]
    config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=10, block_size=4,
                          max_num_seqs=1, kv_offload="host=16MiB", check_invariants=True)
    engine = LLMEngine.from_config(config, model=net, tokenizer=Tokenizer.from_pretrained(folder))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def serve(rid: str, prompt: list[int]):  # noqa: ANN202
        engine.add_request(rid, prompt, params)
        out = finish_all(engine)[rid]
        assert engine.offloader.drain(30.0)
        return out

    try:
        assert engine.runner.pool.layout.shape.num_parts == 1
        serve("a", first)
        serve("b", second)  # 9 of the 10 blocks: a's are evicted from the pool
        again = serve("a2", first)
        assert again.num_cached_tokens == 16  # 4 latent blocks: the pool's, and the tier's
        assert list(again.token_ids) == hf_greedy(hf, first)[:4]
        (host,) = engine.stats().kv_tiers
        assert host.num_promoted_blocks >= 1  # b's blocks evicted some of them
        block = engine.runner.pool.layout.bytes_per_block
        assert block == 4 * 3 * (32 + 8) * 4  # latent only
        assert host.num_bytes_out >= host.num_promoted_blocks * block
    finally:
        engine.close()
    assert engine.kv.stats().num_used_blocks == 0
