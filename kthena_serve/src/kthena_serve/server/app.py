"""The OpenAI-compatible HTTP app: routes over an ``EngineClient`` (FastAPI).

    POST /v1/completions, /v1/chat/completions   (SSE when ``stream``; ends with [DONE])
    GET  /v1/models, /health, /metrics           (/metrics: kthena_* and vLLM's vllm:* names;
                                                  open with public_metrics, like /health)
    GET  /plan                                   the layout served and the plan it came from
                                                  (``kthena plan --config``'s JSON), also the
                                                  labels of kthena_deployment_info in /metrics
    POST /tokenize, /detokenize                  (vLLM's; see ``tokenization``)

Requests are validated, tokenised and length-checked before anything streams, so every bad
input is a 4xx with an OpenAI error body. A streamed answer's headers go out with its first
output, so what fails while it waits (a refusal at its queue deadline, admission.py) is a
status too. ``prefix_hash`` / ``reuse_offset`` are accepted and
only compared with what token matching found (a metric); ``cache_salt`` keys the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kthena_serve.client import EngineClient, KVConnector
from kthena_serve.engine.errors import EngineDeadError, OverloadedError, RequestFailedError
from kthena_serve.engine.logprobs import TokenLogprobs
from kthena_serve.engine.request import RequestOutput
from kthena_serve.model.errors import ChatTemplateError
from kthena_serve.server import protocol as p
from kthena_serve.server.errors import OVERLOADED, ApiError, error_body, install_handlers
from kthena_serve.server.generation import Job, collect, stream_choices
from kthena_serve.server.metrics import ServerMetrics
from kthena_serve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, public_paths
from kthena_serve.server.shutdown import Drain, DrainMiddleware
from kthena_serve.server.tokenization import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)
from kthena_serve.server.tools import ToolCallParser, chat_inputs, parse_tool_calls, uses_hermes

__all__ = ["build_app"]

log = logging.getLogger(__name__)

MAX_PROMPTS = 64
T = TypeVar("T")


class _Api:
    """Route bodies; one per app."""

    def __init__(self, engine: EngineClient, model_name: str, aliases: set[str],
                 kv_connector: KVConnector | None = None,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.kv_connector = kv_connector
        self.model_name = model_name
        self.names = {model_name} | aliases
        self.metrics = metrics or ServerMetrics(engine, model_name)
        self.log: Callable[[str], None] | None = None  # --enable-log-requests

    # ---- preparing a job --------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        """A served name, or none at all (vLLM's: one model is served here)."""
        if model is not None and model not in self.names:
            raise ApiError(404, f"model {model!r} is not served here; use "
                           f"{self.model_name!r}", "model", "model_not_found")

    def _check_common(self, body: p._Common) -> None:
        self._check_model(body.model)
        limit = self.engine.processor.limits.max_n
        if body.n > limit:
            raise ApiError(400, f"n={body.n} exceeds this server's limit of {limit}", "n")
        body.refuse_unsupported()

    def _job(self, body: p._Common, prompts: list[list[int]], max_tokens: int | None) -> Job:
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as error:
            raise ApiError(400, str(error), getattr(error, "param", None)) from None
        prepared = [self.engine.processor.prepare(ids, params) for ids in prompts]  # -> 400
        prompts = [ids for ids, _ in prepared]
        params = prepared[0][1] if prepared else params  # bad_words as token runs
        budgets = tuple(self.engine.processor.check(ids, params) for ids in prompts)  # invalid -> 400
        job = Job(p.new_id("req"), tuple(tuple(i) for i in prompts), budgets, params, body.n,
                   body.cache_salt)
        self.metrics.observe_prompts([len(i) for i in prompts], salted=bool(body.cache_salt),
                                     block_size=self.engine.processor.limits.block_size)
        if self.log is not None:
            self.log(f"received request {job.request_id}: {len(prompts)} prompt(s) of "
                     f"{', '.join(str(len(i)) for i in prompts)} tokens, n={job.n}, "
                     f"params: {params}")
        return job

    @contextlib.contextmanager
    def _admitted(self, job: Job) -> Iterator[None]:
        """Queue the job's requests, or refuse them at once past the queue bound: 503 with
        ``Retry-After`` before anything streams (admission.py), counted in the metrics. What
        fails inside (a refusal after admission, a client gone before its stream) aborts the
        job's requests, which gives their queue places back: a place left behind would count
        as a late request for its whole claim timeout and refuse the requests after it."""
        requests = [job.engine_request(c) for c in range(job.num_choices)]
        try:
            self.engine.check_admission(requests)
        except OverloadedError as error:
            self.metrics.observe_rejected(error.limit)
            raise
        try:
            yield
        except BaseException:
            for request in requests:
                self.engine.abort(request.request_id)
            raise

    async def _compile_grammar(self, body: p._Common, job: Job) -> None:
        """Compile the output constraint off the event loop and the engine thread (a large
        schema takes a while), so a bad one is a 400 naming its field before anything runs;
        the engine's matchers come from the same cache."""
        if job.params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.processor.compile_grammar, job.params,
                                    body.constraint_param())

    def _check_kv(self, body: p._Common, job: Job) -> None:
        """What ``kv_transfer_params`` asks that this server cannot do: a 400 before admission."""
        if body.kv_transfer_params is None:
            return
        if self.kv_connector is None:
            raise ApiError(400, "kv_transfer_params is for PD workers (python -m "
                           "kthena_serve.pd.worker); this server computes every request "
                           "itself: leave it out", "kv_transfer_params")
        if job.num_choices != 1:
            raise ApiError(400, "kv_transfer_params needs one prompt and n=1",
                           "kv_transfer_params")
        if job.params.prompt_logprobs is not None:
            raise ApiError(400, "prompt logprobs (prompt_logprobs, or echo with logprobs) need "
                           "the prompt computed here; with kv_transfer_params a prefill worker "
                           "computed it: leave them out", "prompt_logprobs")

    async def _open_kv(self, body: p._Common, job: Job) -> Job:
        """Hand ``kv_transfer_params`` (PD workers behind the Kthena router) to the connector
        before anything streams, so a refusal is a 400 (`_check_kv` passed before admission)."""
        if body.kv_transfer_params is None or self.kv_connector is None:
            return job
        session = await self.kv_connector.open(body.kv_transfer_params, job.engine_request(0),
                                               stream=body.stream)
        return job if session is None else attrs.evolve(job, kv=session)

    async def _run(self, body: p._Common, job: Job, request: Request, rid: str,
                   chunks: Callable[..., AsyncIterator[dict]],
                   ) -> Response | tuple[Job, list[RequestOutput]]:
        """Check ``kv_transfer_params``, admit the job, open its KV, then either the SSE
        response of its ``chunks`` (``body.stream``) or the job and its final outputs."""
        self._check_kv(body, job)
        with self._admitted(job):
            job = await self._open_kv(body, job)
            if body.stream:
                outputs = await self._started(job, request)
                return _sse(chunks(rid, body, job, outputs))
            return job, await self._collect(job, request, body.reuse_offset)

    def _completion_prompts(self, body: p.CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]  # type: ignore[list-item]
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", "prompt")
        return [self.engine.processor.encode(text, add_special_tokens=body.add_special_tokens)
                for text in prompt]

    def _chat_prompt(self, body: p.ChatCompletionRequest) -> list[list[int]]:
        template = self.engine.processor.tokenizer.chat_template
        if body.parses_tool_calls and not uses_hermes(template):
            raise ApiError(400, "tools: this checkpoint's chat template writes tool calls in a "
                           "format this server has no parser for (it parses Hermes "
                           "<tool_call> blocks); send tool_choice none or leave tools out",
                           "tools")
        messages, extra = chat_inputs(body.messages, body.tools, template)
        try:
            return [self.engine.processor.encode_chat(
                messages, add_generation_prompt=body.add_generation_prompt,
                add_special_tokens=body.add_special_tokens,
                continue_final_message=body.continue_final_message,
                template_kwargs={**(body.chat_template_kwargs or {}), **extra})]
        except ChatTemplateError as error:
            raise ApiError(400, str(error), "messages") from None

    # ---- routes -----------------------------------------------------------------------------
    async def completions(self, body: p.CompletionRequest, request: Request) -> Response:
        self._check_common(body)
        job = self._job(body, self._completion_prompts(body), body.max_tokens)
        await self._compile_grammar(body, job)
        rid = p.new_id("cmpl", body.request_id)
        ran = await self._run(body, job, request, rid, self._completion_chunks)
        if isinstance(ran, Response):
            return ran
        job, finals = ran
        usage = p.usage(finals, [job.prompt_index(c) for c in range(job.num_choices)])
        logprobs = [None if o.logprobs is None else self._completion_logprobs(
            body, job, c, o.logprobs, o.prompt_logprobs, p.TextOffsets())
            for c, o in enumerate(finals)]
        prompt_logprobs = None
        if body.prompt_logprobs is not None:
            prompt_logprobs = [p.vllm_prompt_logprobs(o.prompt_logprobs or (),
                                                      self.engine.processor.token_bytes,
                                                      body.prompt_logprobs) for o in finals]
        echoed = self._echo_texts(body, job) if body.echo else None
        return JSONResponse(_with_kv(p.completion_response(
            rid, self.model_name, finals, usage, logprobs, echoed, prompt_logprobs), job))

    def _completion_logprobs(self, body: p.CompletionRequest, job: Job, choice: int,
                             entries: Sequence[TokenLogprobs],
                             prompt: Sequence[TokenLogprobs | None] | None,
                             offsets: p.TextOffsets) -> dict:
        """One choice's logprobs; with ``echo``, the prompt's tokens first."""
        ids = job.prompts[job.prompt_index(choice)]
        return p.completion_logprobs(
            entries, self.engine.processor.token_bytes, offsets, body.return_tokens_as_token_ids,
            echo=(prompt or ()) if body.echo else (), first_id=ids[0], num_top=body.logprobs)

    def _echo_texts(self, body: p.CompletionRequest, job: Job) -> list[str]:
        """Each choice's prompt as text: the one sent (decoded from its ids where the prompt
        was token ids or truncated)."""
        prompt = body.prompt
        texts = [prompt] if isinstance(prompt, str) else prompt
        if body.truncate_prompt_tokens is not None or not all(isinstance(t, str) for t in texts):
            # token ids (one prompt or several) or a cut prompt: the text of what ran
            texts = [self.engine.processor.decode(ids) for ids in job.prompts]
        return [texts[job.prompt_index(c)] for c in range(job.num_choices)]

    async def chat(self, body: p.ChatCompletionRequest, request: Request) -> Response:
        self._check_common(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        job = self._job(body, self._chat_prompt(body), max_tokens)
        await self._compile_grammar(body, job)
        rid = p.new_id("chatcmpl", body.request_id)
        ran = await self._run(body, job, request, rid, self._chat_chunks)
        if isinstance(ran, Response):
            return ran
        job, finals = ran
        usage = p.usage(finals, [0] * len(finals))
        logprobs = [None if o.logprobs is None else
                    p.chat_logprobs(o.logprobs, self.engine.processor.token_bytes,
                                    body.return_tokens_as_token_ids) for o in finals]
        prompt_logprobs = None
        if body.prompt_logprobs is not None and finals:
            prompt_logprobs = p.vllm_prompt_logprobs(finals[0].prompt_logprobs or (),
                                                     self.engine.processor.token_bytes,
                                                     body.prompt_logprobs)
        calls = None
        if body.parses_tool_calls:
            calls = [parse_tool_calls(o.text, _max_calls(body)) for o in finals]
        return JSONResponse(_with_kv(p.chat_response(rid, self.model_name, finals, usage,
                                                     logprobs, prompt_logprobs, calls), job))

    async def _collect(self, job: Job, request: Request, hint: int | None) -> list[RequestOutput]:
        """Generate to the end, cancelling (and so aborting) if the client goes away."""
        finals = await self._awaiting(collect(self.engine, job), job, request)
        for out in finals:
            self.metrics.observe(out, hint)
        return finals

    async def _started(self, job: Job, request: Request,
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The job's outputs, once the first has come. Nothing is sent before it, so what fails
        while the request waits (a refusal at its queue deadline, the engine gone, a failed
        request) is the response's status and body, not an error event in a 200 stream."""
        outputs = stream_choices(self.engine, job)
        try:
            head = await self._awaiting(anext(outputs), job, request)
        except BaseException:
            await outputs.aclose()
            raise
        return _after(head, outputs)

    async def _awaiting(self, work: Awaitable[T], job: Job, request: Request) -> T:
        """``work``'s result, cancelling it (which aborts the job's requests) if the client goes
        away (499); a failure counts the job's choices as refused (a queue deadline) or
        aborted."""
        task = asyncio.ensure_future(work)
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self.metrics.observe_aborted(job.num_choices)
                raise ApiError(499, "the client closed the request", code="client_closed")
        try:
            return task.result()
        except OverloadedError as error:  # admitted, then not started in time (admission.py)
            self.metrics.observe_rejected(error.limit)
            raise
        except Exception:
            self.metrics.observe_aborted(job.num_choices)
            raise

    @contextlib.asynccontextmanager
    async def _counting(self, job: Job, finals: dict[int, RequestOutput]) -> AsyncIterator[None]:
        """Choices that never finished (client gone, error, shutdown) count as aborted."""
        try:
            yield
        finally:
            self.metrics.observe_aborted(job.num_choices - len(finals))

    async def _completion_chunks(self, rid: str, body: p.CompletionRequest, job: Job,
                                 outputs: AsyncIterator[tuple[int, RequestOutput]]):
        finals: dict[int, RequestOutput] = {}
        pending = _PendingLogprobs()
        offsets: dict[int, p.TextOffsets] = {}
        echoes = dict(enumerate(self._echo_texts(body, job))) if body.echo else {}
        async with self._counting(job, finals):
            async for choice, out in outputs:
                pending.add(choice, out)
                if out.finished:
                    finals[choice] = out
                    self.metrics.observe(out, body.reuse_offset)
                echo = echoes.pop(choice, None)  # the prompt goes before the first output
                if out.new_text or out.finished or echo is not None:
                    logprobs = None
                    if out.logprobs is not None:
                        logprobs = self._completion_logprobs(
                            body, job, choice, pending.take(choice),
                            out.prompt_logprobs if echo is not None else None,
                            offsets.setdefault(choice, p.TextOffsets()))
                    chunk = p.completion_chunk(rid, self.model_name, choice, out, logprobs)
                    if echo is not None:
                        chunk["choices"][0]["text"] = echo + chunk["choices"][0]["text"]
                        if body.prompt_logprobs is not None:
                            chunk["choices"][0]["prompt_logprobs"] = p.vllm_prompt_logprobs(
                                out.prompt_logprobs or (), self.engine.processor.token_bytes,
                                body.prompt_logprobs)
                    if body.continuous_usage:
                        p.with_running_usage(chunk, out.num_prompt_tokens, len(out.token_ids))
                    yield chunk
        if body.include_usage:
            outs = [finals[c] for c in sorted(finals)]
            usage = p.usage(outs, [job.prompt_index(c) for c in sorted(finals)])
            yield p.usage_chunk(rid, "text_completion", self.model_name, usage)

    async def _chat_chunks(self, rid: str, body: p._Common, job: Job,
                           outputs: AsyncIterator[tuple[int, RequestOutput]]):
        for choice in range(job.num_choices):
            chunk = p.chat_chunk(rid, self.model_name, choice,
                                 {"role": "assistant", "content": ""}, None)
            if body.continuous_usage:
                p.with_running_usage(chunk, len(job.prompts[job.prompt_index(choice)]), 0)
            yield chunk
        finals: dict[int, RequestOutput] = {}
        pending = _PendingLogprobs()
        tools = _ToolDeltas(body)
        async with self._counting(job, finals):
            async for choice, out in outputs:
                pending.add(choice, out)
                reason = out.finish_reason.value if out.finish_reason else None
                if out.finished:
                    finals[choice] = out
                    self.metrics.observe(out, body.reuse_offset)
                delta = {"content": out.new_text} if out.new_text else {}
                if tools.enabled:
                    delta, reason = tools.delta(choice, out)
                if delta or out.finished:
                    logprobs = None
                    if out.logprobs is not None:
                        logprobs = p.chat_logprobs(pending.take(choice),
                                                   self.engine.processor.token_bytes,
                                                   body.return_tokens_as_token_ids)
                    chunk = p.chat_chunk(rid, self.model_name, choice, delta, reason, logprobs)
                    if body.continuous_usage:
                        p.with_running_usage(chunk, out.num_prompt_tokens, len(out.token_ids))
                    yield chunk
        if body.include_usage:
            usage = p.usage([finals[c] for c in sorted(finals)], [0] * len(finals))
            yield p.usage_chunk(rid, "chat.completion.chunk", self.model_name, usage)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        if body.model is not None:  # optional here, as in vLLM
            self._check_model(body.model)
        return tokenize(self.engine, body)

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        if body.model is not None:
            self._check_model(body.model)
        return detokenize(self.engine, body)

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "kthena", "max_model_len": self.engine.processor.limits.max_model_len}
        return {"object": "list", "data": [card]}


def _max_calls(body: p.ChatCompletionRequest) -> int | None:
    return 1 if body.parallel_tool_calls is False else None


class _ToolDeltas:
    """The stream's tool-call side: each choice's text through a ``ToolCallParser`` into
    content and OpenAI's ``tool_calls`` deltas (a call's first with ``index``, ``id``,
    ``type``, ``function.name``; then ``index`` and ``function.arguments`` fragments)."""

    def __init__(self, body: p._Common) -> None:
        self.enabled = isinstance(body, p.ChatCompletionRequest) and body.parses_tool_calls
        self._max_calls = _max_calls(body) if self.enabled else None
        self._parsers: dict[int, ToolCallParser] = {}

    def delta(self, choice: int, out: RequestOutput) -> tuple[dict, str | None]:
        """(delta, finish reason) of one output of ``choice``."""
        parser = self._parsers.setdefault(choice, ToolCallParser(self._max_calls))
        content, calls = parser.feed(out.new_text)
        if out.finished:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        reason = out.finish_reason.value if out.finish_reason else None
        if out.finished and parser.num_calls:
            reason = p.tool_reason(out)
        return delta, reason


class _PendingLogprobs:
    """Each choice's logprobs not sent yet: a step whose text is held back (half a UTF-8
    character, a possible stop string) sends no chunk, so its tokens ride on the next one."""

    def __init__(self) -> None:
        self._by_choice: dict[int, list[TokenLogprobs]] = {}

    def add(self, choice: int, out: RequestOutput) -> None:
        if out.logprobs is not None:
            self._by_choice.setdefault(choice, []).extend(out.new_logprobs or ())

    def take(self, choice: int) -> list[TokenLogprobs]:
        return self._by_choice.pop(choice, [])


def _with_kv(response: dict, job: Job) -> dict:
    """A PD prefill answer carries ``kv_transfer_params`` (where its KV waits; null: nowhere)."""
    if job.kv is not None:
        response["kv_transfer_params"] = job.kv.response_params()
    return response


async def _after(head: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]],
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``head``, then ``rest``; closing this closes ``rest`` (which aborts what is left)."""
    async with contextlib.aclosing(rest):
        yield head
        async for item in rest:
            yield item


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except Exception as error:  # headers are gone: report in-band, then end the stream
            yield f"data: {json.dumps(_in_band(error))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _in_band(error: Exception) -> dict:
    """The error event of a stream whose headers are already sent."""
    if isinstance(error, ApiError):
        return error_body(error.status, error.message, error.param, error.code)
    if isinstance(error, RequestFailedError):
        return error_body(500, str(error), code="request_failed")
    if isinstance(error, OverloadedError):  # after the first output: not expected, kept safe
        return error_body(503, str(error), code=OVERLOADED)
    if isinstance(error, EngineDeadError):
        return error_body(503, str(error))
    log.error("stream failed", exc_info=error)
    return error_body(500, "internal error while streaming; retry the request")


class DeploymentLabels(Protocol):
    """Metrics that label ``kthena_deployment_info`` with the layout served."""

    def set_deployment(self, served: Mapping[str, object]) -> None: ...


def add_plan_route(app: FastAPI, metrics: DeploymentLabels,
                   deployment: Mapping[str, Any] | None) -> None:
    """GET /plan answers ``deployment`` (see `build_app`); its ``served`` layout also labels
    ``kthena_deployment_info`` in ``metrics`` (anything with ``set_deployment``)."""
    report = dict(deployment or {"served": None, "plan": None, "config": None})
    if report["served"] is not None:
        metrics.set_deployment(report["served"])

    @app.get("/plan")
    async def plan() -> Response:
        return JSONResponse(report)


def _print_line(line: str) -> None:
    print(f"kthena serve: {line}", flush=True)


def build_app(engine: EngineClient, *, model_name: str, aliases: set[str] | None = None,
              api_key: str | None = None, max_request_bytes: int = 1 << 20,
              kv_connector: KVConnector | None = None, metrics: ServerMetrics | None = None,
              public_metrics: bool = False, deployment: Mapping[str, Any] | None = None,
              log_requests: bool = False) -> FastAPI:
    """The HTTP app over a started ``EngineClient`` (``AsyncLLM`` or the PD ``RemoteEngine``).

    Args:
        model_name: the id clients send as ``model`` and /v1/models lists.
        aliases: other accepted ``model`` values (e.g. ``"default"``).
        api_key: if set, every path but /health needs ``Authorization: Bearer <api_key>``.
        max_request_bytes: bodies above this get 413.
        kv_connector: a PD worker's side of ``kv_transfer_params`` (without one, a request that
            carries them is a 400).
        metrics: where requests are observed (default: a new ``ServerMetrics``); a PD worker
            passes the one its control app's /metrics renders.
        public_metrics: /metrics needs no API key (``--public-metrics``: Prometheus and the
            Kthena router scrape without credentials).
        deployment: what GET /plan answers: ``{"served": {tp, pp, dp, sp, mode}, "plan": the
            planner's JSON or None, "config": the config file or None}`` (see
            ``ServeSpec.report``); ``served`` also labels
            ``kthena_deployment_info``. None: not known here (``served`` is null).

    Raises:
        ValueError: ``metrics`` was made for another served model name.
    """
    if metrics is not None and metrics.model_name != model_name:
        raise ValueError(f"metrics label their series model_name={metrics.model_name!r}, but "
                         f"this app serves {model_name!r}: make ServerMetrics(engine, "
                         f"{model_name!r})")
    api = _Api(engine, model_name, aliases or set(), kv_connector, metrics)
    if log_requests:  # --enable-log-requests: a line per request received and finished
        api.log = api.metrics.request_log = _print_line
    from kthena_serve import __version__

    app = FastAPI(title="kthena serve", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")  # the real schema, for clients and fuzzers
    app.state.api = api
    install_handlers(app)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    app.get("/v1/models")(api.models)
    add_plan_route(app, api.metrics, deployment)

    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return JSONResponse(error_body(503, "engine is not running"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_api_middleware(app, api_key=api_key, public_metrics=public_metrics,
                       max_request_bytes=max_request_bytes)
    return app


def add_api_middleware(app: FastAPI, *, api_key: str | None, public_metrics: bool,
                       max_request_bytes: int) -> None:
    """The middleware stack of a public OpenAI app (``kthena serve``'s, the DP router's), inner
    to outer: body limit (413), API key (401; /health and, with ``public_metrics``, /metrics
    open), drain (503 while shutting down: a draining server refuses before anything else)."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key,
                           open_paths=public_paths(public_metrics=public_metrics))
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
