"""PD worker control ports: the deployment secret, the prefill-URL allow-list, no prompts on
``/pd/state``. One deployment (1 prefill + 1 decode worker) serves the end-to-end tests; the
helpers and the middleware are checked without processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _support import metric_value
from _tiny import PD_ENGINE, default_tokenizer
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kthena_serve.cluster.auth import LOOPBACK_HOSTS, SECRET_ENV, check_prefill_url
from kthena_serve.cluster.events import EventLog, event_from_json
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster
from kthena_serve.pd.protocol import params_to_json
from kthena_serve.server.middleware import ApiKeyMiddleware, public_paths
from mooncake_kv import KVCacheManager

PD = {"pd_threshold_tokens": 24, "transfer_timeout_s": 60, "health_interval_s": 0.2}
SECRET_TEXT = "Zanzibar quokkas audit the lighthouse ledger at dawn, every single morning. "


# ---- without processes ------------------------------------------------------------------------
@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8001", "http://localhost:9/", "http://[::1]:80", "http://LOCALHOST:1"])
def test_loopback_prefill_urls_pass(url: str) -> None:
    check_prefill_url(url, LOOPBACK_HOSTS)


@pytest.mark.parametrize("url, why", [
    ("http://169.254.169.254:80", "not a prefill worker host"),
    ("http://example.com:8001", "not a prefill worker host"),
    ("https://127.0.0.1:8001", "http://HOST:PORT"),
    ("http://127.0.0.1", "http://HOST:PORT"),
    ("http://127.0.0.1:8001/admin?x=1", "http://HOST:PORT"),
    ("http://user:pw@127.0.0.1:8001", "http://HOST:PORT"),
    ("http://127.0.0.1:99999", "not a valid URL"),
    (42, "must be a string"),
])
def test_other_prefill_urls_are_refused(url, why: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=why):
        check_prefill_url(url, LOOPBACK_HOSTS)


def test_named_hosts_extend_the_allow_list() -> None:
    check_prefill_url("http://10.213.0.1:8001", {*LOOPBACK_HOSTS, "10.213.0.1"})
    with pytest.raises(ValueError, match="10.213.0.2"):
        check_prefill_url("http://10.213.0.2:8001", {*LOOPBACK_HOSTS, "10.213.0.1"})


def test_bearer_scheme_is_case_insensitive_and_key_exact() -> None:
    app = FastAPI()
    app.add_api_route("/x", lambda: {"ok": True})
    app.add_api_route("/health", lambda: {"ok": True})
    client = TestClient(ApiKeyMiddleware(app, api_key="k3y"))
    assert client.get("/health").status_code == 200
    for header in ("Bearer k3y", "bearer k3y", "BEARER  k3y"):
        assert client.get("/x", headers={"Authorization": header}).status_code == 200, header
    for header in ("Bearer k3", "Bearer k3yy", "Basic k3y", "k3y", "Bearer", ""):
        assert client.get("/x", headers={"Authorization": header}).status_code == 401, header
    assert client.get("/x").status_code == 401
    with pytest.raises(ValueError, match="non-empty"):
        ApiKeyMiddleware(app, api_key="")


def test_public_metrics_open_exactly_metrics_and_health() -> None:
    app = FastAPI()
    for path in ("/metrics", "/health", "/pd/state", "/metrics/x"):
        app.add_api_route(path, lambda: {"ok": True})
    guarded = TestClient(ApiKeyMiddleware(app, api_key="k3y",
                                          open_paths=public_paths(public_metrics=False)))
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/metrics").status_code == 401
    public = TestClient(ApiKeyMiddleware(app, api_key="k3y",
                                         open_paths=public_paths(public_metrics=True)))
    assert public.get("/metrics").status_code == 200 and public.get("/health").status_code == 200
    for path in ("/pd/state", "/metrics/x"):
        assert public.get(path).status_code == 401, path
        assert public.get(path, headers={"Authorization": "Bearer k3y"}).status_code == 200


def test_kv_events_on_the_wire_carry_no_tokens() -> None:
    kv = KVCacheManager(8, 4)
    log = EventLog(kv)
    prompt = [101, 202, 303, 404, 505, 606, 707, 808, 909]
    kv.match_prefix("a", prompt)
    kv.try_allocate("a", len(prompt))
    kv.commit("a", prompt)
    _, _, events = log.since(0)
    assert "token_ids" not in events[0]
    assert not any(str(t) in json.dumps(events) for t in prompt)
    stored = event_from_json(events[0])
    assert len(stored.block_hashes) == 2 and stored.token_ids == ()


def test_worker_refuses_to_start_without_the_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    done = subprocess.run([sys.executable, "-m", "kthena_serve.pd.worker", "--role", "decode",
                           "--name", "decode-x"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and SECRET_ENV in done.stderr


# ---- one deployment ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    pd = PDCluster(EngineConfig(**PD_ENGINE), PDConfig(**PD), tokenizer=default_tokenizer()).start()
    try:
        yield pd
    finally:
        pd.stop()


def _generate_body(prefill_url: str | None) -> dict:
    return {"request_id": f"sec-{time.monotonic_ns()}", "prompt_ids": [1, 2, 3, 4, 5],
            "params": params_to_json(SamplingParams(temperature=0, max_tokens=2)),
            "cache_salt": None, "prefill_url": prefill_url}


def test_every_worker_route_but_health_needs_the_secret(cluster) -> None:  # noqa: ANN001
    decode, prefill = cluster.launcher.url("decode-0"), cluster.launcher.url("prefill-0")
    calls = [("GET", f"{decode}/pd/state", None), ("GET", f"{decode}/metrics", None),
             ("POST", f"{decode}/pd/generate", _generate_body(None)),
             ("GET", f"{prefill}/pd/state", None), ("GET", f"{prefill}/metrics", None),
             ("POST", f"{prefill}/pd/prefill", {"request_id": "x"}),
             ("POST", f"{prefill}/pd/cancel", {"request_id": "x"})]
    for headers in ({}, {"Authorization": "Bearer wrong"},
                    {"Authorization": f"Basic {cluster.launcher.secret}"}):
        for method, url, body in calls:
            reply = httpx.request(method, url, json=body, headers=headers, timeout=10)
            assert reply.status_code == 401, (method, url, headers, reply.text)
    for url in (decode, prefill):
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    ok = cluster.worker_headers
    for method, url, body in calls:
        if not url.endswith("/pd/generate"):  # generate: its own test below
            reply = httpx.request(method, url, json=body, headers=ok, timeout=10)
            expected = 400 if url.endswith("/pd/prefill") else 200  # a bad task, past auth
            assert reply.status_code == expected, (method, url, reply.text)
    assert httpx.post(f"{prefill}/pd/cancel", json={"request_id": "x"}, headers=ok,
                      timeout=10).json() == {"busy": False}


def test_generate_with_the_secret_runs_and_a_foreign_prefill_url_is_refused(cluster) -> None:  # noqa: ANN001
    decode = cluster.launcher.url("decode-0")
    ok = cluster.worker_headers
    with httpx.stream("POST", f"{decode}/pd/generate", json=_generate_body(None), headers=ok,
                      timeout=60) as reply:
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    assert reply.status_code == 200 and lines[-1]["output"]["finish_reason"] is not None
    for url in ("http://169.254.169.254:80", "http://attacker.example:8001",
                "https://127.0.0.1:1", f"{cluster.launcher.url('prefill-0')}/elsewhere"):
        reply = httpx.post(f"{decode}/pd/generate", json=_generate_body(url), headers=ok,
                           timeout=10)
        assert reply.status_code == 400, (url, reply.text)
        assert "prefill_url" in reply.json()["error"]["message"]


def _finished(metrics: str) -> float:
    return metric_value(metrics, "vllm:request_success_total{")


def test_openai_requests_through_the_router_still_work(cluster) -> None:  # noqa: ANN001
    ids = default_tokenizer().encode("Router path. " + SECRET_TEXT * 4)[:64]
    before = _finished(cluster.worker_metrics("decode-0"))
    reply = cluster.complete(ids, max_tokens=4)
    assert reply.status_code == 200, reply.text
    decode = cluster.worker_metrics("decode-0")
    assert 'path="disaggregated"' in decode  # the decode worker called the prefill worker
    assert _finished(decode) == before + 1  # /pd/generate: observed once on the worker too
    body = {"model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    chat = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=60)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]


def test_worker_state_has_no_prompt_tokens_or_text(cluster) -> None:  # noqa: ANN001
    ids = default_tokenizer().encode(SECRET_TEXT * 5)[:80]
    assert cluster.complete(ids, max_tokens=2).status_code == 200
    deadline = time.monotonic() + 10  # the router still learns the blocks, from hashes only
    while cluster.router.index.match(ids)["decode-0"] < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.router.index.match(ids)["decode-0"] >= 4
    for name in ("decode-0", "prefill-0"):
        text = httpx.get(f"{cluster.launcher.url(name)}/pd/state", params={"since": 0},
                         headers=cluster.worker_headers, timeout=10).text
        assert "token_ids" not in text and "Zanzibar" not in text and "quokka" not in text
        compact = text.replace(" ", "")
        for start in range(0, len(ids) - 4, 4):  # no run of 4 prompt ids, in any JSON spacing
            assert ",".join(map(str, ids[start:start + 4])) not in compact
    events = httpx.get(f"{cluster.launcher.url('decode-0')}/pd/state", params={"since": 0},
                       headers=cluster.worker_headers, timeout=10).json()["events"]
    assert any(e["type"] == "stored" and e["block_hashes"] for e in events)


def test_the_secret_is_on_no_worker_command_line(cluster) -> None:  # noqa: ANN001
    secret = cluster.launcher.secret
    assert len(secret) >= 32
    for name in cluster.launcher.workers:
        cmdline = Path(f"/proc/{cluster.launcher.pid(name)}/cmdline").read_bytes()
        assert b"kthena_serve.pd.worker" in cmdline and secret.encode() not in cmdline


def test_signed_requests_prove_the_secret_without_sending_it():
    from kthena_serve.server.middleware import sign_request, verify_request

    body = b'{"transfer_id": "t"}'
    headers = sign_request("s3cret", "POST", "/pd/kv/lease", body, now=1000.0)
    assert "s3cret" not in json.dumps(headers)
    assert verify_request("s3cret", "POST", "/pd/kv/lease", headers, body, now=1030.0)
    assert not verify_request("other", "POST", "/pd/kv/lease", headers, body, now=1030.0)
    assert not verify_request("s3cret", "POST", "/pd/kv/release", headers, body, now=1030.0)
    assert not verify_request("s3cret", "POST", "/pd/kv/lease", headers, body + b" ", now=1030.0)
    assert not verify_request("s3cret", "POST", "/pd/kv/lease", headers, body, now=1061.0)
    assert not verify_request("s3cret", "POST", "/pd/kv/lease",
                              {**headers, "x-kthena-time": "nan"}, body, now=1030.0)
    assert not verify_request("s3cret", "POST", "/pd/kv/lease", {}, body)


def test_only_the_decode_to_prefill_paths_take_a_signature():
    from kthena_serve.cluster.auth import DECODE_TO_PREFILL_PATHS, signed_json
    from kthena_serve.server import BackgroundServer

    app = FastAPI()
    app.post("/pd/kv/lease")(lambda: {"ok": True})
    app.post("/pd/generate")(lambda: {"ok": True})
    app.add_middleware(ApiKeyMiddleware, api_key="s3cret", signed_paths=DECODE_TO_PREFILL_PATHS)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        body, headers = signed_json("s3cret", "/pd/kv/lease", {"transfer_id": "t"})
        assert http.post("/pd/kv/lease", content=body, headers=headers).status_code == 200
        body, headers = signed_json("wrong", "/pd/kv/lease", {"transfer_id": "t"})
        assert http.post("/pd/kv/lease", content=body, headers=headers).status_code == 401
        body, headers = signed_json("s3cret", "/pd/generate", {})
        assert http.post("/pd/generate", content=body, headers=headers).status_code == 401
        bearer = {"Authorization": "Bearer s3cret"}
        assert http.post("/pd/generate", headers=bearer).status_code == 200
