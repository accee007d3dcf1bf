"""Overload control through the HTTP apps: a burst past the queue bound gets 503 +
``Retry-After`` (an OpenAI error body, code ``overloaded``) before anything is generated, counted
in the metrics, while the admitted request completes; the DP router passes a replica's refusal
on (or answers 503 itself when every replica reports a full queue); the PD router bounds its own
queue and passes a decode worker's refusal on.

Each test holds the engine (or a fake worker) so the first request stays queued while the burst
arrives: the refusals follow from the counts, not from timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _support import metric_value, wait_until
from _tiny import default_tokenizer, tiny_engine
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.request import FinishReason, RequestOutput
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.protocol import output_to_json
from kthena_serve.server import BackgroundServer, build_app
from kthena_serve.server.errors import error_body

MODEL = "tiny"
PROMPT = "The capital of France is a city of light and"
BURST = 6


def assert_overloaded(reply: httpx.Response, flag: str | None = "--max-queued-tokens") -> None:
    assert reply.status_code == 503, reply.text
    assert int(reply.headers["retry-after"]) >= 1
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "overloaded" and error["type"] == "service_unavailable"
    assert error["param"] is None
    if flag is not None:
        assert flag in error["message"]


def read_stream(reply: httpx.Response) -> str:
    """The text of an SSE answer, which must end with [DONE] and carry no error event."""
    text, done = "", False
    for line in reply.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0].get("text") or ""
    assert done
    return text


def stream_later(pool: ThreadPoolExecutor, http: httpx.Client, body: dict):  # noqa: ANN201
    """Stream a completion on ``pool``: a future of (status, text). Its headers come with its
    first output, so a test holding that output back cannot wait for them inline."""
    def run() -> tuple[int, str]:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
            return reply.status_code, read_stream(reply) if reply.status_code == 200 else ""

    return pool.submit(run)


# ---- colocated: AsyncLLM's gate behind the OpenAI app ------------------------------------------
@pytest.fixture
def held():
    """A tiny engine whose steps wait for ``release`` (the first request stays queued), served
    with a queue bound of one prompt's tokens."""
    num_tokens = len(default_tokenizer().encode(PROMPT))
    core = tiny_engine(num_kv_blocks=256, max_queued_tokens=num_tokens, max_queue_delay_s=0)
    release = threading.Event()
    step = core.step

    def held_step():  # noqa: ANN202
        release.wait(60)
        return step()

    core.step = held_step
    engine = AsyncLLM(core).start()
    try:
        with BackgroundServer(build_app(engine, model_name=MODEL)) as server:
            yield server.url, engine, release
            release.set()
    finally:
        release.set()
        engine.shutdown()


def test_a_burst_past_the_bound_gets_503_while_the_admitted_request_completes(held) -> None:
    url, engine, release = held
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(BURST + 1) as pool:
        first = stream_later(pool, http, body)
        wait_until(lambda: engine.stats().queue.num_requests == 1, 60, "the first to queue")
        queued = engine.stats().queue.num_tokens
        burst = [{**body, "stream": i % 2 == 0} for i in range(BURST)]
        burst.append({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                      "max_tokens": 4})
        replies = list(pool.map(lambda b: http.post(
            "/v1/chat/completions" if "messages" in b else "/v1/completions", json=b),
            burst))
        for reply in replies:
            assert_overloaded(reply)
        text = http.get("/metrics").text
        release.set()
        status, streamed = first.result(timeout=60)
        assert status == 200 and streamed  # admitted (the queue was empty), ran to the end
        num = len(burst)
        assert metric_value(text, "kthena_requests_rejected_total", reason="overload",
                            limit="queued_tokens") == num
        assert metric_value(text, "vllm:admission_rejections_total", model_name=MODEL,
                            reason="max_num_queued_tokens") == num
        assert metric_value(text, "kthena_admission_queued_requests") == 1
        assert metric_value(text, "kthena_admission_queued_prompt_tokens") == queued
        wait_until(lambda: engine.stats().queue.num_requests == 0, 60, "the queue to empty")
        again = http.post("/v1/completions", json=body)  # the queue drained: admitted again
        assert again.status_code == 200 and again.json()["choices"][0]["text"]
        text = http.get("/metrics").text
        assert metric_value(text, "kthena_admission_prefill_tokens_per_second") > 0
        # the two admitted requests' first tokens against the waits they were admitted with
        assert metric_value(text, "kthena_admission_estimate_to_wait_samples") == 2
        assert metric_value(text, "kthena_admission_estimate_to_wait_ratio", quantile="0.5") > 0


def _slow_steps(core, seconds: float) -> None:  # noqa: ANN001
    step = core.step

    def slow_step():  # noqa: ANN202
        threading.Event().wait(seconds)
        return step()

    core.step = slow_step


def test_an_admitted_request_that_cannot_start_in_time_is_refused_before_its_headers() -> None:
    """One seat, taken by a long stream: the next requests are admitted (the queue is empty)
    and wait for the seat; at their deadline (the bound less their own compute) they are
    refused with 503 ``queue_timeout`` and ``Retry-After``, streamed or not, never a 200
    stream with an error in it; their blocks and the engine's requests are all given back."""
    core = tiny_engine(num_kv_blocks=256, max_num_seqs=1, max_queue_delay_s=1.0)
    _slow_steps(core, 0.02)
    engine = AsyncLLM(core).start()
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    try:
        with BackgroundServer(build_app(engine, model_name=MODEL)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions",
                             json={**body, "max_tokens": 1000, "stream": True}) as first:
                assert first.status_code == 200  # its headers came with its first output
                lines = first.iter_lines()
                assert next(lines).startswith("data: ")
                replies = [http.post(path, json=b) for path, b in (
                    ("/v1/completions", {**body, "max_tokens": 4}),
                    ("/v1/completions", {**body, "max_tokens": 4, "stream": True}),
                    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "stream": True,
                                              "messages": [{"role": "user", "content": PROMPT}]}))]
                for reply in replies:
                    assert reply.status_code == 503, reply.text
                    assert int(reply.headers["retry-after"]) >= 1
                    error = reply.json()["error"]
                    assert error["code"] == "queue_timeout" and "--max-queue-delay" in error["message"]
                text = http.get("/metrics").text
            # the long stream was closed (aborted): everything goes back
            wait_until(lambda: not core.live_request_ids(), 60,
                       "the engine to drop every request")
            wait_until(lambda: core.kv.num_free_blocks == 256, 60, "every block back")
            assert engine.stats().queue.num_requests == 0
            assert metric_value(text, "kthena_requests_rejected_total", reason="overload",
                                limit="queue_timeout") == len(replies)
            again = http.post("/v1/completions", json={**body, "max_tokens": 4})
            assert again.status_code == 200 and again.json()["choices"][0]["text"]
    finally:
        engine.shutdown()


def test_a_lone_request_is_served_whatever_the_bound() -> None:
    """A deadline shorter than any step: a request alone starts at the next step, so it is
    never refused (only waiting behind others is)."""
    engine = AsyncLLM(tiny_engine(max_queue_delay_s=0.001)).start()
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 4}
    try:
        with BackgroundServer(build_app(engine, model_name=MODEL)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as http:
            for stream in (False, True, False):
                reply = http.post("/v1/completions", json={**body, "stream": stream})
                assert reply.status_code == 200, reply.text
    finally:
        engine.shutdown()


def test_an_invalid_request_is_400_before_admission(held) -> None:
    url, engine, _ = held
    with httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                   "max_tokens": 10**9})
        assert reply.status_code == 400
    assert engine.stats().queue.num_requests == 0


def test_a_request_refused_for_its_kv_transfer_params_leaves_no_place_in_the_queue() -> None:
    """kv_transfer_params sent to a server that computes every request itself is a 400, checked
    before admission: a queue place left behind counted as a late request for its 30 s claim
    timeout, and the climbing wait factor refused the good requests after it."""
    engine = AsyncLLM(tiny_engine(max_queue_delay_s=1.0)).start()
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 2}
    routed = {**body, "kv_transfer_params": {"do_remote_prefill": True}}
    try:
        with BackgroundServer(build_app(engine, model_name=MODEL)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as http:
            for stream in (False, True, False, True):
                reply = http.post("/v1/completions", json={**routed, "stream": stream})
                assert reply.status_code == 400 and reply.json()["error"]["param"] == (
                    "kv_transfer_params")
                chat = http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}})
                assert chat.status_code == 400
                assert engine.stats().queue.num_requests == 0
            assert metric_value(http.get("/metrics").text,
                                "kthena_admission_queued_requests") == 0
            for _ in range(3):  # the next requests are served, at once
                assert http.post("/v1/completions", json=body).status_code == 200
    finally:
        engine.shutdown()


def test_an_aborted_admitted_request_gives_its_place_back() -> None:
    """The app's give-back: a request admitted whose stream never started (refused after
    admission, or its client gone first) is aborted, which forgets its queue place."""
    engine = AsyncLLM(tiny_engine(max_queue_delay_s=1.0)).start()
    try:
        from kthena_serve.engine.request import EngineRequest
        from kthena_serve.engine.sampling_params import SamplingParams

        ids = tuple(default_tokenizer().encode(PROMPT))
        requests = [EngineRequest(f"r{i}", ids, SamplingParams(max_tokens=2), 2, None)
                    for i in range(3)]
        engine.check_admission(requests)
        assert engine.stats().queue.num_requests == 3
        for request in requests:
            engine.abort(request.request_id)
        assert engine.stats().queue.num_requests == 0
    finally:
        engine.shutdown()


# ---- DP: the router passes a replica's refusal on -----------------------------------------------
def _replica(name: str, refuse: bool) -> FastAPI:
    app = FastAPI()
    app.state.calls = 0

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        app.state.calls += 1
        if refuse:
            return JSONResponse(error_body(503, f"{name} is overloaded", code="overloaded"),
                                status_code=503, headers={"Retry-After": "7"})
        return JSONResponse({"object": "text_completion", "choices": [{"text": name}]})

    return app


def _dp_front(urls: list[str], limits=None):  # noqa: ANN001, ANN202
    from kthena_serve.cluster.router import Router
    from kthena_serve.dp.frontend import DPFrontend, build_dp_app
    from kthena_serve.dp.launcher import ROLE
    from kthena_serve.dp.serve import _routing_processor

    router = Router([(f"replica-{i}", ROLE, u) for i, u in enumerate(urls)], PDConfig(),
                    block_size=16)
    for worker in router.workers.values():
        worker.is_up = True
        router.index.add_instance(worker.name)
    front = DPFrontend(router, _routing_processor(EngineConfig()), secret="s", limits=limits)
    return router, build_dp_app(front)


def test_dp_router_passes_a_refusal_on_then_relays_the_last_one() -> None:
    from fastapi.testclient import TestClient

    busy, free = _replica("replica-0", refuse=True), _replica("replica-1", refuse=False)
    body = {"model": "default", "prompt": "Hello there"}
    with BackgroundServer(busy) as one, BackgroundServer(free) as two:
        router, app = _dp_front([one.url, two.url])
        router.workers["replica-1"].num_picked = 5  # ties go to the one picked least: replica-0
        with contextlib.closing(router), TestClient(app) as client:
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "replica-1"
            assert busy.state.calls == 1
            text = client.get("/metrics").text
            assert metric_value(text, "kthena_dp_passed_on_total", replica="replica-0") == 1
            assert all(w.num_in_flight == 0 for w in router.workers.values())
            router.mark_down("replica-1")  # only the refusing one is left: relayed as is
            reply = client.post("/v1/completions", json=body)
            assert_overloaded(reply, flag=None)
            assert reply.headers["retry-after"] == "7"
            assert reply.json()["error"]["message"] == "replica-0 is overloaded"


def test_dp_router_refuses_itself_when_every_replica_reports_a_full_queue() -> None:
    from fastapi.testclient import TestClient

    from kthena_serve.engine.admission import AdmissionLimits, QueueLoad

    replica = _replica("replica-0", refuse=False)
    with BackgroundServer(replica) as one, BackgroundServer(_replica("r1", False)) as two:
        router, app = _dp_front([one.url, two.url], AdmissionLimits(max_queue_delay_s=2.0))
        full = {"queue": QueueLoad(4, 5000, 1000.0).to_json()}  # 5 s queued: past 2 s
        router.workers["replica-0"].stats = full
        with contextlib.closing(router), TestClient(app) as client:
            router.workers["replica-1"].stats = {"queue": QueueLoad(0, 0, 1000.0).to_json()}
            reply = client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "r1"
            router.workers["replica-1"].stats = full
            reply = client.post("/v1/completions", json={"model": "default", "prompt": "Hi"})
            assert_overloaded(reply, flag="--max-queue-delay")
            assert reply.headers["retry-after"] == "4"  # ceil(5.0... - 2) with the new tokens
            assert replica.state.calls == 0
            text = client.get("/metrics").text
            assert metric_value(text, "kthena_dp_rejected_requests_total", reason="overload") == 1


# ---- PD: the router's own queue, and a decode worker's refusal -------------------------------------
def _decode_worker(refuse: bool, release: threading.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/pd/generate")
    async def generate(body: dict):  # noqa: ANN202
        if refuse:
            return JSONResponse(error_body(503, "decode worker overloaded", code="overloaded"),
                                status_code=503, headers={"Retry-After": "9"})

        async def lines():  # noqa: ANN202
            while not release.is_set():  # the first token waits for the test
                await asyncio.sleep(0.01)
            out = RequestOutput(body["request_id"], (7,), "x", (7,), "x", FinishReason.LENGTH,
                                len(body["prompt_ids"]), 0, 0.0, 0.0, 0.0)
            yield json.dumps({"output": output_to_json(out)}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def _pd_app(url: str, config: EngineConfig):  # noqa: ANN202
    from kthena_serve.cluster.router import Router
    from kthena_serve.pd.frontend import RemoteEngine, build_router_app

    router = Router([("decode-0", "decode", url)], PDConfig(), block_size=config.block_size)
    router.workers["decode-0"].is_up = True
    remote = RemoteEngine(router, default_tokenizer(), config, (2048, 49152))
    return remote, build_router_app(remote, model_name=MODEL)


def test_pd_router_bounds_its_own_queue() -> None:
    release = threading.Event()
    num_tokens = len(default_tokenizer().encode(PROMPT))
    config = EngineConfig(max_queued_tokens=num_tokens, max_queue_delay_s=0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    try:
        with BackgroundServer(_decode_worker(False, release)) as worker:
            remote, app = _pd_app(worker.url, config)
            with contextlib.closing(remote.router), BackgroundServer(app) as router, \
                    httpx.Client(base_url=router.url, timeout=60) as http, \
                    ThreadPoolExecutor(1) as pool:
                first = stream_later(pool, http, body)
                wait_until(lambda: remote.stats().queue.num_requests == 1, 60, "a queued one")
                assert_overloaded(http.post("/v1/completions", json=body))
                release.set()
                assert first.result(timeout=60) == (200, "x")
                assert remote.stats().queue.num_requests == 0
                text = http.get("/metrics").text
                assert metric_value(text, "kthena_requests_rejected_total", reason="overload") == 1
    finally:
        release.set()


def test_pd_router_refuses_kv_transfer_params_before_its_queue() -> None:
    release = threading.Event()
    release.set()
    config = EngineConfig(max_queue_delay_s=1.0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    with BackgroundServer(_decode_worker(False, release)) as worker:
        remote, app = _pd_app(worker.url, config)
        with contextlib.closing(remote.router), BackgroundServer(app) as router, \
                httpx.Client(base_url=router.url, timeout=60) as http:
            for _ in range(3):
                reply = http.post("/v1/completions", json={
                    **body, "kv_transfer_params": {"do_remote_prefill": True}})
                assert reply.status_code == 400, reply.text
            assert remote.stats().queue.num_requests == 0
            assert http.post("/v1/completions", json=body).status_code == 200


def test_pd_router_passes_a_decode_workers_refusal_on() -> None:
    release = threading.Event()
    with BackgroundServer(_decode_worker(True, release)) as worker:
        remote, app = _pd_app(worker.url, EngineConfig())
        from fastapi.testclient import TestClient

        with contextlib.closing(remote.router), TestClient(app) as client:
            reply = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                         "max_tokens": 2})
            assert_overloaded(reply, flag=None)
            assert reply.headers["retry-after"] == "9"
            assert reply.json()["error"]["message"] == "decode worker overloaded"
            stream = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                          "max_tokens": 2, "stream": True})
            # before the first output nothing is sent: a status, not an event in a 200 stream
            assert_overloaded(stream, flag=None)
            assert stream.headers["retry-after"] == "9"


def test_pd_router_keeps_one_queue_per_path() -> None:
    """A prompt prefilled on the decode worker's core (short: under pd_threshold) and one sent
    to a prefill worker wait in different queues: the short one queued does not count against
    a long one, and a second long one is refused by its own path's queue."""
    from kthena_serve.cluster.router import Router
    from kthena_serve.pd.frontend import DISAGGREGATED, LOCAL, RemoteEngine, build_router_app

    release = threading.Event()
    short = "Hi there"
    long_prompt = " ".join(["The capital of France is a city of light."] * 8)
    tokenizer = default_tokenizer()
    threshold = len(tokenizer.encode(short)) + 1
    assert len(tokenizer.encode(long_prompt)) > threshold
    config = EngineConfig(max_queued_tokens=len(tokenizer.encode(long_prompt)),
                          max_queue_delay_s=0)
    try:
        with BackgroundServer(_decode_worker(False, release)) as worker:
            router = Router([("decode-0", "decode", worker.url),
                             ("prefill-0", "prefill", worker.url)],
                            PDConfig(pd_threshold_tokens=threshold), block_size=config.block_size)
            for state in router.workers.values():
                state.is_up = True
            remote = RemoteEngine(router, tokenizer, config, (2048, 49152))
            app = build_router_app(remote, model_name=MODEL)
            with contextlib.closing(router), BackgroundServer(app) as server, \
                    httpx.Client(base_url=server.url, timeout=60) as http, \
                    ThreadPoolExecutor(2) as pool:
                def body(prompt: str, **extra) -> dict:
                    return {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}

                first = stream_later(pool, http, body(short))
                wait_until(lambda: remote.admission[LOCAL].load().num_requests == 1,
                           60, "the short prompt queued locally")
                # one queue for both would hold short + long tokens, over the bound: its own
                # queue was empty, so it is admitted
                second = stream_later(pool, http, body(long_prompt))
                wait_until(lambda: remote.admission[DISAGGREGATED].load().num_requests == 1,
                           60, "the long prompt queued for a prefill worker")
                assert remote.stats().queue.num_requests == 2  # both, reported
                # a second long prompt: its own path's queue is at the bound
                assert_overloaded(http.post("/v1/completions", json=body(long_prompt)))
                release.set()
                assert second.result(timeout=60) == (200, "x")
                assert first.result(timeout=60) == (200, "x")
                assert all(g.load().num_requests == 0 for g in remote.admission.values())
                assert not remote._admitted
    finally:
        release.set()


# ---- what the engine tells the gate ------------------------------------------------------------
def test_engine_kv_outlook_counts_the_blocks_the_queue_will_take_and_measures_releases() -> None:
    """Against the engine's own state: waiting prompts count prompt + output blocks (outputs at
    max_tokens until a request has finished, then at the measured mean), running ones the
    blocks their outputs still need; finishing requests is what gives a release rate."""
    from kthena_serve.engine.sampling_params import SamplingParams

    engine = tiny_engine(num_kv_blocks=64, block_size=4, max_num_seqs=2,
                         target_step_ms=100.0)
    first = engine.kv_outlook()
    assert first.release_blocks_per_s is None and first.out_blocks == 0  # nothing finished
    assert first.free_blocks == engine.kv.num_free_blocks and first.demand_blocks == 0
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(4):  # 2 seats: two run, two wait
        engine.add_request(f"r{i}", list(range(10 + i, 20 + i)), params)  # 10 prompt tokens
    engine.step()
    outlook = engine.kv_outlook()
    waiting = list(engine.scheduler.waiting)
    running = list(engine.scheduler.running)
    assert len(waiting) == 2 and len(running) == 2
    whole = -(-(10 + 6) // 4)  # 4 blocks per request: prompt + max_tokens
    assert outlook.demand_blocks == 2 * whole + sum(whole - len(r.block_ids) for r in running)
    assert outlook.free_blocks == engine.kv.num_free_blocks
    assert engine.prefill_slowdown(0) == 1.0  # no more rows than now: no slowdown
    assert 0.0 < engine.prefill_slowdown(2) <= 1.0
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.kv_outlook()
    assert done.demand_blocks == 0 and done.free_blocks == 64
    assert done.release_blocks_per_s is not None and done.release_blocks_per_s > 0
    assert done.out_blocks == -(-6 // 4)  # every output was 6 tokens
