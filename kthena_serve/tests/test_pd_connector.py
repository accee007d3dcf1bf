"""PD workers behind the Kthena router: its ``nixl`` / ``mooncake`` connector protocol.

Real prefill and decode worker processes get exactly the request sequence the router's
connector sends (``_kthena_proxy`` beside this file, built from connectors/nixl.go and
transport.go): the prefill body (no stream, max_tokens 1, kv_transfer_params
do_remote_decode), then the original body plus the prefill answer's kv_transfer_params on the
decode worker, which pulls the KV with a one-sided get. Same host over shm here (one
deployment serves these tests, its workers run with --public-metrics as the rendered pods do),
Mooncake between two network namespaces at the end (skipped, with the reason, where
namespaces cannot be made). The reference is a colocated engine.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from _kthena_proxy import decode_body, prefill_body, proxy
from _netns import run_in_first_host, two_host_network
from _support import eventually, metric_value
from _tiny import PD_ENGINE, default_tokenizer, greedy_text
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from prometheus_client.parser import text_string_to_metric_families

from kthena_serve.cluster.auth import auth_headers
from kthena_serve.engine.config import EngineConfig
from kthena_serve.model.source import DEFAULT_MODEL_NAME
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.launcher import PDLauncher

PD = {"kv_pin_timeout_s": 8.0, "transfer_timeout_s": 30}
API_KEY = "kthena-router-key"
KEY = {"Authorization": f"Bearer {API_KEY}"}
TEXT = ("The Kthena router sends the prompt to a prefill pod first, then the same request to a "
        "decode pod, which pulls the prompt's key and value blocks and streams the answer. ")
KV_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
             "remote_block_ids", "remote_host", "remote_port", "tp_size"}
# What kthena-router reads from each pod's /metrics (data/kthena/metrics.go).
ROUTER_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc")
ROUTER_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds")


def prompt_ids(num_tokens: int, salt: str = "") -> list[int]:
    return default_tokenizer().encode(salt + TEXT * (num_tokens // 25 + 2))[:num_tokens]


def shm_files(pids: list[int]) -> list[str]:
    """/dev/shm entries of these processes: KV pools (mooncake_kv.PID.*) and kthena_comm shm
    segments and inboxes (kthena-PID-*)."""
    return [name for name in os.listdir("/dev/shm") for pid in pids
            if name.startswith((f"mooncake_kv.{pid}.", f"kthena-{pid}-"))]


@pytest.fixture(scope="module")
def workers():
    launcher = PDLauncher(EngineConfig(**PD_ENGINE), PDConfig(**PD), 1, 1, quiet=True, api_key=API_KEY,
                          public_metrics=True).start()
    pids = [launcher.pid(name) for name in launcher.workers]
    try:
        yield launcher
    finally:
        launcher.stop()
    assert not shm_files(pids)


# (pd_connector_netns_helper.py, run in a network namespace, imports state, metric, held and
# shm_files from here)
def state(launcher: PDLauncher, name: str) -> dict:
    return httpx.get(f"{launcher.url(name)}/pd/state", params={"since": 1 << 62},
                     headers=auth_headers(launcher.secret), timeout=10).json()


def metric(launcher: PDLauncher, name: str, series: str) -> float:
    """``_support.metric_value`` of worker ``name``'s /metrics."""
    text = httpx.get(f"{launcher.url(name)}/metrics", headers=auth_headers(launcher.secret),
                     timeout=10).text
    return metric_value(text, series)


def urls(launcher: PDLauncher) -> tuple[str, str]:
    return launcher.url("prefill-0"), launcher.url("decode-0")


def _held_now(launcher: PDLauncher) -> tuple[int, int, int, int]:
    prefill, decode = state(launcher, "prefill-0"), state(launcher, "decode-0")
    return (prefill["kv"]["num_used_blocks"], prefill["num_pinned"],
            decode["kv"]["num_used_blocks"], decode["num_quarantined"])


def held(launcher: PDLauncher) -> tuple[int, int, int, int]:
    """(prefill used blocks, pins; decode used blocks, quarantined), once all are 0 or after
    10 s (a release is a message to the compute thread)."""
    eventually(lambda: not any(_held_now(launcher)), 10, interval_s=0.1)
    return _held_now(launcher)


def assert_nothing_held(launcher: PDLauncher) -> None:
    """No block used on either worker, no pin left on the prefill worker."""
    found = held(launcher)
    assert found == (0, 0, 0, 0), found


def sse_text(response: httpx.Response) -> tuple[str, dict | None]:
    text, usage = "", None
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    assert response.text.rstrip().endswith("data: [DONE]")
    return text, usage


# ---- without processes --------------------------------------------------------------------------
def test_bodies_are_the_routers() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 9,
            "stream_options": {"include_usage": False}, "max_completion_tokens": None}
    sent = prefill_body(body)
    assert sent == {"model": "m", "prompt": "x", "max_tokens": 1,
                    "max_completion_tokens": None,  # set to 1 only when present (not null)
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    params = {"do_remote_prefill": True, "remote_block_ids": [1]}
    streamed = decode_body(body, params)
    assert streamed["stream_options"] == {"include_usage": True} and "include_usage" not in streamed
    assert streamed["kv_transfer_params"] == params and streamed["max_tokens"] == 9
    plain = decode_body({"model": "m", "prompt": "x"}, None)
    assert plain["include_usage"] is True and plain["kv_transfer_params"] is None


def test_kv_params_parse_and_refuse_by_name() -> None:
    from kthena_serve.engine.errors import InvalidRequestError
    from kthena_serve.pd.kv_params import KVAsk, parse_kv_params, prefill_reply

    assert parse_kv_params({"do_remote_decode": True, "do_remote_prefill": False}) == (
        KVAsk.REMOTE_DECODE, None)
    assert parse_kv_params({}) == (KVAsk.NONE, None)
    reply = prefill_reply("p-1", "t", [3, 4], "::1", 8000)
    ask, remote = parse_kv_params(reply)
    assert ask is KVAsk.REMOTE_PREFILL and remote.block_ids == (3, 4) and remote.tp_size == 1
    assert parse_kv_params({**reply, "tp_size": 2})[1].tp_size == 2  # a TP2 prefill worker's
    assert parse_kv_params({k: v for k, v in reply.items() if k != "tp_size"})[1].tp_size is None
    assert remote.url == "http://[::1]:8000"
    assert parse_kv_params({**reply, "remote_block_ids": ["3", "4"]})[1] == remote  # types.go
    for bad, why in (({**reply, "remote_port": 0}, "remote_port"),
                     ({**reply, "remote_port": True}, "remote_port"),
                     ({**reply, "remote_block_ids": []}, "remote_block_ids"),
                     ({**reply, "remote_block_ids": [1.5]}, "block ids are ints"),
                     ({**reply, "remote_engine_id": ""}, "remote_engine_id"),
                     ({**reply, "tp_size": 0}, "a TP size is an int in 1..1024"),
                     ({**reply, "tp_size": True}, "tp_size=True"),
                     ({**reply, "tp_size": "2"}, "tp_size='2'"),
                     ({**reply, "extra": 1}, "unknown field"),
                     ({"do_remote_decode": "yes"}, "true or false"),
                     ({"do_remote_decode": True, "remote_host": "h"}, "belong to a decode")):
        with pytest.raises(InvalidRequestError, match=why) as caught:
            parse_kv_params(bad)
        assert caught.value.param == "kv_transfer_params"


def test_prefill_hosts_may_be_networks() -> None:
    from kthena_serve.cluster.auth import check_prefill_url

    check_prefill_url("http://10.42.7.9:8000", {"127.0.0.1", "10.42.0.0/16"})
    for url in ("http://10.43.0.1:8000", "http://pods.example:8000"):
        with pytest.raises(ValueError, match="not a prefill worker host"):
            check_prefill_url(url, {"127.0.0.1", "10.42.0.0/16"})


def test_pins_golden_sequence() -> None:
    from kthena_serve.pd.pins import PinError, PinTable

    now, freed = [0.0], []
    table = PinTable(10.0, 2.0, lambda pin: freed.append(pin.request_id), clock=lambda: now[0])
    a = table.add("a", (1, 2), "da", 7)
    b = table.add("b", (3,), "db", 8)
    with pytest.raises(PinError, match="remote_block_ids") as caught:
        table.lease(a.transfer_id, (1, 9), "da")
    assert caught.value.status == 409
    with pytest.raises(PinError, match="prompt"):
        table.lease(a.transfer_id, (1, 2), "other")
    now[0] = 9.0
    assert table.lease(a.transfer_id, [1, 2], "da").deadline == 11.0  # lease_s from now
    now[0] = 10.5  # b is past its deadline, a (leased) is not
    assert table.expire() == 1 and freed == ["b"]
    with pytest.raises(PinError, match="remote_request_id") as caught:
        table.lease(b.transfer_id, (3,), "db")
    assert caught.value.status == 404
    assert table.release(a.transfer_id) is True and freed == ["b", "a"]
    assert table.release(a.transfer_id) is False and len(table) == 0 and freed == ["b", "a"]
    c = table.add("c", (5,), "dc", 9)
    now[0] = 30.0
    assert table.release(c.transfer_id) is False  # expired but not swept: stale bytes
    assert freed == ["b", "a", "c"] and table.num_expired == 1


class PinMachine(RuleBasedStateMachine):
    """PinTable against a model: each pin is freed exactly once, and only once it is gone."""

    def __init__(self) -> None:
        super().__init__()
        from kthena_serve.pd.pins import PinTable

        self.now = 0.0
        self.freed: list[str] = []
        self.table = PinTable(5.0, 1.0, lambda pin: self.freed.append(pin.request_id),
                              clock=lambda: self.now)
        self.live: dict[str, tuple[str, tuple[int, ...], float]] = {}  # tid -> rid, ids, end
        self.count = 0

    @rule(num_blocks=st.integers(1, 4))
    def add(self, num_blocks: int) -> None:
        self.count += 1
        rid = f"r{self.count}"
        ids = tuple(range(self.count * 10, self.count * 10 + num_blocks))
        pin = self.table.add(rid, ids, rid, 0)
        self.live[pin.transfer_id] = (rid, ids, self.now + 5.0)

    @rule(data=st.data(), honest=st.booleans())
    def lease(self, data, honest: bool) -> None:  # noqa: ANN001
        from kthena_serve.pd.pins import PinError

        if not self.live:
            return
        tid = data.draw(st.sampled_from(list(self.live)))  # insertion order: ids are random
        rid, ids, end = self.live[tid]
        claim = ids if honest else (*ids, 999)
        if end <= self.now or not honest:
            with pytest.raises(PinError):
                self.table.lease(tid, claim, rid)
        else:
            self.table.lease(tid, claim, rid)
            self.live[tid] = (rid, ids, max(end, self.now + 1.0))

    @rule(data=st.data())
    def release(self, data) -> None:  # noqa: ANN001
        if not self.live:
            return
        tid = data.draw(st.sampled_from(list(self.live)))  # insertion order: ids are random
        _, _, end = self.live.pop(tid)
        assert self.table.release(tid) is (end > self.now)

    @rule(seconds=st.floats(0.0, 3.0))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def expire(self) -> None:
        gone = [t for t, (_, _, end) in self.live.items() if end <= self.now]
        assert self.table.expire() == len(gone)
        for tid in gone:
            del self.live[tid]

    @invariant()
    def each_pin_freed_once_and_only_when_gone(self) -> None:
        assert len(self.freed) == len(set(self.freed)) == self.count - len(self.live)
        assert len(self.table) == len(self.live)
        assert self.table.num_blocks == sum(len(ids) for _, ids, _ in self.live.values())


TestPinMachine = PinMachine.TestCase


def test_a_server_without_a_connector_refuses_kv_transfer_params() -> None:
    from _tiny import tiny_engine

    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.server import BackgroundServer, build_app

    engine = AsyncLLM(tiny_engine()).start()
    try:
        with BackgroundServer(build_app(engine, model_name="tiny")) as server:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
            routed = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                json=decode_body(body, {"do_remote_prefill": True}))
            assert routed.status_code == 400, routed.text
            assert routed.json()["error"]["param"] == "kv_transfer_params"
            plain = httpx.post(f"{server.url}/v1/completions", json=decode_body(body, None),
                               timeout=60)  # null params and top-level include_usage: fine
            assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 2
            streamed = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                  json={**body, "stream": True, "include_usage": True})
            assert '"usage"' in streamed.text.split("data: [DONE]")[0].rsplit("data: ", 1)[1]
    finally:
        engine.shutdown()


# ---- the router's request sequence ----------------------------------------------------------
def test_router_sequence_matches_colocated_greedy_output(workers, colocated) -> None:  # noqa: ANN001
    prefill_url, decode_url = urls(workers)
    pulled_before = metric(workers, "decode-0", 'kthena_pd_requests_total{path="pulled"')
    with httpx.Client(timeout=120, headers=KEY) as client:
        for n, stream in ((40, False), (97, True)):
            ids = prompt_ids(n, f"case {n}. ")
            body = {"model": "default", "prompt": ids, "max_tokens": 12, "temperature": 0,
                    "stream": stream}
            exchange = proxy(client, "/v1/completions", body, prefill_url, decode_url)
            assert exchange.prefill.status_code == 200, exchange.prefill.text
            prefill = exchange.prefill.json()
            params = prefill["kv_transfer_params"]
            assert set(params) == KV_FIELDS, params
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert len(params["remote_block_ids"]) == -(-n // 16)
            assert params["remote_port"] == int(prefill_url.rsplit(":", 1)[1])
            assert prefill["usage"]["completion_tokens"] == 1
            assert exchange.decode.status_code == 200, exchange.decode.text
            expected = greedy_text(colocated, ids, 12)
            if stream:
                text, usage = sse_text(exchange.decode)
                assert usage is not None and usage["completion_tokens"] == 12  # include_usage
            else:
                text = exchange.decode.json()["choices"][0]["text"]
            assert text == expected
            assert text.startswith(prefill["choices"][0]["text"])
    pulled = metric(workers, "decode-0", 'kthena_pd_requests_total{path="pulled"')
    assert pulled - pulled_before == 2  # both pulled their KV, none recomputed
    assert metric(workers, "decode-0", 'kthena_pd_transferred_bytes_total{role="decode"}') > 0
    assert_nothing_held(workers)


def test_chat_with_max_completion_tokens(workers, colocated) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Explain in one sentence why " + TEXT}]
    body = {"model": "default", "messages": messages, "max_completion_tokens": 10,
            "temperature": 0}
    sent = prefill_body(body)
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
    with httpx.Client(timeout=120, headers=KEY) as client:
        exchange = proxy(client, "/v1/chat/completions", body, *urls(workers))
    assert exchange.decode is not None and exchange.decode.status_code == 200, exchange
    ids = colocated.processor.encode_chat(messages)
    answer = exchange.decode.json()["choices"][0]["message"]["content"]
    assert answer == greedy_text(colocated, ids, 10)
    assert_nothing_held(workers)


def test_decode_skips_the_blocks_it_already_caches(workers, colocated) -> None:  # noqa: ANN001
    base = prompt_ids(96, "shared prefix. ")
    series = 'kthena_pd_transferred_bytes_total{role="decode"}'
    with httpx.Client(timeout=120, headers=KEY) as client:
        moved = []
        for tail in ("tail one ", "tail two "):
            ids = base + prompt_ids(30, tail)
            before = metric(workers, "decode-0", series)
            body = {"model": "default", "prompt": ids, "max_tokens": 6, "temperature": 0}
            exchange = proxy(client, "/v1/completions", body, *urls(workers))
            assert exchange.decode.status_code == 200, exchange.decode.text
            reply = exchange.decode.json()
            assert reply["choices"][0]["text"] == greedy_text(colocated, ids, 6)
            moved.append(metric(workers, "decode-0", series) - before)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80  # decode-side hit
    assert 0 < moved[1] <= moved[0] / 3  # only the tail crossed: 2 of 8 blocks
    assert_nothing_held(workers)


def test_prefill_timeout_frees_blocks_when_no_decode_comes(workers) -> None:  # noqa: ANN001
    prefill_url, decode_url = urls(workers)
    body = {"model": "default", "prompt": prompt_ids(64, "abandoned. "), "max_tokens": 5,
            "temperature": 0}
    with httpx.Client(timeout=120, headers=KEY) as client:
        answer = client.post(f"{prefill_url}/v1/completions", json=prefill_body(body))
        assert answer.status_code == 200, answer.text
        pinned = state(workers, "prefill-0")
        assert pinned["num_pinned"] == 1 and pinned["kv"]["num_used_blocks"] == 4
        expired_before = pinned["num_pins_expired"]
        eventually(lambda: not state(workers, "prefill-0")["num_pinned"],
                   PD["kv_pin_timeout_s"] + 30, interval_s=0.25)
        after = state(workers, "prefill-0")
        assert after["num_pinned"] == 0 and after["num_pins_expired"] == expired_before + 1
        late = client.post(f"{decode_url}/v1/completions",
                           json=decode_body(body, answer.json()["kv_transfer_params"]))
    assert late.status_code == 400, late.text
    assert "remote_request_id" in late.json()["error"]["message"]
    assert_nothing_held(workers)


# ---- what the workers refuse ----------------------------------------------------------------
def test_forged_kv_transfer_params_get_a_clear_400(workers) -> None:  # noqa: ANN001
    prefill_url, decode_url = urls(workers)
    ids = prompt_ids(50, "forgery. ")
    body = {"model": "default", "prompt": ids, "max_tokens": 4, "temperature": 0}
    series = 'kthena_pd_transferred_bytes_total{role="decode"}'
    with httpx.Client(timeout=120, headers=KEY) as client:
        real = client.post(f"{prefill_url}/v1/completions", json=prefill_body(body)).json()
        params = real["kv_transfer_params"]
        moved = metric(workers, "decode-0", series)
        other = max(params["remote_block_ids"]) + 1
        forged = {
            "remote_engine_id": {**params, "remote_engine_id": "prefill-0-1-1"},
            "remote_block_ids are not the blocks pinned": {
                **params, "remote_block_ids": [*params["remote_block_ids"][:-1], other]},
            "remote_request_id": {**params, "remote_request_id": "not-a-transfer"},
            "not a prefill worker host": {**params, "remote_host": "169.254.169.254"},
            "remote_port": {**params, "remote_port": "80"},
            "block ids are ints": {**params, "remote_block_ids": [-1, 2, 3, 4]},
            "unknown field": {**params, "remote_addr": "0x7f00"},
            "cannot both be true": {**params, "do_remote_decode": True},
            "this is a decode worker": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        for why, bad in forged.items():
            reply = client.post(f"{decode_url}/v1/completions", json=decode_body(body, bad))
            assert reply.status_code == 400, (why, reply.text)
            error = reply.json()["error"]
            assert why in error["message"] and error["param"] == "kv_transfer_params", error
        other_prompt = {**body, "prompt": prompt_ids(50, "another prompt. ")}
        reply = client.post(f"{decode_url}/v1/completions", json=decode_body(other_prompt,
                                                                             params))
        assert reply.status_code == 400 and "prompt" in reply.json()["error"]["message"]
        assert metric(workers, "decode-0", series) == moved  # nothing was read
        # each refusal came after admission and gave its queue place back at once
        assert metric(workers, "decode-0", "kthena_admission_queued_requests") == 0
        # the genuine decode request still finds its blocks pinned
        genuine = client.post(f"{decode_url}/v1/completions", json=decode_body(body, params))
        assert genuine.status_code == 200, genuine.text
        assert metric(workers, "decode-0", series) > moved
    assert_nothing_held(workers)


def test_a_decode_worker_never_sends_the_secret_to_the_host_a_request_names(workers) -> None:  # noqa: ANN001
    """kv_transfer_params name the prefill host; a wrong (here: listening) host gets a signed
    lease request, never the deployment secret."""
    import http.server
    import threading

    seen: list[tuple[dict, bytes]] = []

    class Capture(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(403)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

    capture = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=capture.serve_forever, daemon=True).start()
    try:
        prefill_url, decode_url = urls(workers)
        body = {"model": "default", "prompt": prompt_ids(40, "capture. "), "max_tokens": 4,
                "temperature": 0}
        with httpx.Client(timeout=120, headers=KEY) as client:
            params = client.post(f"{prefill_url}/v1/completions",
                                 json=prefill_body(body)).json()["kv_transfer_params"]
            wrong = {**params, "remote_host": "127.0.0.1", "remote_port": capture.server_port}
            client.post(f"{decode_url}/v1/completions", json=decode_body(body, wrong))
            client.post(f"{decode_url}/v1/completions", json=decode_body(body, params))
    finally:
        capture.shutdown()
        capture.server_close()
    assert seen, "the decode worker contacted no one"
    secret = workers.secret
    for headers, payload in seen:
        assert "authorization" not in headers
        assert secret not in json.dumps(headers) and secret.encode() not in payload
        assert headers.get("x-kthena-signature") and headers.get("x-kthena-time")
    assert_nothing_held(workers)


def test_each_role_refuses_the_other_roles_ask(workers) -> None:  # noqa: ANN001
    prefill_url, decode_url = urls(workers)
    body = {"model": "default", "prompt": prompt_ids(20, "roles. "), "max_tokens": 4}
    with httpx.Client(timeout=60, headers=KEY) as client:
        streamed = {**prefill_body(body), "stream": True}
        reply = client.post(f"{prefill_url}/v1/completions", json=streamed)
        assert reply.status_code == 400 and "stream" in reply.text
        sized = prefill_body(body)
        sized["kv_transfer_params"]["tp_size"] = 2  # this prefill worker is a TP1 engine
        reply = client.post(f"{prefill_url}/v1/completions", json=sized)
        assert reply.status_code == 400 and "is a TP1 engine" in reply.text, reply.text
        plain = client.post(f"{prefill_url}/v1/completions", json=body)  # max_tokens 4
        assert plain.status_code == 400 and "max_tokens 1" in plain.json()["error"]["message"]
        ask = decode_body(body, {"do_remote_prefill": True, "remote_engine_id": "x",
                                 "remote_request_id": "y", "remote_block_ids": [0, 1],
                                 "remote_host": "127.0.0.1", "remote_port": 1})
        reply = client.post(f"{prefill_url}/v1/completions", json=ask)
        assert reply.status_code == 400 and "decode worker" in reply.text
        one = client.post(f"{prefill_url}/v1/completions", json={**body, "max_tokens": 1})
        assert one.status_code == 200 and "kv_transfer_params" not in one.json()
    assert_nothing_held(workers)


def test_api_key_on_openai_routes_secret_on_control_routes(workers) -> None:  # noqa: ANN001
    prefill_url, decode_url = urls(workers)
    body = {"model": "default", "prompt": "Hi", "max_tokens": 1}
    for url in (prefill_url, decode_url):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        wrong = {"Authorization": f"Bearer {workers.secret}"}  # the PD secret is not the key
        assert httpx.post(f"{url}/v1/completions", json=body, headers=wrong,
                          timeout=60).status_code == 401
        assert httpx.post(f"{url}/v1/completions", json=body, headers=KEY,
                          timeout=60).status_code == 200
        # the API key opens no control route; /metrics is open (--public-metrics)
        assert httpx.get(f"{url}/pd/state", headers=KEY, timeout=10).status_code == 401
        assert httpx.get(f"{url}/pd/state", timeout=10).status_code == 401
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    lease = {"engine_id": "x", "transfer_id": "y", "block_ids": [0], "prompt_digest": "z",
             "backend": "shm"}
    for path in ("/pd/kv/lease", "/pd/kv/release"):
        assert httpx.post(f"{prefill_url}{path}", json=lease, headers=KEY,
                          timeout=10).status_code == 401
    assert_nothing_held(workers)


def scrape(url: str) -> tuple[dict, dict[str, float]]:
    """(families by name, {sample name: sum over its series}) of /metrics, fetched without any
    credentials as kthena-router does; each family must appear exactly once."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    types = [line.split()[2] for line in response.text.splitlines()
             if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
    families = list(text_string_to_metric_families(response.text))
    assert len({f.name for f in families}) == len(families)
    totals: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return {f.name: f for f in families}, totals


def test_public_metrics_carry_the_routers_vllm_names_once(workers) -> None:  # noqa: ANN001
    """The OpenAI app and the control app of a worker share one ServerMetrics: vLLM's names
    with the served model name, the kthena_* twins and kthena_pd_*, each family once, and a
    request through the router's sequence observed once on each worker."""
    prefill_url, decode_url = urls(workers)
    before = {url: scrape(url)[1] for url in (prefill_url, decode_url)}
    body = {"model": "default", "prompt": prompt_ids(50, "metrics. "), "max_tokens": 6,
            "temperature": 0}
    with httpx.Client(timeout=120, headers=KEY) as client:
        exchange = proxy(client, "/v1/completions", body, prefill_url, decode_url)
    assert exchange.decode is not None and exchange.decode.status_code == 200
    for url, role in ((prefill_url, "prefill"), (decode_url, "decode")):
        families, after = scrape(url)
        for name in ROUTER_GAUGES:
            assert families[name].type == "gauge", (role, name)
        for name in ROUTER_HISTOGRAMS:
            assert families[name].type == "histogram", (role, name)
        for name in (*ROUTER_GAUGES, *ROUTER_HISTOGRAMS):
            assert {s.labels["model_name"] for s in families[name].samples} == {
                DEFAULT_MODEL_NAME}, (role, name)
        assert "kthena_pd_handoff_seconds" in families and "kthena_requests" in families
        grew = {name: after.get(name, 0.0) - before[url].get(name, 0.0) for name in (
            "vllm:request_success_total", "kthena_requests_total",
            "vllm:time_to_first_token_seconds_count", "kthena_time_to_first_token_seconds_count")}
        assert grew == dict.fromkeys(grew, 1.0), (role, grew)  # observed once, not twice
    _, decode = scrape(decode_url)
    assert decode["vllm:inter_token_latency_seconds_count"] >= 5  # 6 tokens: 5 gaps
    assert_nothing_held(workers)


# ---- Mooncake between two hosts (network namespaces) ------------------------------------------
@pytest.fixture
def two_hosts():
    pytest.importorskip("mooncake.engine", reason="the mooncake wheel (and libibverbs1) is "
                        "missing")
    with two_host_network("kc", 214) as hosts:
        yield hosts


def test_mooncake_pull_between_two_network_namespaces(two_hosts, colocated) -> None:  # noqa: ANN001
    prompts = [prompt_ids(70, "namespaces one. "), prompt_ids(110, "namespaces two. ")]
    result = run_in_first_host(two_hosts, "pd_connector_netns_helper.py", prompts, 300)
    assert result["texts"] == [greedy_text(colocated, ids, 8) for ids in prompts]
    addr_b = two_hosts[3]
    assert all(p["remote_host"] == addr_b for p in result["params"])  # the other host
    assert result["pulled_bytes"] > 0 and result["pulled"] == len(prompts)
    assert result["held"] == [0, 0, 0, 0]  # prefill used, pinned; decode used, quarantined
    assert result["foreign_host"] == 400
    assert result["shm_left"] == []
