"""PD with the Mooncake Store as the KV pool every worker shares (``--kv-offload`` in PD).

* the flag in PD: workers of any TP size (no PP), ``write=through`` only, each refusal naming
  its flag; a master that does not answer is refused by name before any worker starts;
* a decode worker's reservation is filled from the offload tiers before its prompt is
  computed (in process: a host tier, a real prefill executor over the decode pool);
* end to end, with a real ``mooncake_master`` and 2 prefill + 2 decode worker processes: a
  conversation's second turn is computed once, then served by a decode worker that never saw
  the conversation, its prefix promoted from the store; the router counts the store's blocks
  in its pick; every store key, shm pool and worker process is gone at the end.

Models run in float32 where a promoted prefix must give exactly the computed tokens (see
test_kv_offload.py); the end-to-end test compares its decode workers with each other and
with a colocated engine of the PD workers' settings.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request

import pytest
from _support import wait_until
from _tiny import PD_ENGINE, default_tokenizer, greedy_text, two_prompts

from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.pd.config import PDConfig
from kthena_serve.spec import ServeSpec
from mooncake_kv.tiers.master import master_binary, start_local_master, stop_master

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TEXT = ("A shared KV pool lets every instance of a deployment reuse what any other one "
        "computed: a prompt's blocks go to the store once, and come back to whoever needs them. ")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the flag in PD ------------------------------------------------------------------------------

def test_pd_accepts_a_written_through_store() -> None:
    spec = ServeSpec.resolve({"mode": "pd", "kv_offload":
                              "host=64MiB,store=mooncake@127.0.0.1:50051,write=through"})
    offload = spec.engine.kv_offload
    assert offload.store_address == "127.0.0.1:50051" and offload.store_write_through
    assert ServeSpec.resolve({"mode": "pd", "kv_offload": "host=64MiB"}).engine.kv_offload
    for sizes in ({"decode_tp": 2}, {"tp": 2}, {"prefill_tp": 2, "decode_tp": 1}):
        # TP workers offload whole blocks in the one-rank layout (test_kv_offload_tp.py)
        assert ServeSpec.resolve({"mode": "pd", "kv_offload": "host=64MiB", **sizes}
                                 ).engine.kv_offload
    with pytest.raises(ValueError, match="--pp 2 is not supported in PD"):
        ServeSpec.resolve({"mode": "pd", "kv_offload": "host=64MiB", "pp": 2})


@pytest.mark.parametrize(("flags", "says"), [
    ({"kv_offload": "host=64MiB,store=mooncake@127.0.0.1:50051"}, "add ',write=through'"),
    ({"kv_offload": "host=64MiB,store=mooncake,write=spill"}, "write=through only"),
])
def test_pd_refuses_offload_it_cannot_honour(flags: dict, says: str) -> None:
    with pytest.raises(ValueError, match="--kv-offload") as refused:
        ServeSpec.resolve({"mode": "pd", **flags})
    assert says in str(refused.value)


def test_pd_refuses_a_master_that_does_not_answer_before_any_worker() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "kthena_serve.pd.serve", "--port", "0", "--kv-offload",
         f"host=64MiB,store=mooncake@{address},write=through"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    # (the suite's fresh cache folder converts the default model first: its progress bar)
    lines = [line for line in proc.stderr.strip().splitlines()
             if not line.startswith("converting GGUF")]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and address in lines[0] and "mooncake_master" in lines[0], lines
    assert "starting" not in proc.stderr + proc.stdout  # no worker was started


# ---- the router's pick ------------------------------------------------------------------------------

def test_router_counts_the_store_for_workers_with_a_store_tier() -> None:
    from kthena_serve.cluster.router import STORE, Router
    from mooncake_kv import BlockStored

    workers = [("decode-0", "decode", "http://d0"), ("decode-1", "decode", "http://d1"),
               ("prefill-0", "prefill", "http://p0")]
    router = Router(workers, PDConfig(pd_threshold_tokens=8), block_size=4, shared_store=True)
    for worker in router.workers.values():
        worker.is_up = True
        router.index.add_instance(worker.name)
    prompt = list(range(42))  # 10 full blocks and 2 tokens
    hashes = router.index.hasher.hash_tokens(prompt)
    router.index.apply(STORE, BlockStored(tuple(hashes), None, tuple(prompt[:40]), 4,
                                          tuple(range(10))))
    decision = router.preview(prompt)  # no worker reports a store tier: nothing counted
    assert (decision.num_store_blocks, decision.reason) == (0, "disaggregated")
    router.workers["decode-1"].has_store = True  # it promotes what the store holds
    decision = router.preview(prompt)
    assert decision.decode.name == "decode-1" and decision.num_cached_blocks == 0
    assert decision.num_store_blocks == 10 and decision.reason == "short_prompt"  # 2 left
    router.index.apply("decode-0", BlockStored(tuple(hashes[:8]), None, tuple(prompt[:32]), 4,
                                               tuple(range(8))))
    assert router.preview(prompt).decode.name == "decode-0"  # 8 in its pool beat 0.5 * 10
    router.close()


# ---- the decode side's reservation, in process (host tier) ----------------------------------------

@pytest.fixture(scope="module")
def loaded():
    import torch

    from kthena_serve.model import load_model

    threads = torch.get_num_threads()
    yield load_model("default", dtype=torch.float32)
    torch.set_num_threads(threads)


def decode_engine(loaded, kv_offload: str | None):  # noqa: ANN001, ANN201
    """A decode worker's engine: its pool in shm (a prefill executor writes it), 8 blocks."""
    from kthena_serve.engine import LLMEngine
    from kthena_serve.engine.model_runner import ModelRunner, create_pool, kv_layout_for

    model, tokenizer = loaded
    config = EngineConfig(num_kv_blocks=8, dtype="float32", num_threads=1,
                          check_invariants=True, kv_offload=kv_offload)
    layout = kv_layout_for(model.config.shape.num_layers, model.num_kv_heads_per_rank,
                           model.head_dim, config)
    return LLMEngine(config, ModelRunner(model, create_pool(layout, config, shared=True)),
                     tokenizer)


def finish(engine, rid: str, first_token: int) -> list[int]:  # noqa: ANN001
    engine.admit_prefilled(rid, first_token)
    tokens = [first_token]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                tokens = list(out.token_ids)
    return tokens


def prefill_into(executor, engine, rid: str, ids: list[int], reservation) -> tuple:  # noqa: ANN001
    """The prefill worker's part over shm: compute past the reservation's cached prefix into
    the decode pool; (first token, tokens computed)."""
    from kthena_serve.pd.protocol import PoolRef, PrefillTask, params_to_json

    pool = engine.runner.pool
    ref = PoolRef(pool.layout.num_blocks, engine.config.block_size, engine.config.dtype,
                  pool.name)
    task = PrefillTask(rid, tuple(ids), reservation.num_cached_tokens, reservation.block_ids,
                       params_to_json(GREEDY), ref)
    result = executor.submit_shared(task).result(timeout=120)
    return result.first_token_id, result.num_computed_tokens


def serve_disaggregated(executor, engine, rid: str, ids: list[int]) -> tuple:  # noqa: ANN001
    """reserve (promotion from the tiers waited for and settled) -> prefill -> decode:
    (tokens, cached prompt tokens, tokens the prefill computed)."""
    request = engine.processor.make_request(rid, ids, GREEDY)
    reservation = engine.reserve(request)
    assert reservation is not None
    if reservation.num_promoting_blocks:
        engine.wait_reserved(rid)
        reservation = engine.settle_reserved(rid)
    first, computed = prefill_into(executor, engine, rid, ids, reservation)
    tokens = finish(engine, rid, first)
    if engine.offloader is not None:
        assert engine.offloader.drain(30.0)
    return tokens, reservation.num_cached_tokens, computed


@pytest.fixture(scope="module")
def executor(loaded):
    from kthena_serve.pd.prefill import PrefillExecutor

    config = EngineConfig(num_kv_blocks=16, dtype="float32", num_threads=1)
    ex = PrefillExecutor(loaded[0], config, own_pool=True)
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def prompts(loaded):
    return two_prompts(loaded[1])


def test_reservation_is_filled_from_the_tiers_before_the_prefill(loaded, executor, prompts):
    plain = decode_engine(loaded, None)
    try:
        baseline, _, _ = serve_disaggregated(executor, plain, "ref", prompts[0])
    finally:
        plain.close()
    engine = decode_engine(loaded, "host=64MiB")
    try:
        first, cached, computed = serve_disaggregated(executor, engine, "a", prompts[0])
        assert (first, cached, computed) == (baseline, 0, 61)
        serve_disaggregated(executor, engine, "b", prompts[1])  # a's blocks leave the pool
        again, cached, computed = serve_disaggregated(executor, engine, "a2", prompts[0])
        assert again == baseline
        assert cached == 48 and computed == 61 - 48  # 3 blocks promoted, not recomputed
        (host,) = engine.stats().kv_tiers
        assert (host.num_hits, host.num_promoted_blocks) == (3, 3)
    finally:
        engine.close()
    assert engine.kv.stats().num_used_blocks == 0


def test_reservation_released_while_promoting_frees_its_blocks(loaded, executor, prompts):
    engine = decode_engine(loaded, "host=64MiB")
    try:
        serve_disaggregated(executor, engine, "a", prompts[0])
        serve_disaggregated(executor, engine, "b", prompts[1])
        reservation = engine.reserve(engine.processor.make_request("a2", prompts[0], GREEDY))
        assert reservation.num_promoting_blocks == 3
        assert engine.release("a2")  # the promotion ends first: no write into freed blocks
        assert engine.scheduler.promoting.settle_reserved("a2") == 0  # nothing left of it
        assert engine.kv.stats().num_used_blocks == 0
        again, cached, _ = serve_disaggregated(executor, engine, "a3", prompts[0])
        assert cached == 48  # the host tier still has them
    finally:
        engine.close()


# ---- end to end: a real mooncake_master, 2 prefill + 2 decode workers ------------------------------

def master_key_count(proc: subprocess.Popen) -> int:
    """``master_key_count`` from the master's metrics page (every key it holds)."""
    port = next(a for a in proc.args if a.startswith("--metrics_port=")).partition("=")[2]
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    line = next(line for line in page.decode().splitlines()
                if line.startswith("master_key_count "))
    return int(float(line.split()[1]))


@pytest.fixture
def master():
    pytest.importorskip("mooncake.store", reason="Mooncake wheel (or libibverbs1) missing")
    if not master_binary().exists():
        pytest.skip(f"mooncake_master not found at {master_binary()}; install mooncake-kv[store]")
    proc, address = start_local_master()
    try:
        yield proc, address
    finally:
        stop_master(proc)


def store_tier(state: dict) -> dict:
    (tier,) = [t for t in state["stats"]["kv_tiers"] if t["tier"] == "mooncake_store"]
    return tier


def computed_by_prefill(cluster) -> int:  # noqa: ANN001
    return sum(cluster.worker_state(name)["stats"]["num_computed_prompt_tokens"]
               for name in ("prefill-0", "prefill-1"))


@pytest.mark.mooncake
@pytest.mark.slow
def test_second_turn_is_computed_once_then_taken_from_the_store(master, colocated) -> None:
    from kthena_serve.pd.embedded import PDCluster, shm_pools

    proc, address = master
    tokenizer = default_tokenizer()
    config = EngineConfig(**PD_ENGINE, kv_offload=f"host=64MiB,store=mooncake@{address},"
                                                  "write=through")
    # no health loop (its polls would mark a worker this test took out up again): the test
    # polls; threshold 1: a prompt with any token to compute goes to a prefill worker
    pd = PDConfig(pd_threshold_tokens=1, transfer_timeout_s=60, health_interval_s=3600)
    cluster = PDCluster(config, pd, num_prefill=2, num_decode=2, tokenizer=tokenizer)
    pids = []
    try:
        cluster.start()
        pids = [cluster.launcher.pid(name) for name in cluster.launcher.workers]
        router = cluster.router
        turn1 = tokenizer.encode(TEXT * 2)[:45]
        first = cluster.complete(turn1, max_tokens=8)
        assert first.status_code == 200, first.text
        answer = tokenizer.encode(first.json()["choices"][0]["text"])
        turn2 = turn1 + answer + tokenizer.encode(" And where does a decode worker look?")
        assert len(turn2) % 16  # the last block is partial: a prefill worker computes it
        full = len(turn2) // 16

        # the second turn, computed once: on the decode worker that holds the first turn
        router.poll_all()
        (seen,) = [d for d in ("decode-0", "decode-1") if router.index.match(turn1)[d]]
        other = "decode-1" if seen == "decode-0" else "decode-0"
        assert router.preview(turn2).decode.name == seen
        second = cluster.complete(turn2, max_tokens=8)
        assert second.status_code == 200, second.text
        text = second.json()["choices"][0]["text"]
        assert text == greedy_text(colocated, turn2, 8)
        wait_until(lambda: store_tier(cluster.worker_state(seen))["num_stored_blocks"] >= full,
                   120, "the second turn's blocks written through to the store")

        # the router counts the store: the other decode worker promotes instead of computing
        router.poll_all()
        assert router.index.match(turn2)["mooncake_store"] >= full
        router.mark_down(seen)  # the instance that saw the conversation is out of the pick
        decision = router.preview(turn2)
        assert decision.decode.name == other
        assert (decision.num_cached_blocks, decision.num_store_blocks) == (0, full)
        assert decision.reason == "disaggregated" and decision.prefill is not None
        before = computed_by_prefill(cluster)
        third = cluster.complete(turn2, max_tokens=8)
        assert third.status_code == 200, third.text
        assert third.json()["choices"][0]["text"] == text  # the same tokens
        usage = third.json()["usage"]["prompt_tokens_details"]
        assert usage["cached_tokens"] == full * 16
        assert computed_by_prefill(cluster) - before == len(turn2) - full * 16
        hit = store_tier(cluster.worker_state(other))
        assert hit["num_hits"] == full and hit["num_promoted_blocks"] == full
        assert master_key_count(proc) >= full
    finally:
        cluster.stop()
    assert master_key_count(proc) == 0  # every worker removed the keys it put
    assert not [p for p in shm_pools() for pid in pids if f".{pid}." in p]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
