"""Tiered KV offload in the engine (``--kv-offload``): the flag's value, promotion of an evicted
prompt from host memory, the Mooncake Store shared by two engine processes, and a store that
dies mid-run (recompute, same tokens, no hang).

The model runs in float32 (see test_engine_real.py): a promoted prefix then gives exactly the
greedy tokens of a computed one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from _serve_process import reap
from _tiny import two_prompts

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import ConfigError, EngineConfig
from kthena_serve.engine.kv_offload import KVOffloadConfig
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.stats import EngineStats, KVTierStats
from kthena_serve.serve_args import add_engine_args
from kthena_serve.server.metrics import ServerMetrics
from kthena_serve.spec import ServeSpec, engine_config
from mooncake_kv.tiers.master import master_binary, start_local_master, stop_master

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PEER = Path(__file__).parent / "kv_offload_peer.py"


# ---- the value -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("host=2GiB", KVOffloadConfig(2 << 30)),
    (" host = 512MiB , store=mooncake ", KVOffloadConfig(512 << 20, "127.0.0.1:50051")),
    ("host=1G,store=mooncake@127.0.0.1:7000,segment=32MiB,queue=8,timeout=0.5",
     KVOffloadConfig(10**9, "127.0.0.1:7000", 32 << 20, False, 8, 0.5)),
    ("host=1G,store=mooncake,write=through",
     KVOffloadConfig(10**9, "127.0.0.1:50051", store_write_through=True)),
    ("host=1G,store=mooncake@10.0.0.2:50051,listen=10.0.0.5",
     KVOffloadConfig(10**9, "10.0.0.2:50051", store_listen="10.0.0.5")),
])
def test_kv_offload_text_is_read(text, expected):
    assert EngineConfig(kv_offload=text).kv_offload == expected
    assert KVOffloadConfig.parse(str(expected)) == expected  # the canonical text reads back


@pytest.mark.parametrize(("text", "says"), [
    ("", "no host=SIZE"),
    ("store=mooncake", "no host=SIZE"),
    ("host=lots", "cannot read 'lots' as a size"),
    ("host=1G,host=2G", "'host' given twice"),
    ("host=1G,disk=5G", "unknown item 'disk=5G'"),
    ("host=1G,store=redis@127.0.0.1:6379", "store 'redis' is not known"),
    ("host=1G,store=mooncake@nowhere", "'nowhere' is not HOST:PORT"),
    ("host=1G,queue=0", "queue='0' is not a positive integer"),
    ("host=1G,segment=1G", "segment= without store="),
    ("host=1G,write=through", "write= without store="),
    ("host=1G,listen=10.0.0.5", "listen= without store="),
    ("host=1G,store=mooncake,listen=a:b", "listen='a:b' is not an address"),
    ("host=1G,store=mooncake,write=back", "write='back' is not 'spill' or 'through'"),
    ("host=1G,store=mooncake,segment=0", "segment: size must be positive"),
    ("host=1G,timeout=never", "timeout='never'"),
])
def test_bad_kv_offload_is_refused_with_the_reason(text, says):
    with pytest.raises(ConfigError, match="EngineConfig.kv_offload must be") as caught:
        EngineConfig(kv_offload=text)
    assert says in str(caught.value) and "host=SIZE" in str(caught.value)


def test_config_with_kv_offload_survives_json():  # how DP replicas get their config
    import attrs

    config = EngineConfig(kv_offload="host=1G,store=mooncake@127.0.0.1:7000,queue=9")
    assert EngineConfig(**json.loads(json.dumps(attrs.asdict(config)))) == config


def test_kv_offload_needs_pp1_spawned_ranks_and_prefix_caching():
    assert EngineConfig(kv_offload="host=1G", tp=2).tp == 2  # test_kv_offload_tp.py
    with pytest.raises(ConfigError, match="pipeline stage's pool holds some layers"):
        EngineConfig(kv_offload="host=1G", tp=2, pp=2)
    with pytest.raises(ConfigError, match="ranks_from='spawn'"):
        EngineConfig(kv_offload="host=1G", ranks_from="env")
    with pytest.raises(ConfigError, match="without prefix caching"):
        EngineConfig(kv_offload="host=1G", enable_prefix_caching=False)


def _args(*argv: str) -> dict:
    """The engine flags given, as ``kthena serve`` parses them (no defaults of their own)."""
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    add_engine_args(parser)
    return vars(parser.parse_args(list(argv)))


def test_flag_reaches_the_config_and_shows_in_help():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "--kv-offload" in parser.format_help()
    config = engine_config(_args("--kv-offload", "host=64MiB"))
    assert config.kv_offload == KVOffloadConfig(64 << 20)
    with pytest.raises(ValueError, match="^--kv-offload: EngineConfig.kv_offload"):
        engine_config(_args("--kv-offload", "host=64MiB,queue=-1"))
    pd = {**_args("--kv-offload", "host=64MiB"), "mode": "pd"}  # every PD worker opens it
    assert ServeSpec.resolve(pd).engine.kv_offload == KVOffloadConfig(64 << 20)
    spill = {**_args("--kv-offload", "host=64MiB,store=mooncake"), "mode": "pd"}
    with pytest.raises(ValueError, match="write=through only"):  # test_pd_store.py: the rest
        ServeSpec.resolve(spill)


def test_tier_stats_survive_json_and_add_up():
    host = KVTierStats("host", 3, 1, 3, 5, 500, 300, 2, 0, 4)
    store = KVTierStats("mooncake_store", 1, 0, 1, 2, 200, 100, 0, 1, None)
    from mooncake_kv import KVCacheStats

    kv = KVCacheStats(num_blocks=8, block_size=16, num_used_blocks=0, num_free_blocks=8,
                      num_cached_blocks=0, num_running_requests=0, num_queries=0,
                      num_query_tokens=0, num_hit_tokens=0, num_evicted_blocks=0)
    stats = EngineStats(1, 2, 3, 0, 0, 0, kv, (host, store))
    assert EngineStats.from_json(json.loads(json.dumps(stats.to_json()))) == stats
    total = EngineStats.total([stats, stats], 16)
    assert total.kv_tiers[0] == KVTierStats("host", 6, 2, 6, 10, 1000, 600, 4, 0, 8)
    assert total.kv_tiers[1].queue_depth is None and total.kv_tiers[1].num_errors == 2


# ---- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded():
    import torch

    from kthena_serve.model import load_model

    threads = torch.get_num_threads()
    yield load_model("default", dtype=torch.float32)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(loaded):
    return two_prompts(loaded[1])


def make_engine(loaded, kv_offload=None) -> LLMEngine:  # noqa: ANN001
    model, tokenizer = loaded
    config = EngineConfig(num_kv_blocks=8, dtype="float32", num_threads=1,
                          check_invariants=True, kv_offload=kv_offload)
    return LLMEngine.from_config(config, model=model, tokenizer=tokenizer)


def serve(engine: LLMEngine, request_id: str, prompt, params=None) -> tuple:  # noqa: ANN001
    """(output, prompt tokens computed for it; ``params``: greedy), the offloader drained
    after."""
    before = engine.stats().num_computed_prompt_tokens
    engine.add_request(request_id, prompt, GREEDY if params is None else params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    if engine.offloader is not None:
        assert engine.offloader.drain(30.0)
    return final, engine.stats().num_computed_prompt_tokens - before


@pytest.fixture(scope="module")
def baseline(loaded, prompts):
    """Greedy tokens of both prompts, and of the first one served again, with tiers off."""
    engine = make_engine(loaded)
    try:
        first, _ = serve(engine, "a", prompts[0])
        serve(engine, "b", prompts[1])
        again, computed = serve(engine, "a2", prompts[0])
    finally:
        engine.close()
    assert again.num_cached_tokens == 0 and computed == len(prompts[0])  # evicted: recomputed
    assert again.token_ids == first.token_ids
    return first.token_ids


def offload_threads(wait_s: float = 0.0) -> list[threading.Thread]:
    """The offloader's threads still alive, after waiting up to ``wait_s`` for them to end."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [t for t in threading.enumerate()
                 if t.name.startswith(("kv-offload", "kv-promoter", "kv-tier"))]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def test_evicted_prompt_is_promoted_from_host_memory(loaded, prompts, baseline):
    engine = make_engine(loaded, "host=64MiB")
    try:
        serve(engine, "a", prompts[0])
        serve(engine, "b", prompts[1])  # takes every block: a's are evicted from the pool
        again, computed = serve(engine, "a2", prompts[0])
        assert again.token_ids == baseline
        assert again.num_cached_tokens == 48 and computed == len(prompts[0]) - 48
        (host,) = engine.stats().kv_tiers
        assert (host.tier, host.num_hits, host.num_promoted_blocks) == ("host", 3, 3)
        assert host.num_bytes_out > 3 * engine.runner.pool.layout.bytes_per_block
        assert host.queue_depth == 0 and host.num_dropped == 0
        # each stored block is held once, framed (a header past its bytes), until evicted
        block = engine.runner.pool.layout.bytes_per_block
        assert host.num_stored_blocks * block < host.used_bytes <= host.num_bytes_in
        text = ServerMetrics(AsyncLLM(engine)).render().decode()  # not started: stats only
        assert 'kthena_kv_tier_promotions_total{tier="host"} 3.0' in text
        assert 'kthena_kv_tier_hits_total{tier="host"} 3.0' in text
        assert 'kthena_kv_tier_offload_queue_depth{tier="host"} 0.0' in text
        (used,) = [line.split()[-1] for line in text.splitlines()
                   if line.startswith('kthena_kv_tier_used_bytes{tier="host"}')]
        assert float(used) == host.used_bytes
        assert 'kthena_kv_tier_dropped_offloads_total{tier="host"} 0.0' in text
    finally:
        engine.close()
    stats = engine.kv.stats()
    assert stats.num_used_blocks == 0 and stats.num_running_requests == 0
    assert offload_threads() == []


def test_request_aborted_while_promoting_gives_its_blocks_back(loaded, prompts):
    engine = make_engine(loaded, "host=64MiB")
    try:
        serve(engine, "a", prompts[0])
        serve(engine, "b", prompts[1])
        engine.add_request("a2", prompts[0], GREEDY)
        engine.step()  # admitted as promoting: blocks held, nothing computed yet
        assert "a2" in engine.scheduler.promoting
        assert engine.abort_request("a2").finish_reason.value == "abort"
        assert not engine.has_unfinished_requests()
        assert engine.kv.stats().num_used_blocks == 0
        again, _ = serve(engine, "a3", prompts[0])  # the blocks are still there to promote
        assert again.num_cached_tokens == 48
    finally:
        engine.close()


# ---- Mooncake Store: a real mooncake_master on 127.0.0.1 ---------------------------------------

def start_master() -> tuple[subprocess.Popen, str]:
    pytest.importorskip("mooncake.store", reason="Mooncake wheel (or libibverbs1) missing")
    if not master_binary().exists():
        pytest.skip(f"mooncake_master not found at {master_binary()}; install mooncake-kv[store]")
    return start_local_master()


@pytest.fixture(scope="module")
def master():
    proc, address = start_master()
    yield address
    stop_master(proc)
    assert proc.returncode is not None


def start_peer(kv_offload: str, prompt, *model_tp: str) -> subprocess.Popen:  # noqa: ANN001
    """An engine process (kv_offload_peer.py): the default model, or ``MODEL TP``. Its stderr
    (warnings such as a store tier left out, and why) goes to an unnamed temp file that a
    failed check shows (`peer_log`)."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "GLOG_minloglevel": "2"}
    log = tempfile.TemporaryFile()
    try:
        peer = subprocess.Popen([sys.executable, str(PEER), kv_offload,
                                 json.dumps(list(prompt)), *model_tp],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True, env=env)
    except BaseException:
        log.close()
        raise
    peer.log = log
    return peer


def peer_log(peer: subprocess.Popen, tail: int = 4000) -> str:
    """The end of the peer's stderr so far (read at an offset: the peer's writes go on)."""
    size = os.fstat(peer.log.fileno()).st_size
    return os.pread(peer.log.fileno(), tail, max(0, size - tail)).decode(errors="replace")


def peer_result(peer: subprocess.Popen) -> dict:
    """The peer's JSON line; every tier its ``--kv-offload`` names must have opened."""
    line = peer.stdout.readline()
    assert line, f"engine process exited with {peer.wait()} before answering:\n{peer_log(peer)}"
    result = json.loads(line)
    if "store=" in peer.args[2]:
        tiers = [t["tier"] for t in result["tiers"]]
        assert "mooncake_store" in tiers, f"the store tier was left out ({tiers}):\n{peer_log(peer)}"
    return result


def stop_peer(peer: subprocess.Popen) -> None:
    try:
        peer.stdin.write("quit\n")
        peer.stdin.close()
        peer.wait(timeout=60)
    finally:
        reap(peer)
        peer.log.close()
    assert peer.returncode == 0, f"engine process ended with {peer.returncode}"


@pytest.mark.mooncake
@pytest.mark.slow
def test_two_engine_processes_share_blocks_through_the_store(master, prompts, baseline):
    # write=through: the store has every block at once (spills are the killed-store test's)
    spec = f"host=64MiB,store=mooncake@{master},write=through"
    first = start_peer(spec, prompts[0])
    second = None
    try:
        computed = peer_result(first)
        assert computed["tokens"] == list(baseline)
        assert computed["num_cached_tokens"] == 0 and computed["num_computed"] == 61
        tiers = {t["tier"]: t for t in computed["tiers"]}
        assert tiers["mooncake_store"]["num_stored_blocks"] == 4  # 3 prompt blocks, 1 output
        assert tiers["host"]["num_stored_blocks"] == 4  # and a copy of each kept here
        from mooncake_kv.listen import listening_sockets, wildcard_listeners

        # the store client's listeners (Mooncake's RPC and data ports) are on loopback only
        assert wildcard_listeners(first.pid) == [], listening_sockets(first.pid)
        assert listening_sockets(first.pid)
        second = start_peer(spec, prompts[0])
        fetched = peer_result(second)
    finally:
        for peer in (first, second):
            if peer is not None:
                stop_peer(peer)
    assert fetched["tokens"] == list(baseline)
    assert fetched["num_cached_tokens"] == 48 and fetched["num_computed"] == 61 - 48
    tiers = {t["tier"]: t for t in fetched["tiers"]}
    assert tiers["mooncake_store"]["num_hits"] == 3
    assert tiers["mooncake_store"]["num_promoted_blocks"] == 3
    assert tiers["host"]["num_hits"] == 0


@pytest.mark.mooncake
@pytest.mark.slow
def test_store_killed_mid_run_degrades_to_recompute(loaded, prompts, baseline):
    proc, address = start_master()
    engine = None
    try:
        engine = make_engine(loaded, f"host=1,store=mooncake@{address},timeout=10")
        serve(engine, "a", prompts[0])
        serve(engine, "b", prompts[1])
        store = engine.stats().kv_tiers[1]
        assert store.tier == "mooncake_store" and store.num_stored_blocks >= 4
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        again, computed = serve(engine, "a2", prompts[0])
        assert again.token_ids == baseline and again.error is None
        assert again.num_cached_tokens == 0 and computed == len(prompts[0])  # recomputed
        store = engine.stats().kv_tiers[1]
        assert store.num_errors >= 1 and store.num_promoted_blocks == 0
        last, _ = serve(engine, "b2", prompts[1])  # and the engine goes on serving
        assert last.finish_reason is not None and last.error is None
    finally:
        if engine is not None:
            engine.close()
        stop_master(proc)
    # the store's close outlives engine.close() here: the offloader gives it 15 s, then leaves
    # it to a daemon thread; the Mooncake client retries the dead master for ~25 s, then ends
    assert offload_threads(wait_s=60) == [] and proc.returncode is not None


# ---- the benchmark's smoke test (figures: kthena bench kv, docs/bench_kv.md) --------------------

def test_kv_bench_cases_and_their_per_turn_figures(loaded):
    from kthena_serve.bench.kv import BenchShape, run_case, table

    model, tokenizer = loaded
    shape = BenchShape(sessions=3, turns=3, user_tokens=32, max_tokens=2)
    runs = [run_case(case, shape, model, tokenizer, dtype="float32")
            for case in ("off", "host", "2x-host")]
    off, host, two = json.loads(json.dumps(runs))
    assert [r["requests"] for r in runs] == [9, 9, 9]
    for run in runs:
        turns = run["per_turn"]
        assert [t["turn"] for t in turns] == [1, 2, 3]
        assert sum(t["computed_prompt_tokens"] for t in turns) == run["computed_prompt_tokens"]
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
    # the first turn is new to everyone; later turns, without tiers, recompute evicted history
    assert off["per_turn"][0]["computed_prompt_tokens"] == 3 * 32
    assert host["per_turn"][0]["computed_prompt_tokens"] == 3 * 32
    assert host["computed_prompt_tokens"] < off["computed_prompt_tokens"]
    assert host["per_turn"][2]["computed_prompt_tokens"] < off["per_turn"][2]["computed_prompt_tokens"]
    assert host["tiers"][0]["num_promoted_blocks"] > 0 and off["tiers"] == []
    # the pool never holds more than its blocks; the host tier holds what left it
    layers = model.config.shape.num_layers
    pool_bytes = shape.pool_blocks * 2 * layers * model.num_kv_heads_per_rank \
        * model.head_dim * shape.block_size * 4
    assert all(t["pool_bytes"] <= pool_bytes and t["host_bytes"] == 0 for t in off["per_turn"])
    assert host["per_turn"][-1]["host_bytes"] == host["tiers"][0]["used_bytes"] > 0
    # two worker processes, each with its own host tier: each gets half the requests
    assert two["instances"] == 2 and [t["tier"] for t in two["tiers"]] == ["host", "host"]
    assert two["computed_prompt_tokens"] >= host["computed_prompt_tokens"]
    assert table({"runs": runs}).count("\n") == 4  # header, rule, one row per case


def test_kv_bench_refuses_an_unknown_case(capsys):
    from kthena_serve.bench.kv import main

    assert main(["--cases", "off,disk"]) == 2
    assert "--cases takes off, host, host+store" in capsys.readouterr().err
