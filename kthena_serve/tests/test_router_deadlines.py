"""The routers hold the queue bound themselves (issue 53's operator probe): a deadline on the
first token, the same 503 ``queue_timeout`` as colocated, and an estimate that is sound before
anything is measured (``admission.startup_rate``).

The workers here are fakes that hold a first token until the test releases it, so what is
refused follows from counts and a deadline that has plainly passed, not from how fast anything
runs. The deployment test at the end (a fresh ``kthena serve --dp 2`` and a burst of long
prompts) asserts that each request is either served with its first token within the bound plus
``SLACK_S`` or refused with a 503, never how many are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _support import metric_value, wait_until
from _tiny import default_tokenizer
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kthena_serve.engine.admission import (
    COLD_MARGIN,
    QUEUE_TIMEOUT,
    SEED_CORES,
    AdmissionGate,
    AdmissionLimits,
    QueueLoad,
    startup_rate,
)
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.errors import OverloadedError
from kthena_serve.engine.request import FinishReason, RequestOutput
from kthena_serve.engine.step_cost import StepCostModel
from kthena_serve.engine.threads import owned_cores
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.protocol import output_to_json
from kthena_serve.server import BackgroundServer

MODEL = "tiny"
PROMPT = "The capital of France is a city of light and"
BOUND_S = 1.0
PATIENCE_S = 60.0  # how long a test waits for what is due after BOUND_S


# ---- the pieces -----------------------------------------------------------------------------------
def test_the_startup_rate_is_the_calibrated_seed_at_full_batches_scaled_to_cores() -> None:
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512)
    seed = StepCostModel().prefill_tokens_per_s(16, 512)
    assert startup_rate(config, SEED_CORES) == pytest.approx(seed)
    assert startup_rate(config, 1) == pytest.approx(seed / SEED_CORES)
    assert startup_rate(config, 64) == pytest.approx(seed)  # never above the calibration
    # below what a worker reports before it measures (the seed with no decode rows)
    assert startup_rate(config, SEED_CORES) < StepCostModel().prefill_tokens_per_s(0, 512)
    with pytest.raises(ValueError, match="num_cores must be at least 1, got 0"):
        startup_rate(config, 0)


def test_a_gate_gives_a_first_token_deadline_and_its_refusal() -> None:
    now = [100.0]
    gate = AdmissionGate(AdmissionLimits(max_queue_delay_s=5.0), clock=lambda: now[0])
    assert gate.try_admit([("a", 10)], prior=100.0) is None
    assert gate.first_token_by("a") == 105.0
    assert gate.first_token_by("unknown") is None
    now[0] = 106.0
    error = gate.timed_out("a", waited_for="first_token")
    assert isinstance(error, OverloadedError) and error.limit == QUEUE_TIMEOUT
    assert "did not get a first token within the queue bound (6.0 s queued; " \
           "--max-queue-delay 5 s)" in str(error)
    assert gate.num_queued == 0 and gate.load().num_tokens == 0  # its place is given back
    unbounded = AdmissionGate(AdmissionLimits(max_queued_tokens=100))
    unbounded.try_admit([("b", 1)])
    assert unbounded.first_token_by("b") is None


def test_a_routers_gate_is_cautious_until_it_has_measured() -> None:
    """At 10 tokens/s two prompts of 100 tokens are 20 s of queue, within a 30 s bound; at the
    cold tenth of it they are 200 s: refused until a first token has been seen."""
    limits = AdmissionLimits(max_queue_delay_s=30.0)
    gate = AdmissionGate(limits, cold_margin=COLD_MARGIN)
    assert COLD_MARGIN == 10.0
    assert gate.try_admit([("a", 100)], prior=10.0) is None  # an empty queue admits
    refusal = gate.try_admit([("b", 100)], prior=10.0)
    assert refusal is not None and "--max-queue-delay" in refusal.message
    assert refusal.estimated_wait_s == pytest.approx(200.0, rel=0.05)
    gate.forget("a")  # ended without a first token: still nothing measured
    assert gate.try_admit([("c", 100)], prior=10.0) is None
    assert gate.try_admit([("d", 100)], prior=10.0) is not None
    gate.started("c")  # a first token: the rate itself from now on
    assert gate.try_admit([("d", 100)], prior=10.0) is None
    warm = AdmissionGate(limits)  # an engine's own gate: no margin
    assert warm.try_admit([("a", 100)], prior=10.0) is None
    assert warm.try_admit([("b", 100)], prior=10.0) is None
    with pytest.raises(ValueError, match="cold_margin must be at least 1, got 0.5"):
        AdmissionGate(limits, cold_margin=0.5)


# ---- PD: the router's deadline ----------------------------------------------------------------------
def _decode_worker(release: threading.Event, closed: list[str]) -> FastAPI:
    """A decode worker whose first token waits for ``release``; a stream the router closes
    first is recorded in ``closed``."""
    app = FastAPI()

    @app.post("/pd/generate")
    async def generate(body: dict):  # noqa: ANN202
        async def lines():  # noqa: ANN202
            try:
                while not release.is_set():
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                closed.append(body["request_id"])
                raise
            out = RequestOutput(body["request_id"], (7,), "x", (7,), "x", FinishReason.LENGTH,
                                len(body["prompt_ids"]), 0, 0.0, 0.0, 0.0)
            yield json.dumps({"output": output_to_json(out)}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def _remote(url: str, config: EngineConfig, startup: float | None = None):  # noqa: ANN202
    from kthena_serve.cluster.router import Router
    from kthena_serve.pd.frontend import RemoteEngine, build_router_app

    router = Router([("decode-0", "decode", url)], PDConfig(), block_size=config.block_size)
    router.workers["decode-0"].is_up = True
    remote = RemoteEngine(router, default_tokenizer(), config, (2048, 49152),
                          startup_rate=startup)
    return remote, build_router_app(remote, model_name=MODEL)


def _assert_queue_timeout(reply: httpx.Response) -> None:
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == QUEUE_TIMEOUT and "--max-queue-delay 1 s" in error["message"]
    assert int(reply.headers["retry-after"]) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_pd_router_refuses_a_request_without_a_first_token_at_its_deadline(stream: bool) -> None:
    release, closed = threading.Event(), []
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": stream}
    try:
        with BackgroundServer(_decode_worker(release, closed)) as worker:
            remote, app = _remote(worker.url, EngineConfig(max_queue_delay_s=BOUND_S))
            with contextlib.closing(remote.router), BackgroundServer(app) as server, \
                    httpx.Client(base_url=server.url, timeout=PATIENCE_S) as http:
                _assert_queue_timeout(http.post("/v1/completions", json=body))
                assert remote.stats().queue.num_requests == 0  # its place is given back
                wait_until(lambda: len(closed) == 1, PATIENCE_S, "the worker's stream closed")
                text = http.get("/metrics").text
                assert metric_value(text, "kthena_requests_rejected_total", reason="overload",
                                    limit="queue_timeout") == 1
                release.set()  # a first token in time: served
                reply = http.post("/v1/completions", json={**body, "stream": False})
                assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "x"
    finally:
        release.set()


def test_pd_router_starts_from_the_startup_rate_before_any_report() -> None:
    from kthena_serve.pd.frontend import DISAGGREGATED, LOCAL

    remote, _ = _remote("http://127.0.0.1:9", EngineConfig(), startup=500.0)
    with contextlib.closing(remote.router):
        assert remote._prior_rate(LOCAL) == remote._prior_rate(DISAGGREGATED) == 500.0
        remote.router.workers["decode-0"].stats = {"queue": QueueLoad(0, 0, 2000.0).to_json()}
        assert remote._prior_rate(LOCAL) == 500.0  # the lower of the two
        remote.router.workers["decode-0"].stats = {"queue": QueueLoad(0, 0, 300.0).to_json()}
        assert remote._prior_rate(LOCAL) == 300.0


# ---- DP: the router's own queue per replica, and its deadline ------------------------------------------
def _replica(name: str, release: threading.Event, closed: list[str]) -> FastAPI:
    """A replica whose answer (a stream's headers: its first output) waits for ``release``;
    a call the router gives up on first is recorded in ``closed``."""
    app = FastAPI()
    app.state.calls = 0

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202
        app.state.calls += 1
        body = await request.json()
        try:
            while not release.is_set():
                await asyncio.sleep(0.01)
                if await request.is_disconnected():
                    closed.append(name)
                    return JSONResponse({}, status_code=499)
        except asyncio.CancelledError:
            closed.append(name)
            raise
        if not body.get("stream"):
            return JSONResponse({"object": "text_completion", "choices": [{"text": name}]})

        async def events():  # noqa: ANN202
            yield f'data: {json.dumps({"choices": [{"text": name}]})}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _dp(urls: list[str], limits: AdmissionLimits, startup: float | None = None):  # noqa: ANN202
    from kthena_serve.cluster.router import Router
    from kthena_serve.dp.frontend import DPFrontend, build_dp_app
    from kthena_serve.dp.launcher import ROLE
    from kthena_serve.dp.serve import _routing_processor

    router = Router([(f"replica-{i}", ROLE, u) for i, u in enumerate(urls)], PDConfig(),
                    block_size=16)
    for worker in router.workers.values():
        worker.is_up = True
        router.index.add_instance(worker.name)
    front = DPFrontend(router, _routing_processor(EngineConfig()), secret="s", limits=limits,
                       startup_rate=startup)
    return front, build_dp_app(front)


def test_dp_router_refuses_a_stream_without_a_first_token_at_its_deadline() -> None:
    release, closed = threading.Event(), []
    replica = _replica("replica-0", release, closed)
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 1}
    try:
        with BackgroundServer(replica) as one:
            front, app = _dp([one.url], AdmissionLimits(max_queue_delay_s=BOUND_S))
            with contextlib.closing(front.router), BackgroundServer(app) as server, \
                    httpx.Client(base_url=server.url, timeout=PATIENCE_S) as http:
                _assert_queue_timeout(http.post("/v1/completions", json={**body, "stream": True}))
                wait_until(lambda: closed == ["replica-0"], PATIENCE_S,
                           "the replica saw the call closed")
                assert front.gates["replica-0"].num_queued == 0  # its place is given back
                assert front.router.workers["replica-0"].num_in_flight == 0
                text = http.get("/metrics").text
                assert metric_value(text, "kthena_dp_rejected_requests_total",
                                    reason="queue_timeout") == 1
                # a whole answer comes at its end: the replica's own deadline bounds it, not
                # this router's (released after the bound has passed)
                with ThreadPoolExecutor(1) as pool:
                    whole = pool.submit(http.post, "/v1/completions", json=body)
                    wait_until(lambda: replica.state.calls == 2, PATIENCE_S, "the call sent")
                    threading.Timer(2 * BOUND_S, release.set).start()
                    reply = whole.result(timeout=PATIENCE_S)
                assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "replica-0"
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                    assert s.status_code == 200 and "[DONE]" in s.read().decode()
                assert front.gates["replica-0"].num_queued == 0
    finally:
        release.set()


def test_dp_router_queues_a_burst_on_its_own_before_any_report() -> None:
    """Nothing reported, every replica idle as far as the polls know: the router's own queue
    per replica, at the cold start-up rate, spreads a burst, then refuses it without sending
    it (two prompts at the start-up rate fit the bound; at its cold tenth they do not)."""
    release, closed = threading.Event(), []
    num_tokens = len(default_tokenizer().encode(PROMPT)) + 1  # with BOS
    bound = 30.0
    rate = 2 * num_tokens / (bound / 2)  # two prompts: half the bound warm, 5x it cold
    replicas = [_replica(f"replica-{i}", release, closed) for i in range(2)]
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 1, "stream": True}
    try:
        with BackgroundServer(replicas[0]) as one, BackgroundServer(replicas[1]) as two, \
                ThreadPoolExecutor(2) as pool:
            front, app = _dp([one.url, two.url], AdmissionLimits(max_queue_delay_s=bound),
                             startup=rate)
            with contextlib.closing(front.router), BackgroundServer(app) as server, \
                    httpx.Client(base_url=server.url, timeout=PATIENCE_S) as http:
                first = pool.submit(http.post, "/v1/completions", json=body)
                wait_until(lambda: sum(r.state.calls for r in replicas) == 1, PATIENCE_S, "one")
                second = pool.submit(http.post, "/v1/completions", json=body)
                wait_until(lambda: all(r.state.calls == 1 for r in replicas), PATIENCE_S,
                           "the second on the other replica")
                third = http.post("/v1/completions", json=body)
                assert third.status_code == 503, third.text
                assert third.json()["error"]["code"] == "overloaded"
                assert "--max-queue-delay" in third.json()["error"]["message"]
                assert sum(r.state.calls for r in replicas) == 2  # refused here, not sent
                release.set()
                assert first.result(PATIENCE_S).status_code == 200
                assert second.result(PATIENCE_S).status_code == 200
                assert all(g.num_queued == 0 for g in front.gates.values())
                assert not closed
    finally:
        release.set()


def test_dp_router_rates_start_from_the_lower_of_report_and_startup() -> None:
    front, _ = _dp(["http://127.0.0.1:9"], AdmissionLimits(max_queue_delay_s=5.0), startup=500.0)
    with contextlib.closing(front.router):
        assert front._prior("replica-0") == 500.0
        front.router.workers["replica-0"].stats = {"queue": QueueLoad(0, 0, 2000.0).to_json()}
        assert front._prior("replica-0") == 500.0
        front.router.workers["replica-0"].stats = {"queue": QueueLoad(0, 0, 300.0).to_json()}
        assert front._prior("replica-0") == 300.0


# ---- a fresh deployment and a burst -----------------------------------------------------------------
SLACK_S = 2.0  # the router's own time on top of the bound: tokenising, relaying (docs)
DEPLOY_BOUND_S = 5.0
BURST = 16


def _first_token(http: httpx.Client, prompt: str) -> tuple[int, str | None, float | None]:
    """(status, error code, seconds to the first streamed text) of one streamed completion."""
    import time

    began = time.monotonic()
    body = {"model": "default", "prompt": prompt, "max_tokens": 4, "stream": True,
            "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            return reply.status_code, json.loads(reply.read())["error"]["code"], None
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.monotonic() - began
                for _ in lines:  # the rest of the stream
                    pass
                return 200, None, first
    return reply.status_code, None, None


@pytest.mark.parametrize(("mode", "num_gates"), [(("--dp", "2"), 2), (("--mode", "pd"), 2)],
                         ids=["dp", "pd"])
def test_a_burst_on_a_fresh_deployment_is_served_in_the_bound_or_refused(
        mode: tuple, num_gates: int) -> None:
    """Long distinct prompts arrive at once on workers that have measured nothing: each is
    served with its first token within the bound plus ``SLACK_S``, or refused with a 503
    (``overloaded`` at admission, ``queue_timeout`` at the deadline). The burst arrives before
    any first token, so each gate (a replica each in DP, a path each in PD) admits what its
    cold start-up rate puts within the bound, at least one."""
    from _serve_process import start_serve, stop

    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc, url, _ = start_serve(*mode, "--max-queue-delay", str(DEPLOY_BOUND_S),
                               "--kv-cache-memory", "128MiB", "--max-num-seqs", "8",
                               "--kernels", "native", "--port", "0", "--shutdown-timeout", "2",
                               "--disable-log-stats", env=env, timeout=300)
    try:
        text = " ".join(["Serving many prompts at once needs a bound on the queue."] * 50)
        with httpx.Client(base_url=url, timeout=300) as http, ThreadPoolExecutor(BURST) as pool:
            replies = list(pool.map(lambda i: _first_token(http, f"{i}: {text}"), range(BURST)))
            metrics = http.get("/metrics").text
    finally:
        stop(proc)
    served = [first for status, _, first in replies if status == 200]
    refused = [code for status, code, _ in replies if status == 503]
    assert len(served) + len(refused) == BURST, replies
    # a gate's cold rate (the deployment's start-up rate over COLD_MARGIN; cores as the
    # launchers share them: 2 replicas, or 2 workers of one rank each) fits this many prompts
    config = EngineConfig(max_num_seqs=8)
    cold = startup_rate(config, max(1, len(owned_cores()) // 2)) / COLD_MARGIN
    longest = max(len(default_tokenizer().encode(f"{i}: {text}")) + 1 for i in range(BURST))
    per_gate = max(1, int(DEPLOY_BOUND_S * cold // longest))
    admitted = len(served) + refused.count(QUEUE_TIMEOUT)
    assert admitted <= num_gates * per_gate, (replies, per_gate)
    assert set(refused) <= {"overloaded", QUEUE_TIMEOUT}, replies
    assert all(first is not None and first <= DEPLOY_BOUND_S + SLACK_S for first in served), \
        replies
    if mode[0] == "--dp":  # the router's own, the rest the replicas'
        timeouts = metric_value(metrics, "kthena_dp_rejected_requests_total",
                                reason="queue_timeout")
        assert timeouts <= refused.count(QUEUE_TIMEOUT)
    else:  # the PD router is the only admission point
        timeouts = metric_value(metrics, "kthena_requests_rejected_total", reason="overload",
                                limit=QUEUE_TIMEOUT)
        assert timeouts == refused.count(QUEUE_TIMEOUT)
    print(json.dumps({"mode": mode, "bound_s": DEPLOY_BOUND_S, "served": len(served),
                      "refused": {c: refused.count(c) for c in set(refused)},
                      "ttft_s": sorted(round(t, 2) for t in served)}))
