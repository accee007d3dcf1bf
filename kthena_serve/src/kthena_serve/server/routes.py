"""The OpenAI routes' bodies over an ``EngineClient`` (``OpenAIRoutes``; ``build_app`` mounts
them): /v1/completions and /v1/chat/completions, /v1/models, and vLLM's /tokenize and
/detokenize. A generation request is checked (model, ``n``, refused fields), tokenised and
length-checked into a ``Job`` (a field set to a value this server ignores is logged as a
warning, as vLLM logs them), its output constraint compiled, then admitted (or refused with
503 past the queue bound) before anything streams; its answer is one JSON body or an SSE stream
(streaming.py) whose headers wait for the first output. A client that goes away cancels the
job (499), which aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kthena_serve.client import EngineClient, KVConnector
from kthena_serve.engine.errors import OverloadedError
from kthena_serve.engine.logprobs import TokenLogprobs
from kthena_serve.engine.request import FinishReason, RequestOutput
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.model.errors import ChatTemplateError
from kthena_serve.server import protocol as p
from kthena_serve.server.errors import ApiError
from kthena_serve.server.generation import Job, collect, stream_choices
from kthena_serve.server.logprobs import (
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    vllm_prompt_logprobs,
)
from kthena_serve.server.metrics import ServerMetrics
from kthena_serve.server.responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    usage,
    usage_chunk,
    with_running_usage,
    with_token_ids,
)
from kthena_serve.server.streaming import (
    PendingLogprobs,
    TokenIdDeltas,
    ToolDeltas,
    after_head,
    max_tool_calls,
    sse_response,
)
from kthena_serve.server.tokenization import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)
from kthena_serve.server.tool_parsers import DEFAULT_PARSER, check_parser_name
from kthena_serve.server.tools import chat_inputs, check_tool_format, parse_tool_calls, tool_params

__all__ = ["MAX_PROMPTS", "OpenAIRoutes"]

MAX_PROMPTS = 64
T = TypeVar("T")
log = logging.getLogger(__name__)


class OpenAIRoutes:
    """The route bodies of one app (``build_app``), over its engine and metrics; chat output
    is parsed for tool calls by the ``tool_call_parser`` named (``--tool-call-parser``).

    Raises:
        ValueError: ``tool_call_parser`` names no parser (the message lists them).
    """

    def __init__(self, engine: EngineClient, model_name: str, aliases: set[str],
                 kv_connector: KVConnector | None = None,
                 metrics: ServerMetrics | None = None, *,
                 tool_call_parser: str = DEFAULT_PARSER,
                 disable_any_whitespace: bool = True) -> None:
        self.tool_call_parser = check_parser_name(tool_call_parser)
        self.disable_any_whitespace = disable_any_whitespace
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

    def _check_common(self, body: p.RequestCommon) -> None:
        self._check_model(body.model)
        limit = self.engine.processor.limits.max_n
        if body.n > limit:
            raise ApiError(400, f"n={body.n} exceeds this server's limit of {limit}", "n")
        body.refuse_unsupported()
        _warn_ignored(body.ignored_fields())

    def _job(self, body: p.RequestCommon, prompts: list[list[int]], max_tokens: int | None) -> Job:
        try:
            params = body.sampling_params(max_tokens)
            if isinstance(body, p.ChatCompletionRequest):  # the constraint in the parser's form
                params = tool_params(params, body.tools, body.effective_tool_choice,
                                     body.parallel_tool_calls is not False,
                                     self.tool_call_parser)
            params = self._whitespace_default(params)
        except ValueError as error:
            raise ApiError(400, str(error), getattr(error, "param", None)) from None
        prepared = [self.engine.processor.prepare(ids, params) for ids in prompts]  # -> 400
        prompts = [ids for ids, _ in prepared]
        params = prepared[0][1] if prepared else params  # bad_words as token runs
        budgets = tuple(self.engine.processor.check(ids, params) for ids in prompts)  # invalid -> 400
        job = Job(new_id("req"), tuple(tuple(i) for i in prompts), budgets, params, body.n,
                   body.cache_salt)
        self.metrics.observe_prompts([len(i) for i in prompts], salted=bool(body.cache_salt),
                                     block_size=self.engine.processor.limits.block_size)
        if self.log is not None:
            self.log(f"received request {job.request_id}: {len(prompts)} prompt(s) of "
                     f"{', '.join(str(len(i)) for i in prompts)} tokens, n={job.n}, "
                     f"params: {params}")
        return job

    def _whitespace_default(self, params: SamplingParams) -> SamplingParams:
        """A JSON constraint that does not say whether whitespace is allowed gets the
        server's ``disable_any_whitespace`` (``--structured-outputs-config``), so the engine,
        a DP replica or a PD worker compiles what this server decided."""
        spec = params.structured_outputs
        if spec is None or spec.disable_any_whitespace is not None:
            return params
        return attrs.evolve(params, structured_outputs=attrs.evolve(
            spec, disable_any_whitespace=self.disable_any_whitespace))

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

    async def _compile_grammar(self, body: p.RequestCommon, job: Job) -> None:
        """Compile the output constraint off the event loop and the engine thread (a large
        schema takes a while), so a bad one is a 400 naming its field before anything runs;
        the engine's matchers come from the same cache."""
        if job.params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.processor.compile_grammar, job.params,
                                    body.constraint_param())

    def _check_kv(self, body: p.RequestCommon, job: Job) -> None:
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

    async def _open_kv(self, body: p.RequestCommon, job: Job) -> Job:
        """Hand ``kv_transfer_params`` (PD workers behind the Kthena router) to the connector
        before anything streams, so a refusal is a 400 (`_check_kv` passed before admission)."""
        if body.kv_transfer_params is None or self.kv_connector is None:
            return job
        session = await self.kv_connector.open(body.kv_transfer_params, job.engine_request(0),
                                               stream=body.stream)
        return job if session is None else attrs.evolve(job, kv=session)

    async def _run(self, body: p.RequestCommon, request: Request, kind: str,
                   prompts: Callable[[Any], list[list[int]]], max_tokens: int | None,
                   chunks: Callable[..., AsyncIterator[dict]],
                   ) -> Response | tuple[str, Job, list[RequestOutput]]:
        """Check ``body``, make its job of ``prompts(body)`` and compile its constraint; check
        ``kv_transfer_params``, admit the job, open its KV; then either the SSE response of its
        ``chunks`` (``body.stream``) or (response id ``kind-...``, job, final outputs)."""
        self._check_common(body)
        job = self._job(body, prompts(body), max_tokens)
        await self._compile_grammar(body, job)
        rid = new_id(kind, body.request_id)
        self._check_kv(body, job)
        with self._admitted(job):
            job = await self._open_kv(body, job)
            if body.stream:
                outputs = await self._started(job, request)
                return sse_response(chunks(rid, body, job, outputs))
            return rid, job, await self._collect(job, request, body.reuse_offset)

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
        if body.parses_tool_calls:
            check_tool_format(template, self.tool_call_parser)  # else a 400 naming tools
        messages, extra = chat_inputs(body.messages, body.tools, template)
        variables, ignored = body.template_variables(_template_reads(template))
        _warn_ignored(ignored)
        try:
            return [self.engine.processor.encode_chat(
                messages, add_generation_prompt=body.add_generation_prompt,
                add_special_tokens=body.add_special_tokens,
                continue_final_message=body.continue_final_message,
                template_kwargs={**variables, **(body.chat_template_kwargs or {}), **extra})]
        except ChatTemplateError as error:
            raise ApiError(400, str(error), "messages") from None

    # ---- routes -----------------------------------------------------------------------------
    async def completions(self, body: p.CompletionRequest, request: Request) -> Response:
        ran = await self._run(body, request, "cmpl", self._completion_prompts,
                              body.max_tokens_to_run, self._completion_chunks)
        if isinstance(ran, Response):
            return ran
        rid, job, finals = ran
        if body.is_echo_only:
            finals = [_prompt_only(o) for o in finals]
        usage_ = usage(finals, [job.prompt_index(c) for c in range(job.num_choices)])
        logprobs = [None if o.logprobs is None else self._completion_logprobs(
            body, job, c, o.logprobs, o.prompt_logprobs, TextOffsets())
            for c, o in enumerate(finals)]
        prompt_logprobs = None
        if body.prompt_logprobs is not None:
            prompt_logprobs = [vllm_prompt_logprobs(o.prompt_logprobs or (),
                                                      self.engine.processor.token_bytes,
                                                      body.prompt_logprobs) for o in finals]
        echoed = self._echo_texts(body, job) if body.echo else None
        answer = completion_response(rid, self.model_name, finals, usage_, logprobs, echoed,
                                     prompt_logprobs)
        if body.return_token_ids:
            for c, (choice, out) in enumerate(zip(answer["choices"], finals, strict=True)):
                with_token_ids(choice, out.token_ids, job.prompts[job.prompt_index(c)])
        return JSONResponse(_with_kv(answer, job))

    def _completion_logprobs(self, body: p.CompletionRequest, job: Job, choice: int,
                             entries: Sequence[TokenLogprobs],
                             prompt: Sequence[TokenLogprobs | None] | None,
                             offsets: TextOffsets) -> dict:
        """One choice's logprobs; with ``echo``, the prompt's tokens first."""
        ids = job.prompts[job.prompt_index(choice)]
        return completion_logprobs(
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
        ran = await self._run(body, request, "chatcmpl", self._chat_prompt,
                              body.max_completion_tokens or body.max_tokens, self._chat_chunks)
        if isinstance(ran, Response):
            return ran
        rid, job, finals = ran
        usage_ = usage(finals, [0] * len(finals))
        logprobs = [None if o.logprobs is None else
                    chat_logprobs(o.logprobs, self.engine.processor.token_bytes,
                                    body.return_tokens_as_token_ids) for o in finals]
        prompt_logprobs = None
        if body.prompt_logprobs is not None and finals:
            prompt_logprobs = vllm_prompt_logprobs(finals[0].prompt_logprobs or (),
                                                     self.engine.processor.token_bytes,
                                                     body.prompt_logprobs)
        calls = None
        if body.parses_tool_calls:
            calls = [parse_tool_calls(o.text, max_tool_calls(body), self.tool_call_parser)
                     for o in finals]
        answer = chat_response(rid, self.model_name, finals, usage_, logprobs, prompt_logprobs,
                               calls)
        echo = body.echo_text()
        for choice, out in zip(answer["choices"], finals, strict=True):
            if echo:
                choice["message"]["content"] = echo + (choice["message"]["content"] or "")
            if body.return_token_ids:
                with_token_ids(choice, out.token_ids)
        if body.return_token_ids:
            answer["prompt_token_ids"] = list(job.prompts[0])
        return JSONResponse(_with_kv(answer, job))

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
        return after_head(head, outputs)

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
        pending = PendingLogprobs()
        offsets: dict[int, TextOffsets] = {}
        echoes = dict(enumerate(self._echo_texts(body, job))) if body.echo else {}
        ids = TokenIdDeltas(job) if body.return_token_ids else None
        async with self._counting(job, finals):
            async for choice, out in outputs:
                if out.finished:
                    self.metrics.observe(out, body.reuse_offset)
                if body.is_echo_only:
                    out = _prompt_only(out)
                pending.add(choice, out)
                if out.finished:
                    finals[choice] = out
                echo = echoes.pop(choice, None)  # the prompt goes before the first output
                if out.new_text or out.finished or echo is not None:
                    logprobs = None
                    if out.logprobs is not None:
                        logprobs = self._completion_logprobs(
                            body, job, choice, pending.take(choice),
                            out.prompt_logprobs if echo is not None else None,
                            offsets.setdefault(choice, TextOffsets()))
                    chunk = completion_chunk(rid, self.model_name, choice, out, logprobs)
                    if echo is not None:
                        chunk["choices"][0]["text"] = echo + chunk["choices"][0]["text"]
                        if body.prompt_logprobs is not None:
                            chunk["choices"][0]["prompt_logprobs"] = vllm_prompt_logprobs(
                                out.prompt_logprobs or (), self.engine.processor.token_bytes,
                                body.prompt_logprobs)
                    yield _with_extras(chunk, choice, out, ids, body.continuous_usage,
                                       prompt_in_choice=True)
        if body.include_usage:
            outs = [finals[c] for c in sorted(finals)]
            usage_ = usage(outs, [job.prompt_index(c) for c in sorted(finals)])
            yield usage_chunk(rid, "text_completion", self.model_name, usage_)

    async def _chat_chunks(self, rid: str, body: p.ChatCompletionRequest, job: Job,
                           outputs: AsyncIterator[tuple[int, RequestOutput]]):
        echo = body.echo_text()
        for choice in range(job.num_choices):
            chunks = [chat_chunk(rid, self.model_name, choice,
                                 {"role": "assistant", "content": ""}, None)]
            if body.return_token_ids and choice == 0:  # vLLM's: in the first chunk
                chunks[0]["prompt_token_ids"] = list(job.prompts[0])
            if echo:
                chunks.append(chat_chunk(rid, self.model_name, choice, {"content": echo}, None))
            for chunk in chunks:
                if body.continuous_usage:
                    with_running_usage(chunk, len(job.prompts[job.prompt_index(choice)]), 0)
                yield chunk
        finals: dict[int, RequestOutput] = {}
        pending = PendingLogprobs()
        tools = ToolDeltas(body, self.tool_call_parser)
        ids = TokenIdDeltas(job) if body.return_token_ids else None
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
                        logprobs = chat_logprobs(pending.take(choice),
                                                   self.engine.processor.token_bytes,
                                                   body.return_tokens_as_token_ids)
                    chunk = chat_chunk(rid, self.model_name, choice, delta, reason, logprobs)
                    yield _with_extras(chunk, choice, out, ids, body.continuous_usage,
                                       prompt_in_choice=False)
        if body.include_usage:
            usage_ = usage([finals[c] for c in sorted(finals)], [0] * len(finals))
            yield usage_chunk(rid, "chat.completion.chunk", self.model_name, usage_)

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


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """``out`` without what it generated (``echo`` with ``max_tokens: 0``: the one token run for
    the prompt's logprobs is not answered); it ends for length, its budget of 0 spent."""
    reason = out.finish_reason
    if reason is not None and reason is not FinishReason.ABORT:
        reason = FinishReason.LENGTH
    return attrs.evolve(out, new_token_ids=(), new_text="", token_ids=(), text="",
                        logprobs=None if out.logprobs is None else (), finish_reason=reason)


@functools.lru_cache(maxsize=8)
def _template_reads(template: str | None) -> frozenset[str]:
    """The variables a chat template reads (none for a template jinja2 cannot parse: its
    rendering answers that)."""
    if not template:
        return frozenset()
    import jinja2
    import jinja2.meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


def _warn_ignored(fields: Sequence[tuple[str, Any, str]]) -> None:
    """A warning per field the request set to a value this server ignores (as vLLM logs)."""
    for name, value, why in fields:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        log.warning("request field %s=%s is ignored: %s", name, shown, why)


def _with_kv(response: dict, job: Job) -> dict:
    """A PD prefill answer carries ``kv_transfer_params`` (where its KV waits; null: nowhere)."""
    if job.kv is not None:
        response["kv_transfer_params"] = job.kv.response_params()
    return response


def _with_extras(chunk: dict, choice: int, out: RequestOutput, ids: TokenIdDeltas | None,
                 continuous_usage: bool, *, prompt_in_choice: bool) -> dict:
    """A stream chunk with vLLM's optional parts: token ids (``return_token_ids``; the
    prompt's in the choice for completions) and the running usage (``continuous_usage_stats``)."""
    if ids is not None:
        ids.add(chunk["choices"][0], choice, out, prompt_in_choice=prompt_in_choice)
    if continuous_usage:
        with_running_usage(chunk, out.num_prompt_tokens, len(out.token_ids))
    return chunk
