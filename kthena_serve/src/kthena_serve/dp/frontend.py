"""The DP router's HTTP front: ``kthena serve``'s OpenAI API, each call passed to a replica.

::

    POST /v1/completions, /v1/chat/completions   tokenise the prompt (routing only), pick a
                       replica (``Router.pick``: prefix, load, KV usage), send it the body as
                       is, relay status, headers and body, SSE as it streams
    GET /v1/models, POST /tokenize, /detokenize   the least-loaded replica answers
    GET /health        200 while a replica is up, else 503 (never needs the key)
    GET /metrics       the router's ``kthena_dp_*`` and every replica's metrics (dp/metrics.py)
    GET /dp/replicas   each replica's state as the router sees it
    GET /plan          the layout served (dp = the replicas) and the plan it came from

Every response a replica gives carries ``x-kthena-replica: <name>``.

**Tokenise here, not at a replica's /tokenize.** The router needs the prompt's tokens to look
its blocks up. Its own tokenizer (the model's, through the same ``InputProcessor``, encode rule
and chat rendering as the replicas: a completion's text gets the tokenizer's BOS, a chat what
its template writes, so the ids are the ones the replica will hash) costs tens of
microseconds in Rust per prompt; a /tokenize call costs a loopback round trip and time on the
event loop of a replica whose core is busy decoding, before the request can even be sent.

**Forward the body, not token ids.** The replica validates the request with ``kthena
serve``'s own app, so every 4xx body is the one ``kthena serve`` gives and every request field
works as there; the price is tokenising each prompt twice. A body the router cannot read is
routed by load, and the replica answers it with the 4xx.

Overload (admission.py): a replica past its queue bound answers 503 with ``Retry-After`` before
anything is generated; the router then sends the call to the next best replica it has not tried,
and relays the last refusal as is (status, body, ``Retry-After``) when none is left. Replicas
whose last reported queue (``/dp/state``) is past the bound for this prompt are not picked, and
when that is every replica up the router answers 503 itself, with the soonest ``Retry-After``
(``kthena_dp_rejected_requests_total``).

Those reports are a poll old, so a burst that arrives at once would find every queue empty.
The router therefore keeps a queue of its own per replica (an ``AdmissionGate``, the replicas'
bounds) over the streamed calls it sent there and has not seen the answer of: a replica sends a
stream's headers with its first output, so for a stream they are the first token. A replica
whose gate refuses the prompt is not picked (every one refusing: the soonest refusal, 503
``overloaded``). Each gate's rate starts from the lower of the replica's reported rate and the
start-up rate (``admission.startup_rate``, the calibrated seed scaled to the replica's cores),
divided by ``COLD_MARGIN`` until the gate has seen a first token, and is measured from there.
A streamed call still without its headers ``--max-queue-delay`` seconds after its admission is
refused with the 503 ``queue_timeout`` colocated gives: the upstream connection is closed (the
replica aborts the request) and its place given back
(``kthena_dp_rejected_requests_total{reason="queue_timeout"}``). A non-streamed answer comes
whole, so its first token is not seen here: such calls are bounded by the replica's own queue
and deadline (admission.py), as colocated.

Failures: a replica that refuses the connection is marked down and the next best one gets the
request (nothing was sent, so this is safe); one that fails after the request was sent is
marked down and the client gets a 503 naming it (in a stream: an error event, then
``[DONE]``); with no replica up, 503 says so. Client disconnects propagate: the upstream
connection is closed and the replica aborts the request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kthena_serve.cluster.auth import auth_headers
from kthena_serve.cluster.router import Pick, Router
from kthena_serve.dp.launcher import ROLE
from kthena_serve.dp.metrics import DPMetrics, merge_replica_metrics
from kthena_serve.engine.admission import (
    COLD_MARGIN,
    AdmissionGate,
    AdmissionLimits,
    QueueLoad,
    Refusal,
    decide,
)
from kthena_serve.engine.errors import InvalidRequestError, OverloadedError
from kthena_serve.engine.input_processor import InputProcessor
from kthena_serve.server import protocol as p
from kthena_serve.server.app import add_api_middleware, add_plan_route
from kthena_serve.server.errors import (
    OVERLOADED,
    ApiError,
    error_body,
    error_response,
    install_handlers,
)
from kthena_serve.server.routes import _template_reads
from kthena_serve.server.tokenization import chat_ids

__all__ = ["REPLICA_HEADER", "DPFrontend", "build_dp_app", "routing_prompt"]

REPLICA_HEADER = "x-kthena-replica"
_PASSED_HEADERS = ("content-type", "cache-control", "retry-after")
_DONE = b"data: [DONE]\n\n"
_CHAT_PATH = "/v1/chat/completions"


def routing_prompt(path: str, body: bytes, processor: InputProcessor,
                   ) -> tuple[list[int], str | None]:
    """The token ids and ``cache_salt`` a request is routed by: the ids the replica will run,
    by the ``InputProcessor``'s encode rule and the body's own switches. A chat is rendered as
    the chat route renders it (``tokenization.chat_ids``: tools, ``add_generation_prompt``,
    ``continue_final_message``, ``add_special_tokens``, template variables); a completion's
    (first) prompt gets the tokenizer's BOS unless ``add_special_tokens`` is false.
    ``([], None)`` for a body that is not a valid request: it is routed by load, and the
    replica answers it with the 4xx."""
    try:
        if path == _CHAT_PATH:
            chat = p.ChatCompletionRequest.model_validate_json(body)
            return _chat_ids(chat, processor), chat.cache_salt
        completion = p.CompletionRequest.model_validate_json(body)
        prompt = completion.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # one request, one replica: the first prompt routes it
        ids = processor.encode(prompt, add_special_tokens=completion.add_special_tokens)
        return ids, completion.cache_salt
    except (ValueError, TypeError, InvalidRequestError):  # pydantic's errors are ValueErrors
        return [], None


def _chat_ids(chat: p.ChatCompletionRequest, processor: InputProcessor) -> list[int]:
    variables, _ = chat.template_variables(_template_reads(processor.tokenizer.chat_template))
    return chat_ids(processor, chat.messages, chat.tools,
                    add_generation_prompt=chat.add_generation_prompt,
                    add_special_tokens=chat.add_special_tokens,
                    continue_final_message=chat.continue_final_message,
                    template_kwargs={**variables, **(chat.chat_template_kwargs or {})})


class DPFrontend:
    """Picks a replica for each call and relays its answer (see module docs).

    Args:
        router: the started router over the replicas (role ``colocated``).
        processor: the model's ``InputProcessor`` (tokenises for routing only).
        secret: the deployment secret the replicas require.
        remember: record a routed prompt's blocks on its replica at once (prefix caching on).
        limits: the replicas' queue bounds (``AdmissionLimits.of`` their ``EngineConfig``).
        startup_rate: prompt tokens/s a replica's gate assumes before anything is measured
            (``admission.startup_rate``; None: the replica's reports alone).
    """

    def __init__(self, router: Router, processor: InputProcessor, *, secret: str,
                 remember: bool = True, limits: AdmissionLimits | None = None,
                 startup_rate: float | None = None) -> None:
        self.router = router
        self.processor = processor
        self.remember = remember
        self.limits = limits or AdmissionLimits()
        self.startup_rate = startup_rate
        # replica -> the streamed calls sent there without an answer yet (module docs)
        self.gates = {name: AdmissionGate(self.limits, cold_margin=COLD_MARGIN)
                      for name in router.workers}
        self._ids = itertools.count()
        self.metrics = DPMetrics(router.workers)
        self._headers = auth_headers(secret)
        self._client: httpx.AsyncClient | None = None
        self._closing: str | None = None  # set by abort_all: the server is shutting down

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # made on the server's event loop
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=2.0, read=None, write=30.0, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                headers=self._headers, trust_env=False)
        return self._client

    def abort_all(self, message: str) -> None:
        """End every relayed stream at its next event with ``message`` (shutdown deadline)."""
        self._closing = message

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # ---- routes -------------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        """A completions or chat call: routed by its prompt, counted by replica and reason."""
        body = await request.body()
        prompt_ids, salt = routing_prompt(request.url.path, body, self.processor)
        overloaded = self._overloaded(len(prompt_ids))
        return await self.forward(request, body, prompt_ids, salt, counted=True,
                                  exclude=overloaded, streamed=_is_stream(body))

    def _prior(self, name: str) -> float | None:
        """A replica gate's rate before it measures: the lower of the replica's reported rate
        and the start-up rate."""
        load = QueueLoad.from_json((self.router.workers[name].stats or {}).get("queue"))
        known = [r for r in (None if load is None else load.prefill_tokens_per_s,
                             self.startup_rate) if r is not None]
        return min(known) if known else None

    def _admit(self, name: str, num_tokens: int) -> tuple[str | None, Refusal | None]:
        """Queue a streamed call on ``name``'s gate: (its id there, None), or (None, the
        refusal)."""
        request_id = f"dp-{next(self._ids)}"
        refusal = self.gates[name].try_admit([(request_id, num_tokens)], self._prior(name))
        return (None, refusal) if refusal is not None else (request_id, None)

    def _overloaded(self, num_tokens: int) -> frozenset[str]:
        """The replicas up whose last reported queue refuses a prompt of ``num_tokens``.

        Raises:
            OverloadedError: every replica up refuses it (the soonest ``Retry-After``).
        """
        if not self.limits.is_bounded:
            return frozenset()
        refusals: dict[str, Refusal] = {}
        up = self.router.up(ROLE)
        for worker in up:
            load = QueueLoad.from_json((worker.stats or {}).get("queue"))
            refusal = None if load is None else decide(self.limits, load, num_tokens)
            if refusal is not None:
                refusals[worker.name] = refusal
        if up and len(refusals) == len(up):
            soonest = min(refusals.values(), key=lambda r: r.retry_after_s)
            self.metrics.rejected.labels("overload").inc()
            raise OverloadedError(f"every replica is past its queue bound ({soonest.message})",
                                  soonest.retry_after_s, soonest.limit)
        return frozenset(refusals)

    async def forward(self, request: Request, body: bytes, prompt_ids: Sequence[int] = (),
                      cache_salt: str | None = None, *, counted: bool = False,
                      exclude: frozenset[str] = frozenset(), streamed: bool = False) -> Response:
        """Send the call to the best replica that is up; relay its answer. A replica that
        refuses it past its queue bound (503 ``overloaded``) passes it to the next one not
        tried; the last refusal is relayed as is.

        Args:
            exclude: replicas not to try (their reported queue is past the bound).
            streamed: a stream, queued on the chosen replica's gate until its headers (its
                first token), with the queue deadline (module docs).

        Raises:
            ApiError: 503 no replica is up, or the chosen one failed after the call was sent;
                499 the client left before the answer began.
            OverloadedError: every replica's gate refuses a stream, or it had no first token
                by its deadline (``queue_timeout``).
        """
        tried, refusals = set(exclude), []
        for _ in range(len(self.router.workers)):
            try:
                pick = self.router.pick(ROLE, list(prompt_ids), cache_salt,
                                        remember=counted and self.remember, exclude=tried)
            except LookupError:
                break
            name = pick.worker.name
            queued, refusal = (self._admit(name, len(prompt_ids)) if streamed and counted
                               else (None, None))
            if refusal is not None:  # this router's own queue for it is past the bound
                tried.add(name)
                refusals.append(refusal)
                self.router.refused(pick)
                continue
            try:
                upstream = await self._answer(request, pick, body, queued)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                self._failed(name)  # nothing reached it: the next best replica may take it
                continue
            except httpx.TransportError as error:
                self._failed(name)
                raise ApiError(503, f"replica {name} failed before answering "
                               f"({type(error).__name__}); retry the request") from None
            except BaseException:
                self.router.done(name)
                raise
            finally:
                if queued is not None:  # answered, failed or timed out: out of its queue
                    self.gates[name].forget(queued)
            tried.add(name)
            if self._has_untried(tried) and await _is_overloaded(upstream):
                await upstream.aclose()  # nothing was generated: the next replica may take it
                self.router.refused(pick)
                self.metrics.passed_on.labels(name).inc()
                continue
            if counted:
                self.metrics.routed.labels(name, pick.reason).inc()
            if upstream.status_code >= 400:  # nothing was computed: nothing will be cached
                self.router.forget_remembered(pick)
            return await self._relay(pick, upstream)
        if refusals:
            soonest = min(refusals, key=lambda r: r.retry_after_s)
            self.metrics.rejected.labels("overload").inc()
            raise soonest.error()
        raise ApiError(503, self._none_up())

    async def _answer(self, request: Request, pick: Pick, body: bytes,
                      queued: str | None) -> httpx.Response:
        """The replica's answer (its headers); a call ``queued`` on the replica's gate must
        have them by its deadline, and leaves the queue with them (a 200: its first token).

        Raises:
            OverloadedError: ``queue_timeout``: no answer by the deadline (the upstream call
                is cancelled, which closes its connection: the replica aborts the request).
        """
        name = pick.worker.name
        gate = self.gates[name]
        deadline = None if queued is None else gate.first_token_by(queued)
        try:
            upstream = await _until_disconnect(request, self._send(pick, request, body),
                                               deadline)
        except TimeoutError:
            self.router.forget_remembered(pick)  # (``forward`` ends it in flight)
            self.metrics.rejected.labels("queue_timeout").inc()
            raise gate.timed_out(queued, waited_for="first_token") from None
        if queued is not None and upstream.status_code == 200:
            gate.started(queued)
        return upstream

    def _has_untried(self, tried: set[str]) -> bool:
        return any(w.name not in tried for w in self.router.up(ROLE))

    def health(self) -> Response:
        num_up = len(self.router.up(ROLE))
        if not num_up:
            return error_response(503, self._none_up())
        return JSONResponse({"status": "ok", "replicas_up": num_up,
                             "replicas": len(self.router.workers)})

    async def render_metrics(self) -> bytes:
        """The router's families, then every replica's (those that answer), labelled."""
        up = self.router.up(ROLE)
        replies = await asyncio.gather(*(self._http().get(f"{w.url}/metrics", timeout=2.0)
                                         for w in up), return_exceptions=True)
        texts = {w.name: r.text for w, r in zip(up, replies, strict=True)
                 if isinstance(r, httpx.Response) and r.status_code == 200}
        return self.metrics.render() + merge_replica_metrics(texts)

    def replicas(self) -> dict:
        return {name: {"up": w.is_up, "load": w.load, "in_flight": w.num_in_flight,
                       "num_running": w.num_running, "num_waiting": w.num_waiting,
                       "kv_usage": w.kv_usage}
                for name, w in sorted(self.router.workers.items())}

    # ---- internals ----------------------------------------------------------------------------
    def _none_up(self) -> str:
        return (f"no replica is up (all {len(self.router.workers)} failed a health check or a "
                "request; the router keeps checking them): retry shortly")

    def _failed(self, name: str) -> None:
        self.router.done(name)
        self.router.mark_down(name)
        self.metrics.failures.labels(name).inc()

    async def _send(self, pick: Pick, request: Request, body: bytes) -> httpx.Response:
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        upstream = self._http().build_request(request.method, pick.worker.url + request.url.path,
                                              content=body, headers=headers,
                                              params=request.query_params)
        return await self._http().send(upstream, stream=True)

    async def _relay(self, pick: Pick, upstream: httpx.Response) -> Response:
        """The replica's answer as the client's: an SSE stream is relayed as it comes (the
        router's ``done`` when it ends), anything else read whole."""
        name = pick.worker.name
        headers = {k: v for k, v in upstream.headers.items() if k.lower() in _PASSED_HEADERS}
        headers[REPLICA_HEADER] = name

        async def release() -> None:
            await upstream.aclose()
            self.router.done(name)

        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return _Relay(self._events(name, upstream), on_close=release,
                          status_code=upstream.status_code, headers=headers)
        try:
            content = await upstream.aread()
        except httpx.TransportError as error:
            self._failed(name)
            await upstream.aclose()
            raise ApiError(503, f"replica {name} failed mid-answer ({type(error).__name__}); "
                           "retry the request") from None
        except BaseException:
            await release()
            raise
        await release()
        return Response(content, status_code=upstream.status_code, headers=headers)

    async def _events(self, name: str, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """Whole SSE events (up to the last blank line), so an error can end the stream
        cleanly after any of them."""
        pending = b""
        try:
            async for chunk in upstream.aiter_bytes():
                if self._closing is not None:
                    yield _error_event(503, self._closing) + _DONE
                    return
                pending += chunk
                cut = pending.rfind(b"\n\n") + 2
                if cut >= 2:
                    yield pending[:cut]
                    pending = pending[cut:]
        except httpx.TransportError as error:
            self.router.mark_down(name)
            self.metrics.failures.labels(name).inc()
            yield _error_event(503, f"replica {name} failed mid-stream "
                               f"({type(error).__name__}); retry the request") + _DONE


def _is_stream(body: bytes) -> bool:
    """Whether a completions / chat body asks for a stream (False for one that is not JSON:
    the replica answers it with the 4xx)."""
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False


async def _is_overloaded(upstream: httpx.Response) -> bool:
    """Whether a replica's answer is its 503 refusal past its queue bound (the body is read:
    a small JSON error, relayed from memory if it is passed on after all)."""
    if upstream.status_code != 503:
        return False
    try:
        return json.loads(await upstream.aread())["error"]["code"] == OVERLOADED
    except (ValueError, KeyError, TypeError, httpx.HTTPError):
        return False


def _error_event(status: int, message: str) -> bytes:
    return f"data: {json.dumps(error_body(status, message))}\n\n".encode()


class _Relay(StreamingResponse):
    """A streamed answer whose ``on_close`` runs however it ends: finished, client gone, or
    cancelled before the first byte (a generator's ``finally`` would not run if never started)."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]],
                 status_code: int, headers: dict[str, str]) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _until_disconnect(request: Request, call: Awaitable[httpx.Response],
                            deadline: float | None = None) -> httpx.Response:
    """Await the replica's answer (its headers), giving up if the client leaves first: a
    non-streamed answer starts only once it is complete, and closing the upstream connection
    is what makes the replica abort the request.

    Raises:
        TimeoutError: no answer by ``deadline`` (``time.monotonic``; None: none); the call is
            cancelled.
    """
    task = asyncio.ensure_future(call)
    try:
        while not task.done():
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError
            await asyncio.wait({task}, timeout=left)
            if not task.done() and await request.is_disconnected():
                raise ApiError(499, "the client closed the request", code="client_closed")
        return task.result()
    except BaseException:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif not task.cancelled() and task.exception() is None:
            await task.result().aclose()  # answered as we gave up: nobody reads it
        raise


async def _docs_page() -> Response:
    """The interactive API page over the replicas' ``/openapi.json`` (FastAPI's Swagger UI)."""
    from fastapi.openapi.docs import get_swagger_ui_html

    return get_swagger_ui_html(openapi_url="/openapi.json", title="kthena serve --dp")


def build_dp_app(front: DPFrontend, *, api_key: str | None = None, public_metrics: bool = False,
                 max_request_bytes: int = 1 << 20, deployment: Mapping[str, Any] | None = None,
                 ) -> FastAPI:
    """The router's app (routes in the module docs), with ``kthena serve``'s middleware: the
    API key (every path but /health, and /metrics with ``public_metrics``), the body cap, and
    draining on shutdown (``app.state.drain``, read by ``run_server``).

    Args:
        deployment: what GET /plan answers (``ServeSpec.report``); its
            ``served`` layout also labels ``kthena_deployment_info``. None: not known.
    """
    app = FastAPI(title="kthena serve --dp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front
    install_handlers(app)
    add_plan_route(app, front.metrics, deployment)

    app.post("/v1/completions")(front.generate)
    app.post(_CHAT_PATH)(front.generate)

    async def passed(request: Request) -> Response:
        return await front.forward(request, await request.body())

    app.get("/v1/models")(passed)
    app.get("/openapi.json")(passed)  # the replicas' schema: the bodies they validate
    app.get("/version")(passed)
    app.get("/docs")(_docs_page)
    app.post("/tokenize")(passed)
    app.post("/detokenize")(passed)
    app.get("/health")(front.health)
    app.get("/dp/replicas")(front.replicas)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await front.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    add_api_middleware(app, api_key=api_key, public_metrics=public_metrics,
                       max_request_bytes=max_request_bytes)
    return app
