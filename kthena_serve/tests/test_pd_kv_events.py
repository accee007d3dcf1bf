"""KV events from every PD worker: real worker processes, a real ``redis-server``.

One deployment (1 prefill + 2 decode workers, the default model, ``--kv-events`` on) serves
the tests here, in order: the last one stops it. Each worker publishes under its own owner
name (``KVEventsConfig.for_worker``). The Redis view is read as the Kthena router's
kvcache-aware plugin reads it, with the hash written from its documentation
(``test_kv_events_redis.doc_key``), and compared with the PD router's own prefix index, fed by
the same workers' KV events over ``/pd/state``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import redis
from _kthena_proxy import proxy
from _serve_process import start_serve
from _support import eventually, metric_value
from _tiny import PD_ENGINE, default_tokenizer
from test_kv_events_redis import RedisServer, doc_key

from kthena_serve.engine.config import EngineConfig
from kthena_serve.kv_events import KVEventsConfig
from kthena_serve.model.source import DEFAULT_MODEL_NAME
from kthena_serve.pd import worker
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster
from kthena_serve.spec import ServeSpec

POD = "kthena-pd.serving"  # --pod-name; worker W publishes as kthena-pd-W.serving
PD = {"pd_threshold_tokens": 24, "transfer_timeout_s": 60, "health_interval_s": 0.2,
      "kv_pin_timeout_s": 8.0}
DECODES = ("decode-0", "decode-1")
TEXT = ("A returning conversation should land on the decode worker that still holds its "
        "prefix, and the router's Redis should say which pod that is. ")


def owner(worker: str) -> str:
    name, _, namespace = POD.rpartition(".")
    return f"{name}-{worker}.{namespace}"


def prompt_ids(num_tokens: int, salt: str) -> list[int]:
    return default_tokenizer().encode(salt + TEXT * (num_tokens // 20 + 2))[:num_tokens]


def redis_run(client: redis.Redis, pod: str, prompt: list[int], chunk_size: int = 16) -> int:
    """Leading chunks of ``prompt`` whose Redis hash holds ``pod``'s field: the plugin's score."""
    chunks = [prompt[i : i + chunk_size] for i in range(0, len(prompt), chunk_size)][:128]
    run = 0
    for chunk in chunks:
        if client.hget(doc_key(chunk, DEFAULT_MODEL_NAME), pod) is None:
            break
        run += 1
    return run


def owners(client: redis.Redis) -> set[str]:
    """Every owner with a field in any router key."""
    found: set[str] = set()
    for key in client.scan_iter("matrix:kv:block:*"):
        found |= {field.decode() for field in client.hkeys(key)}
    return found


def decode_requests(cluster: PDCluster, name: str) -> float:
    return metric_value(cluster.worker_metrics(name), "kthena_pd_requests_total")


# ---- without processes ----------------------------------------------------------------------------
def spec_argv(kv_events: dict | None, **engine: object) -> list[str]:
    """A decode worker's argv with the ServeSpec JSON the PD launcher gives it."""
    spec = ServeSpec(engine=EngineConfig(**engine), mode="pd").to_json()
    spec["kv_events"] = kv_events
    return ["--role", "decode", "--name", "decode-0", "--spec", json.dumps(spec)]


@pytest.mark.parametrize(("kv_events", "engine", "message"), [
    ({"redis_url": "http://r:6379", "pod": "a.b", "model": "m"}, {},
     r"^--spec: KVEventsConfig.redis_url: .*'http://r:6379' is not a redis:// URL.*write "
     r"redis://HOST:PORT"),
    ({"redis_url": "redis://r:6379", "model": "m"}, {},
     r"^--spec: not a ServeSpec's JSON: .*'pod'"),
    ({"redis_url": "redis://r:6379", "pod": "Decode_0.ns", "model": "m"}, {},
     r"^--spec: KVEventsConfig.pod: .*is not NAME.NAMESPACE"),
    ({"redis_url": "redis://r:6379", "pod": "a.b", "model": "m"},
     {"enable_prefix_caching": False}, r"^--spec: --kv-events: nothing is cached"),
])
def test_a_worker_refuses_bad_kv_events_in_its_spec(kv_events, engine, message) -> None:  # noqa: ANN001
    args = worker._parse(spec_argv(kv_events, **engine))
    with pytest.raises(ValueError, match=message):
        worker._spec(args)


def test_a_worker_with_a_bad_spec_exits_2_before_loading_the_model(tmp_path) -> None:  # noqa: ANN001
    env = {**os.environ, "KTHENA_PD_SECRET": "s" * 32}
    bad = {"redis_url": "rediss://127.0.0.1:6379", "pod": "a.b", "model": "m"}
    proc = subprocess.run(
        [sys.executable, "-m", "kthena_serve.pd.worker", *spec_argv(bad), "--ready-file",
         str(tmp_path / "ready")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("kthena_serve.pd.worker decode-0: --spec: KVEventsConfig.")
    assert "'rediss://127.0.0.1:6379' is not a redis:// URL" in proc.stderr
    assert not (tmp_path / "ready").exists()


def test_a_worker_publishes_as_the_pod_name_it_is_given() -> None:
    events = {"redis_url": "redis://r:6379", "pod": "smollm2-pd-0-decode-0-0.serving",
              "model": DEFAULT_MODEL_NAME, "max_chunks": 64}
    config = worker._spec(worker._parse(spec_argv(events))).kv_events
    assert (config.pod, config.model, config.chunk_size, config.max_chunks) == (
        "smollm2-pd-0-decode-0-0.serving", DEFAULT_MODEL_NAME, 16, 64)


# ---- one deployment, its workers publishing --------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    client = redis.Redis(port=server.port, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture(scope="module")
def cluster(server):
    kv_events = KVEventsConfig(server.url, POD, DEFAULT_MODEL_NAME)
    # block_size 16 (the default) = the router's chunk
    pd = PDCluster(EngineConfig(**PD_ENGINE), PDConfig(**PD), num_prefill=1, num_decode=2,
                   tokenizer=default_tokenizer(), kv_events=kv_events).start()
    try:
        yield pd
    finally:
        pd.stop()


def test_each_worker_publishes_under_its_own_owner_and_the_routers_pick_agrees(
        cluster, client) -> None:  # noqa: ANN001
    # 100 tokens: 6 full blocks (= 6 full router chunks) and a partial one
    prompts = {"decode-0": prompt_ids(100, "conversation zero: "),
               "decode-1": prompt_ids(100, "conversation one: ")}
    with httpx.Client(timeout=120) as http:
        for decode, ids in prompts.items():
            body = {"model": "default", "prompt": ids, "max_tokens": 4, "temperature": 0}
            exchange = proxy(http, "/v1/completions", body, cluster.launcher.url("prefill-0"),
                             cluster.launcher.url(decode))
            assert exchange.decode.status_code == 200, exchange.decode.text

    # Redis, as the plugin reads it: each conversation's 6 chunks held by the decode worker
    # that pulled it and by the prefill worker that computed it (its own pool), none by the
    # other decode worker.
    def redis_view() -> dict[tuple[str, str], int]:
        return {(w, decode): redis_run(client, owner(w), ids)
                for decode, ids in prompts.items() for w in ("prefill-0", *DECODES)}

    expected = {(w, decode): 6 if w in (decode, "prefill-0") else 0
                for decode in prompts for w in ("prefill-0", *DECODES)}
    assert eventually(lambda: redis_view() == expected, 30, interval_s=0.1), redis_view()
    assert owners(client) == {owner("prefill-0"), owner("decode-0"), owner("decode-1")}
    now = time.time()
    for ids in prompts.values():
        fields = client.hgetall(doc_key(ids[:16], DEFAULT_MODEL_NAME))
        assert all(now - 60 < int(value) <= now + 1 for value in fields.values())

    # The PD router's own index (the workers' events over /pd/state) counts the same blocks
    # per decode worker, and its pick for each prompt is the owner Redis scores highest.
    router = cluster.router
    assert router is not None

    def router_view() -> dict[tuple[str, str], int]:
        return {(w, decode): router.index.match(ids).get(w, 0)
                for decode, ids in prompts.items() for w in DECODES}

    assert eventually(lambda: router_view() == {k: v for k, v in expected.items()
                                                if k[0] in DECODES}, 30, interval_s=0.1), \
        router_view()
    for decode, ids in prompts.items():
        decision = router.preview(ids)
        best = max(DECODES, key=lambda w, ids=ids: redis_run(client, owner(w), ids))
        assert decision.decode.name == best == decode
        assert decision.num_cached_blocks == redis_run(client, owner(decode), ids) == 6

    # And the request itself goes there: a returning conversation through the PD front.
    for decode, ids in prompts.items():
        before = {w: decode_requests(cluster, w) for w in DECODES}
        reply = cluster.complete(ids, max_tokens=4)
        assert reply.status_code == 200, reply.text
        after = {w: decode_requests(cluster, w) for w in DECODES}
        assert {w: after[w] - before[w] for w in DECODES} == {
            w: (1.0 if w == decode else 0.0) for w in DECODES}


def test_the_workers_metrics_count_what_they_published(cluster) -> None:  # noqa: ANN001
    for name in ("prefill-0", *DECODES):
        text = cluster.worker_metrics(name)
        published = [line for line in text.splitlines()
                     if line.startswith("kthena_kv_events_published_keys_total")]
        assert len(published) == 1 and float(published[0].rsplit(" ", 1)[1]) >= 6, name
        assert "kthena_kv_events_held_chunks" in text


def test_stopping_the_workers_removes_every_field(cluster, client) -> None:  # noqa: ANN001
    assert owners(client)  # the first test left fields of all three
    cluster.stop()
    assert owners(client) == set()


@pytest.mark.slow
def test_kthena_serve_mode_pd_publishes_per_worker_and_cleans_up(server, client) -> None:  # noqa: ANN001
    """The CLI path: ``--kv-events`` with ``--mode pd`` reaches every worker, each under
    ``--pod-name``'s NAME-WORKER.NAMESPACE."""
    import signal

    proc, url, _ = start_serve("--mode", "pd", "--prefill", "0", "--decode", "2", "--port", "0",
                               "--kv-cache-memory", "64MiB", "--kv-events", server.url,
                               "--pod-name", POD)
    try:
        ids = prompt_ids(100, "through the CLI: ")
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": DEFAULT_MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        decodes = {owner(w): w for w in DECODES}
        assert eventually(lambda: len(owners(client)) == 1, 30, interval_s=0.1)
        (holder,) = owners(client)
        assert holder in decodes and redis_run(client, holder, ids) == 6
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert owners(client) == set()
