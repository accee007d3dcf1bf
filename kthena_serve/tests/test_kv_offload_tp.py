"""``--kv-offload`` at tp > 1: rank 0 offloads every rank's heads of a block as one block of
the one-rank layout, and splits a promoted block back over the ranks (engine/rank_blocks.py).

* the merge and split against a one-rank pool, in process (3 KV heads over 2 ranks: 2 + 1; an
  MLA latent held by every rank; int8 with its scales);
* a colocated ``tp=2`` engine with a host tier: a prompt evicted from the rank pools comes back
  from the tier and gives transformers' greedy tokens;
* with a real ``mooncake_master``: the blocks a TP2 engine process put are promoted by a TP1
  engine process that never saw the prompt (the same keys), and every key is gone once both
  close; in PD, a TP2 prefill worker and two TP1 decode workers share the store;
* a PD prefill worker's own pool (tp 1 and 2) takes an evicted prefix back from the tiers
  before computing.

A tiny fp32 checkpoint with SmolLM2's uneven head split serves every engine (test_pd_tp.py's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny import default_tokenizer, tiny_checkpoint, two_prompts
from test_kv_offload import peer_result, start_peer, stop_peer
from test_kv_offload import serve as serve_with
from test_pd_tp import HEADS, LOGPROB_TOLERANCE, TOP

from kthena_core.shape import kv_head_range, kv_heads_per_rank
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_runner import layer_caches
from kthena_serve.engine.rank_blocks import RankBlocks
from kthena_serve.engine.sampling_params import SamplingParams
from mooncake_kv import BlockId, KVLayout, KVPool, KVShape

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# this tiny model's greedy tokens repeat one token: the runners-up's logprobs show a wrong K/V
WITH_TOP = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=TOP)


# ---- the merge and split, in process --------------------------------------------------------------

def _pools(heads: int, tp: int, *, dtype: str = "fp32", parts: int = 2) -> list[KVPool]:
    return [KVPool.create(KVLayout(KVShape(2, kv_heads_per_rank(heads, tp, rank), 4, 4, dtype,
                                           parts), 5))
            for rank in range(tp)]


def _fill(pools: list[KVPool], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for pool in pools:
        for layer in layer_caches(pool):
            for part in layer:
                if part.is_floating_point():
                    part.copy_(torch.randn(part.shape, generator=generator))
                else:
                    part.copy_(torch.randint(-127, 128, part.shape, generator=generator))


@pytest.mark.parametrize(("heads", "tp", "dtype", "parts"), [
    (3, 2, "fp32", 2),  # SmolLM2's split: heads 0-1 on rank 0, head 2 on rank 1
    (2, 4, "fp32", 2),  # each KV head replicated on two ranks
    (1, 2, "fp32", 1),  # MLA: one latent, every rank holds it
    (3, 2, "int8", 2),  # and the int8 pool's scales
])
def test_a_block_merges_into_the_one_rank_layout_and_splits_back(heads, tp, dtype, parts):
    ranks = _pools(heads, tp, dtype=dtype, parts=parts)
    _fill(ranks, seed=1)
    holders: dict[tuple[int, ...], KVPool] = {}
    for rank, pool in enumerate(ranks):  # replicas hold equal copies, as the ranks compute them
        held = tuple(kv_head_range(heads, tp, rank))
        if held in holders:
            pool.buffer.copy_(holders[held].buffer)
        holders.setdefault(held, pool)
    blocks = RankBlocks(ranks, heads)
    (one,) = _pools(heads, 1, dtype=dtype, parts=parts)
    assert blocks.layout == one.layout  # the key's fingerprint is a tp=1 engine's
    for layer_one, *layer_ranks in zip(layer_caches(one), *map(layer_caches, ranks),
                                       strict=True):  # the tp=1 pool, by hand
        for p, part in enumerate(layer_one):
            for rank, layer in enumerate(layer_ranks):
                span = kv_head_range(heads, tp, rank)
                part[:, :, span.start:span.stop] = layer[p]
    assert blocks.read_block(BlockId(3)) == one.read_block(BlockId(3))

    back = _pools(heads, tp, dtype=dtype, parts=parts)
    split = RankBlocks(back, heads)
    split.write_block(BlockId(2), one.read_block(BlockId(3)))
    for got, want in zip(back, ranks, strict=True):
        for got_layer, want_layer in zip(layer_caches(got), layer_caches(want), strict=True):
            for g, w in zip(got_layer, want_layer, strict=True):
                assert torch.equal(g[2], w[3]) and not g[[0, 1, 3, 4]].any()
    with pytest.raises(ValueError, match="bytes"):
        split.write_block(BlockId(0), b"short")


def test_rank_pools_of_another_split_are_refused():
    with pytest.raises(ValueError, match="rank 1 of 2: .* L2-H2-D4-B4-fp32 .* L2-H1-D4-B4-fp32"):
        RankBlocks(_pools(4, 2), 3)  # 2 + 2 heads: not 3 heads' split (2 + 1)


# ---- engines of a tiny checkpoint ----------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:  # noqa: ANN001
    return tiny_checkpoint(tmp_path_factory.mktemp("tp-offload") / "model", **HEADS)


@pytest.fixture(scope="module")
def prompts():
    return two_prompts(default_tokenizer())  # 61 tokens; then one that fills 8 blocks of 16


@pytest.fixture(scope="module")
def transformers_tokens(checkpoint: Path, prompts) -> list[int]:  # noqa: ANN001
    """The first prompt's greedy tokens from transformers (fp32): the reference."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    return gen[0, len(prompts[0]):].tolist()


def serve(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple:
    """``test_kv_offload.serve`` with the top logprobs."""
    return serve_with(engine, request_id, prompt, WITH_TOP)


def test_tp2_prompt_evicted_from_the_rank_pools_comes_back_from_host_memory(
        checkpoint, prompts, transformers_tokens):
    engine = LLMEngine.from_config(EngineConfig(
        model=str(checkpoint), tp=2, num_kv_blocks=8, dtype="float32", num_threads=1,
        kernels="native", check_invariants=True, kv_offload="host=64MiB"))
    try:
        assert engine.offloader.pool.tp == 2
        names = [name for name, _layout in engine.runner.rank_pools()]  # /dev/shm files
        first, computed = serve(engine, "a", prompts[0])
        assert list(first.token_ids) == transformers_tokens and computed == 61
        serve(engine, "b", prompts[1])  # takes every block: a's leave the rank pools
        again, computed = serve(engine, "a2", prompts[0])
        assert list(again.token_ids) == transformers_tokens
        assert again.num_cached_tokens == 48 and computed == 61 - 48
        for promoted, computed_once in zip(again.logprobs, first.logprobs, strict=True):
            assert max(abs(a - b) for a, b in zip(promoted.top_logprobs,
                                                  computed_once.top_logprobs, strict=True)
                       ) < LOGPROB_TOLERANCE
        (host,) = engine.stats().kv_tiers
        assert (host.num_hits, host.num_promoted_blocks, host.num_dropped) == (3, 3, 0)
        # a stored block is all three heads' (the one-rank layout), not rank 0's two
        block = engine.offloader.pool.layout.bytes_per_block
        assert block == 3 * engine.runner.pool.layout.bytes_per_block // 2
        assert host.num_bytes_out > 3 * block
    finally:
        engine.close()
    assert engine.kv.stats().num_used_blocks == 0
    assert not [name for name in names if (Path("/dev/shm") / name).exists()]


@pytest.mark.mooncake
@pytest.mark.slow
def test_blocks_a_tp2_engine_put_are_promoted_by_a_tp1_engine(checkpoint, prompts,
                                                              transformers_tokens):
    pytest.importorskip("mooncake.store", reason="Mooncake wheel (or libibverbs1) missing")
    from test_pd_store import master_key_count

    from mooncake_kv.tiers.master import master_binary, start_local_master, stop_master

    if not master_binary().exists():
        pytest.skip(f"mooncake_master not found at {master_binary()}; install mooncake-kv[store]")
    proc, address = start_local_master()
    spec = f"host=64MiB,store=mooncake@{address},write=through"
    put = fetch = None
    try:
        put = start_peer(spec, prompts[0], str(checkpoint), "2")
        computed = peer_result(put)
        assert computed["tokens"] == transformers_tokens
        assert computed["num_cached_tokens"] == 0 and computed["num_computed"] == 61
        tiers = {t["tier"]: t for t in computed["tiers"]}
        assert tiers["mooncake_store"]["num_stored_blocks"] == 4  # 3 prompt blocks, 1 output
        assert master_key_count(proc) == 4
        fetch = start_peer(spec, prompts[0], str(checkpoint), "1")  # never saw the prompt
        fetched = peer_result(fetch)
        assert fetched["tokens"] == transformers_tokens
        assert fetched["num_cached_tokens"] == 48 and fetched["num_computed"] == 61 - 48
        tiers = {t["tier"]: t for t in fetched["tiers"]}
        assert (tiers["mooncake_store"]["num_hits"], tiers["host"]["num_hits"]) == (3, 0)
        assert tiers["mooncake_store"]["num_promoted_blocks"] == 3
    finally:
        try:
            for peer in (put, fetch):
                if peer is not None:
                    stop_peer(peer)
            assert master_key_count(proc) == 0  # each engine removed the keys it put
        finally:
            stop_master(proc)


@pytest.mark.parametrize("tp", [1, 2])
def test_prefill_worker_takes_its_prefix_from_the_tiers_before_computing(
        checkpoint, prompts, transformers_tokens, tp):
    """A PD prefill worker's own pool (``PrefillExecutor``; at tp=2 over a TP runner, as
    prefill_server builds it): the prompt's blocks, evicted, are promoted, not recomputed
    (and the worker steps again once the promotion is done, with nothing else queued)."""
    from kthena_serve.engine.parallel_runner import ParallelModelRunner
    from kthena_serve.model import load_model
    from kthena_serve.pd.prefill import PrefillExecutor

    config = EngineConfig(model=str(checkpoint), tp=tp, num_kv_blocks=8, dtype="float32",
                          num_threads=1, kernels="native", kv_offload="host=64MiB")
    if tp > 1:
        runner = ParallelModelRunner(config, shared_pool=True)
        executor = PrefillExecutor(runner.model, config, runner=runner)
    else:
        model, _ = load_model(str(checkpoint), dtype=torch.float32, kernels="native")
        executor = PrefillExecutor(model, config)

    def prefill(rid: str, ids: list[int]):  # noqa: ANN202 - an OwnedPrefill
        owned = executor.submit_owned(rid, ids, GREEDY).result(timeout=120)
        executor.call(executor.free, rid).result(timeout=30)
        assert executor.offloader.drain(30.0)
        return owned

    try:
        first = prefill("a", prompts[0])
        assert (first.token_id, first.num_cached_tokens) == (transformers_tokens[0], 0)
        prefill("b", prompts[1])  # a's blocks leave the pool (all but one, at tp=1)
        before = executor.num_computed_tokens
        again = prefill("a2", prompts[0])
        assert (again.token_id, again.num_cached_tokens) == (transformers_tokens[0], 48)
        assert executor.num_computed_tokens - before == 61 - 48
        (host,) = executor.kv_tier_stats()
        assert host.num_hits == host.num_promoted_blocks >= 2  # the rest: the pool's own hit
    finally:
        executor.close()  # closes the runner


@pytest.mark.mooncake
@pytest.mark.slow
def test_pd_tp2_prefill_and_tp1_decode_workers_share_the_store(
        checkpoint, prompts, transformers_tokens):
    """PD, a TP2 prefill worker and two TP1 decode workers sharing a store (``write=through``):
    the decode worker that never saw the prompt takes its full blocks from the store (put by
    the prefill worker or by the decode worker that saw it: the same keys, whichever came
    first); every key, rank pool and worker is gone at the end."""
    pytest.importorskip("mooncake.store", reason="Mooncake wheel (or libibverbs1) missing")
    from _support import wait_until
    from test_pd_store import master_key_count, store_tier
    from test_pd_tp import ENGINE

    from kthena_serve.pd.config import PDConfig
    from kthena_serve.pd.embedded import PDCluster, shm_pools
    from mooncake_kv.tiers.master import master_binary, start_local_master, stop_master

    if not master_binary().exists():
        pytest.skip(f"mooncake_master not found at {master_binary()}; install mooncake-kv[store]")
    proc, address = start_local_master()
    try:
        config = EngineConfig(model=str(checkpoint), **ENGINE,
                              kv_offload=f"host=64MiB,store=mooncake@{address},write=through")
        pd = PDConfig(pd_threshold_tokens=1, transfer_timeout_s=60, health_interval_s=3600,
                      prefill_tp=2, decode_tp=1)
        cluster = PDCluster(config, pd, num_prefill=1, num_decode=2)
        pids: list[int] = []
        try:
            cluster.start()
            pids = [cluster.launcher.pid(name) for name in cluster.launcher.workers]
            want = default_tokenizer().decode(transformers_tokens)
            first = cluster.complete(prompts[0], max_tokens=NEW_TOKENS)
            assert first.status_code == 200, first.text
            assert first.json()["choices"][0]["text"] == want
            # the TP2 prefill worker merges its ranks' heads of each block it computed
            wait_until(lambda: store_tier(cluster.worker_state("prefill-0"))["num_stored_blocks"]
                       + sum(store_tier(cluster.worker_state(d))["num_stored_blocks"]
                             for d in ("decode-0", "decode-1")) >= 3, 60,
                       "the prompt's 3 full blocks written through to the store")
            cluster.router.poll_all()
            (seen,) = [d for d in ("decode-0", "decode-1")
                       if cluster.router.index.match(prompts[0])[d]]
            other = "decode-1" if seen == "decode-0" else "decode-0"
            cluster.router.mark_down(seen)  # the decode worker that saw it is out of the pick
            again = cluster.complete(prompts[0], max_tokens=NEW_TOKENS)
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["text"] == want
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
            hit = store_tier(cluster.worker_state(other))
            assert hit["num_hits"] == hit["num_promoted_blocks"] == 3
        finally:
            cluster.stop()
        assert master_key_count(proc) == 0  # every worker removed the keys it put
        assert not [p for p in shm_pools() for pid in pids if f".{pid}." in p]
    finally:
        stop_master(proc)
