"""KV events for the Kthena router, end to end: a real engine, a real ``redis-server``.

Each test starts its own ``redis-server`` on a free port of 127.0.0.1 (no persistence) and
stops it. The expected keys are computed here, independently of the publisher: the router's
hash written from its documentation (``hashlib``) over the tokens the engine cached.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import redis  # the dev extra installs it (kthena-serve[kv-events])
from _serve_process import start_serve
from _support import free_port, wait_until
from _tiny import tiny_engine

from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.kv_events import KVEventsCollector, KVEventsConfig, RedisKVPublisher
from kthena_serve.kv_events.publisher import CLIENT_NAME

POD = "kthena-0.default"
MODEL = "tiny"
BLOCK_SIZE = 4  # the engine's; the router's chunks are 16 unless a test says otherwise


# ---- the router's view, written from its documentation --------------------------------------------
def doc_hash(chunk: list[int]) -> int:
    digest = hashlib.sha256(b"".join(t.to_bytes(4, "big") for t in chunk)).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFFFFFFFFFFFFFF


def doc_key(chunk: list[int], model: str = MODEL) -> str:
    return f"matrix:kv:block:{model}@{doc_hash(chunk)}"


def doc_key_of(chunk_hash: int) -> str:
    return f"matrix:kv:block:{MODEL}@{chunk_hash}"


def cached_tokens(sequence: list[int]) -> list[int]:
    """What the engine caches of a finished request: the full blocks whose KV was written (the
    last sampled token never ran through the model)."""
    return sequence[: (len(sequence) - 1) // BLOCK_SIZE * BLOCK_SIZE]


def expected_keys(sequences: list[list[int]], chunk_size: int = 16, max_chunks: int = 128) -> set:
    keys = set()
    for sequence in sequences:
        ids = cached_tokens(sequence)
        for j in range(min(len(ids) // chunk_size, max_chunks)):
            keys.add(doc_key(ids[j * chunk_size : (j + 1) * chunk_size]))
    return keys


def router_score(client, prompt: list[int], chunk_size: int = 16) -> tuple[int, int]:
    """(leading chunks owned by POD, chunks looked up), as the plugin scores a prompt."""
    chunks = [prompt[i : i + chunk_size] for i in range(0, len(prompt), chunk_size)][:128]
    run = 0
    for chunk in chunks:
        if POD.encode() not in client.hgetall(doc_key(chunk)):
            break
        run += 1
    return run, len(chunks)


def owned(client) -> dict[str, int]:
    """Every key holding POD's field, with its value."""
    found = {}
    for key in client.scan_iter("matrix:kv:block:*"):
        value = client.hget(key, POD)
        if value is not None:
            found[key.decode()] = int(value)
    return found


# ---- a redis-server of our own --------------------------------------------------------------------
class RedisServer:
    def __init__(self, workdir) -> None:  # noqa: ANN001
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is missing: make install (apt-get install redis-server)")
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis(port=self.port, socket_timeout=1)
        try:
            for _ in range(200):
                try:
                    probe.ping()
                    return self
                except redis.ConnectionError:
                    time.sleep(0.025)
        finally:
            probe.close()
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        """SIGKILL: the server is lost, as in a crash (``start`` brings up an empty one on the
        same port)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def client(server):
    client = redis.Redis(port=server.port, socket_timeout=5)
    yield client
    client.close()


def make_publisher(server: RedisServer, source, **config) -> RedisKVPublisher:  # noqa: ANN001
    return RedisKVPublisher(KVEventsConfig(server.url, POD, MODEL, **config), source)


def prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length + 7 * i)] for i in range(num)]


def generate(engine, prompt_list: list[list[int]], max_tokens: int = 9,  # noqa: ANN001
             cache_salt: str | None = None) -> list[list[int]]:
    """Run the prompts to the end on ``engine`` (this thread); prompt + output of each."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = {}
    for prompt in prompt_list:
        request_id = f"r{len(ids)}-{time.monotonic_ns()}"
        ids[request_id] = prompt
        engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None
                done[out.request_id] = ids[out.request_id] + list(out.token_ids)
    return [done[request_id] for request_id in ids]


# ---- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [16, 6])
def test_keys_and_values_are_what_the_router_reads(server, client, chunk_size):
    engine = tiny_engine(num_kv_blocks=256)
    base = prompts(3, 40)
    shared = base[0][:32] + base[1][:20]  # a prefix hit: blocks cached once, keys too
    first_key = doc_key(base[0][:chunk_size])
    client.hset(first_key, "other-pod.default", "1")  # another pod's ownership stays
    started = int(time.time())
    with make_publisher(server, engine.kv, chunk_size=chunk_size) as publisher:
        sequences = generate(engine, [*base, shared])
        salted = generate(engine, prompts(1, 40, seed=12), cache_salt="tenant-a")
        assert publisher.wait_synced()
        assert not expected_keys(salted) & set(owned(client))  # its KV is the tenant's only
        found = owned(client)
        expected = expected_keys(sequences, chunk_size)
        assert set(found) == expected
        assert all(started <= value <= time.time() + 1 for value in found.values())
        assert all(0 < client.ttl(key) <= 24 * 3600 for key in found)
        assert client.hget(first_key, "other-pod.default") == b"1"
        stats = publisher.stats()
        assert stats.num_published_keys == stats.num_held_chunks == len(expected)
        assert (stats.num_dropped_events, stats.num_redis_errors, stats.num_removed_keys) == (0, 0, 0)
        for prompt in [*base, shared]:  # the router's lookup: every full chunk of the prompt
            assert router_score(client, prompt, chunk_size) == (
                len(prompt) // chunk_size, -(-len(prompt) // chunk_size))
    assert owned(client) == {}
    assert client.hgetall(first_key) == {b"other-pod.default": b"1"}


def test_eviction_removes_fields(server, client):
    engine = tiny_engine(num_kv_blocks=256)
    with make_publisher(server, engine.kv) as publisher:
        first = generate(engine, prompts(1, 45, seed=1))
        num_first_blocks = engine.kv.stats().num_cached_blocks
        second = generate(engine, prompts(1, 50, seed=2))
        assert publisher.wait_synced()
        assert set(owned(client)) == expected_keys(first + second)
        # the first request's blocks are the least recently used: they go first
        assert engine.kv.evict(num_first_blocks) == num_first_blocks
        assert publisher.wait_synced()
        assert set(owned(client)) == expected_keys(second)
        assert router_score(client, first[0][:45]) == (0, 3)
        engine.kv.evict(engine.kv.num_blocks)
        assert publisher.wait_synced()
        assert owned(client) == {}
        stats = publisher.stats()
        assert stats.num_removed_keys == stats.num_published_keys > 0
        assert stats.num_held_chunks == 0


def test_redis_gone_mid_run_then_back(server, client):
    engine = tiny_engine(num_kv_blocks=256)
    with make_publisher(server, engine.kv, socket_timeout_s=0.5, max_backoff_s=0.2) as publisher:
        before = generate(engine, prompts(2, 40, seed=3))
        assert publisher.wait_synced()
        server.stop()
        during = generate(engine, prompts(3, 40, seed=4))  # serving goes on
        wait_until(lambda: publisher.stats().num_redis_errors > 0, 20, "a Redis error")
        assert not publisher.wait_synced(timeout=0.3)
        server.start()  # same port, empty: the publisher resyncs everything it holds
        assert publisher.wait_synced()
        assert set(owned(client)) == expected_keys(before + during)
        assert publisher.stats().num_dropped_events == 0


def test_slow_redis_drops_events_and_never_blocks_the_engine(server, client):
    engine = tiny_engine(num_kv_blocks=512, max_num_seqs=8)
    with make_publisher(server, engine.kv, queue_size=4, socket_timeout_s=1.0,
                        max_backoff_s=0.2) as publisher:
        os.kill(server.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            sequences = generate(engine, prompts(8, 30, seed=5), max_tokens=24)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert len(sequences) == 8 and all(len(s) >= 30 + 24 for s in sequences)
        stats = publisher.stats()
        assert stats.num_dropped_events > 0
        assert publisher.wait_synced()
        # lost events cost claims, never make false ones; Redis holds what the publisher holds
        held = {doc_key_of(chunk) for chunk in publisher.held_chunks()}
        assert set(owned(client)) == held <= expected_keys(sequences)


def test_shutdown_removes_fields_and_leaks_nothing(server, client):
    engine = tiny_engine(num_kv_blocks=256)
    threads_before = set(threading.enumerate())
    publisher = make_publisher(server, engine.kv).start()
    sequences = generate(engine, prompts(2, 40, seed=6))
    assert publisher.wait_synced()
    keys = expected_keys(sequences)
    assert set(owned(client)) == keys
    client.hset(next(iter(keys)), "other-pod.default", "1")
    names = lambda: [c["name"] for c in client.client_list()]  # noqa: E731
    assert CLIENT_NAME in names()
    publisher.close()
    assert owned(client) == {}
    assert client.hget(next(iter(keys)), "other-pod.default") == b"1"
    wait_until(lambda: CLIENT_NAME not in names(), 20, "its socket to close")
    assert set(threading.enumerate()) <= threads_before
    with pytest.raises(ValueError, match="not subscribed"):
        engine.kv.unsubscribe(publisher._on_event)
    generate(engine, prompts(1, 40, seed=7))  # later events go nowhere
    assert owned(client) == {}
    publisher.close()  # twice is fine


def test_shutdown_with_redis_gone_is_bounded(server, client):
    engine = tiny_engine(num_kv_blocks=256)
    publisher = make_publisher(server, engine.kv, socket_timeout_s=0.5).start()
    generate(engine, prompts(1, 40, seed=8))
    assert publisher.wait_synced()
    server.stop()
    publisher.close(timeout=10)
    assert not publisher._thread.is_alive()
    assert publisher.stats().num_redis_errors >= 1


def test_refresh_rewrites_timestamps(server, client):
    engine = tiny_engine(num_kv_blocks=256)
    with make_publisher(server, engine.kv, refresh_s=0.5) as publisher:
        generate(engine, prompts(1, 40, seed=9))
        assert publisher.wait_synced()
        key = next(iter(owned(client)))
        client.hset(key, POD, "1")  # as if written long ago
        wait_until(lambda: int(client.hget(key, POD)) > 1, 20, "the key rewritten")
        assert publisher.stats().num_published_keys == publisher.stats().num_held_chunks


def test_metrics_on_the_server_next_to_the_others(server, client):
    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.server import BackgroundServer, build_app
    from kthena_serve.server.metrics import add_collector

    async_engine = AsyncLLM(tiny_engine(num_kv_blocks=256)).start()
    publisher = make_publisher(server, async_engine.kv_cache).start()
    try:
        app = build_app(async_engine, model_name=MODEL)
        add_collector(app, KVEventsCollector(publisher))
        prompt = prompts(1, 48, seed=10)[0]
        with BackgroundServer(app) as http, httpx.Client(base_url=http.url, timeout=60) as web:
            reply = web.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True})
            assert reply.status_code == 200
            assert publisher.wait_synced()
            assert router_score(client, prompt) == (3, 3)
            text = web.get("/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("kthena_")}
        stats = publisher.stats()
        assert values["kthena_kv_events_published_keys_total"] == stats.num_published_keys >= 3
        assert values["kthena_kv_events_removed_keys_total"] == 0
        assert values["kthena_kv_events_dropped_events_total"] == 0
        assert values["kthena_kv_events_redis_errors_total"] == 0
        assert values["kthena_kv_events_held_chunks"] == stats.num_held_chunks
        assert "kthena_kv_blocks_cached" in values  # next to the server's own
    finally:
        publisher.close()
        async_engine.shutdown()
    assert owned(client) == {}


def test_missing_client_names_the_extra(monkeypatch, capsys):
    import argparse

    from kthena_serve import cli

    monkeypatch.setitem(sys.modules, "redis", None)  # as if redis-py were not installed
    config = KVEventsConfig("redis://127.0.0.1:1", POD, MODEL)
    with pytest.raises(ImportError, match=r"kthena-serve\[kv-events\]"):
        RedisKVPublisher(config, tiny_engine().kv)
    parser = argparse.ArgumentParser()
    cli.register_serve(parser.add_subparsers())
    args = parser.parse_args(["serve", "--kv-events", "redis://127.0.0.1:1", "--pod-name",
                              POD, "--model", "/nonexistent"])
    assert args.func(args) == 2  # refused before any model loads
    assert "kthena-serve[kv-events]" in capsys.readouterr().err


@pytest.mark.slow
def test_kthena_serve_publishes_and_cleans_up(server, client):
    proc, url, _ = start_serve("--port", "0", "--kv-cache-memory", "64MiB",
                               "--served-model-name", MODEL, "--kv-events", server.url,
                               "--pod-name", POD)
    try:
        prompt = prompts(1, 40, seed=11)[0]
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200
        wait_until(lambda: router_score(client, prompt) == (2, 3), 20, "the router's score (2, 3)")
        assert "kthena_kv_events_published_keys_total" in httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert owned(client) == {}
