"""The router's OpenAI front: the unchanged server app over a ``RemoteEngine``.

``RemoteEngine`` is the PD implementation of ``EngineClient``: it validates with the same
``InputProcessor`` as the in-process engine (limits from the decode workers' own reports),
asks the ``Router`` for workers, and streams the decode worker's NDJSON outputs; times are
re-stamped here, on the client's side of the wire. Its stats are the sum of what the workers
measured and reported in their last ``/pd/state``.

Overload: the router is the admission point of a PD deployment. A prompt takes one of two
paths whose speeds differ by an order of magnitude: a prefill worker (``disaggregated``) or the
decode worker's own core between its decode steps (``local``: a short uncached part, or no
prefill worker). So the router keeps one ``AdmissionGate`` (admission.py) per path, with the
workers' ``EngineConfig`` bounds, over every request it sent that way and has not seen a first
token of; the path is the router's own pick (``Router.preview``) at admission, each gate's rate
and error are measured here (admission to first token), starting from the reported rates of
the workers on that path (prefill workers, or decode workers), never above the start-up rate
(``startup_rate``: the calibrated seed's, scaled to a worker's cores), divided by
``COLD_MARGIN`` until the gate has seen a first token (admission.py). A request still without a first token ``--max-queue-delay`` seconds after
its admission is refused then (the gate's ``first_token_by`` / ``timed_out``: the 503
``queue_timeout`` colocated gives; its queue place is given back and closing its stream aborts
it on the decode worker). Decode
workers do not check ``/pd/generate`` again (a refusal there would come after this router's 200
went out); one that answers 503 ``overloaded`` all the same (a worker that is not this
deployment's) is passed on as ``OverloadedError``: the app's 503 with the worker's
``Retry-After`` (a streamed answer's headers wait for its first output, so this is a status in
streams too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence

import attrs
import httpx
from fastapi import FastAPI

from kthena_serve.cluster.auth import auth_headers
from kthena_serve.cluster.router import Decision, Router
from kthena_serve.engine.admission import (
    COLD_MARGIN,
    AdmissionGate,
    AdmissionLimits,
    KVOutlook,
    QueueLoad,
)
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
)
from kthena_serve.engine.input_processor import EngineLimits, InputProcessor
from kthena_serve.engine.request import EngineRequest, RequestOutput
from kthena_serve.engine.stats import EngineStats
from kthena_serve.pd.protocol import output_from_json, params_to_json
from kthena_serve.server.errors import OVERLOADED

__all__ = ["DISAGGREGATED", "LOCAL", "PATHS", "RemoteEngine", "build_router_app"]

DISAGGREGATED, LOCAL = "disaggregated", "local"  # a prompt's path: a prefill worker, or not
PATHS = (DISAGGREGATED, LOCAL)
_MAX_PATHS_KEPT = 4096


class RemoteEngine:
    """``EngineClient`` over PD workers, through a ``Router``.

    Args:
        router: the started router (its last poll of each worker is what this reads).
        tokenizer: the model's tokenizer (the router tokenises; workers get token ids).
        config: the workers' engine config.
        model_limits: (max_position_embeddings, vocab_size) of the model, used until a
            decode worker has reported its own limits.
        secret: the deployment secret sent to decode workers (``PDLauncher.secret``).
        startup_rate: prompt tokens/s the gates assume before anything is measured
            (``admission.startup_rate``; None: the workers' reports alone).
    """

    def __init__(self, router: Router, tokenizer, config: EngineConfig,  # noqa: ANN001
                 model_limits: tuple[int, int], *, secret: str | None = None,
                 startup_rate: float | None = None) -> None:
        self.router = router
        self._headers = auth_headers(secret)
        self.tokenizer = tokenizer
        self.config = config
        self._model_limits = model_limits
        self._startup_rate = startup_rate
        self._processor = InputProcessor(tokenizer, self._limits, config.chat_special_tokens)
        self._client: httpx.AsyncClient | None = None
        self._closing: str | None = None  # set by abort_all: the server is shutting down
        limits = AdmissionLimits.of(config)
        self.admission = {path: AdmissionGate(limits, cold_margin=COLD_MARGIN)
                          for path in PATHS}  # path -> its gate
        # request id -> (its path, the router's pick at admission, None without a decode
        # worker): generate routes by that pick instead of hashing the prompt again
        self._admitted: dict[str, tuple[str, Decision | None]] = {}

    @classmethod
    def for_model(cls, router: Router, config: EngineConfig, tokenizer=None, *,  # noqa: ANN001
                  secret: str | None = None, startup_rate: float | None = None) -> RemoteEngine:
        """Read the model's limits (and tokenizer, unless given) from ``config.model``."""
        from kthena_serve.model import ModelConfig, Tokenizer, resolve_checkpoint

        folder = resolve_checkpoint(config.model)
        model = ModelConfig.from_pretrained(folder)
        return cls(router, tokenizer or Tokenizer.from_pretrained(folder), config,
                   (model.max_position_embeddings, model.shape.vocab_size), secret=secret,
                   startup_rate=startup_rate)

    @property
    def is_alive(self) -> bool:
        return bool(self.router.up("decode"))

    # ---- EngineClient: validation (same code as in process) --------------------------------------
    @property
    def processor(self) -> InputProcessor:
        """Tokenise and check as a decode worker would, against the workers' limits."""
        return self._processor

    def _limits(self) -> EngineLimits:
        """The decode workers' limits combined; the model's until one has reported."""
        reported = [EngineLimits(**w.limits) for w in self._decodes() if w.limits]
        if reported:  # prompts run on the prefill workers: no prompt logprobs
            return attrs.evolve(EngineLimits.combine(reported), prompt_logprobs=False)
        max_len, vocab = self._model_limits
        return EngineLimits.for_engine(self.config, max_position_embeddings=max_len,
                                       vocab_size=vocab)

    def stats(self) -> EngineStats:
        """Counters summed over every worker; queue and KV summed over the decode workers; the
        admission queue is the router's own (what its refusals are decided on)."""
        workers = [w for w in self.router.workers.values() if w.stats]
        parts = [EngineStats.from_json(w.stats) for w in workers]
        decodes = [p for p, w in zip(parts, workers, strict=True) if w.role == "decode"]
        total = EngineStats.total(parts, self.config.block_size, kv_from=decodes)
        queue = QueueLoad.total([gate.load(self._prior_rate(path))
                                 for path, gate in self.admission.items()])
        return attrs.evolve(total, queue=queue)

    def _prior_rate(self, path: str) -> float | None:
        """The reported rates of the workers on ``path`` summed (prefill workers for
        ``disaggregated``, else decode workers; decode workers when no prefill worker
        reported one), at most the start-up rate: a gate's rate before it measures."""
        def summed(role: str) -> float | None:
            loads = [QueueLoad.from_json(w.stats.get("queue")) for w in self.router.up(role)
                     if w.stats]
            rates = [q.prefill_tokens_per_s for q in loads
                     if q is not None and q.prefill_tokens_per_s is not None]
            return sum(rates) if rates else None

        rate = summed("prefill") if path == DISAGGREGATED else None
        rate = rate if rate is not None else summed("decode")
        known = [r for r in (rate, self._startup_rate) if r is not None]
        return min(known) if known else None

    def _kv_outlook(self) -> KVOutlook | None:
        """The decode workers' pools as one outlook (every prompt ends up in one of them):
        their reported free blocks, demand and release rates summed, plus the blocks of what
        this router has queued on either path (some of which a worker counts already: the
        demand errs high); None before a decode worker reported one."""
        loads = [QueueLoad.from_json(w.stats.get("queue")) for w in self.router.up("decode")
                 if w.stats]
        kvs = [q.kv for q in loads if q is not None and q.kv is not None]
        if not kvs:
            return None
        size, out = kvs[0].block_size, max(k.out_blocks for k in kvs)
        rates = [k.release_blocks_per_s for k in kvs if k.release_blocks_per_s is not None]
        queued = [gate.load() for gate in self.admission.values()]
        extra = sum(-(-q.num_tokens // size) + q.num_requests * out for q in queued)
        return KVOutlook(sum(k.free_blocks for k in kvs), sum(k.demand_blocks for k in kvs) + extra,
                         sum(rates) if rates else None, size, out)

    def _pick(self, request: EngineRequest) -> tuple[str, Decision | None]:
        """(path, the router's pick now, counting nothing); None: no decode worker is up."""
        try:
            decision = self.router.preview(list(request.prompt_ids), request.cache_salt)
        except LookupError:
            return LOCAL, None  # generate says so
        return (DISAGGREGATED if decision.prefill is not None else LOCAL), decision

    def check_admission(self, requests: Sequence[EngineRequest]) -> None:
        """Queue one API call's requests at the router, each on its path's gate, or refuse
        them all when any path is past its bound.

        Raises:
            OverloadedError: a path's queue is past its bound.
        """
        picks = {r.request_id: self._pick(r) for r in requests}
        by_path: dict[str, list[EngineRequest]] = {}
        for request in requests:
            by_path.setdefault(picks[request.request_id][0], []).append(request)
        admitted: list[tuple[str, EngineRequest]] = []
        kv = self._kv_outlook()
        for path, group in by_path.items():
            refusal = self.admission[path].try_admit(
                [(r.request_id, len(r.prompt_ids)) for r in group], self._prior_rate(path), kv)
            if refusal is not None:
                for done_path, request in admitted:  # all of the call or none of it
                    self.admission[done_path].forget(request.request_id)
                    self._admitted.pop(request.request_id, None)
                raise refusal.error()
            for request in group:
                self._admitted[request.request_id] = picks[request.request_id]
                admitted.append((path, request))
        while len(self._admitted) > _MAX_PATHS_KEPT:  # admitted, then never streamed (a 400)
            self._admitted.pop(next(iter(self._admitted)))

    def abort(self, request_id: str) -> None:
        """An admitted request that never streamed gives its place on its path's queue back;
        a streaming one is aborted on the decode worker by closing its stream."""
        admitted = self._admitted.pop(request_id, None)
        if admitted is not None:
            self.admission[admitted[0]].forget(request_id)

    def abort_all(self, message: str) -> None:
        """End every stream at its next line (closing it aborts the request on the worker)."""
        self._closing = message

    def _decodes(self) -> list:
        return [w for w in self.router.workers.values() if w.role == "decode"]

    # ---- EngineClient: generation ---------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=2.0),
                                             headers=self._headers)
        return self._client

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request from a decode worker; it is queued (admission) until its first
        token. Leaving early closes the worker's stream, which aborts it there."""
        path, decision = self._admitted.pop(request.request_id, None) or self._pick(request)
        gate = self.admission[path]
        deadline = gate.first_token_by(request.request_id)  # None: not admitted, or no bound
        gate.claim(request.request_id, len(request.prompt_ids))
        queued = True
        try:
            async with contextlib.aclosing(self._generate(request, decision)) as outputs:
                while True:
                    try:
                        out = await _next(outputs, deadline if queued else None)
                    except StopAsyncIteration:
                        return
                    except TimeoutError:  # no first token in the bound: the stream closes
                        raise gate.timed_out(request.request_id,
                                             waited_for="first_token") from None
                    if queued and out.token_ids:
                        gate.started(request.request_id)
                        queued = False
                    yield out
        finally:
            gate.forget(request.request_id)

    async def _generate(self, request: EngineRequest, decision: Decision | None
                        ) -> AsyncIterator[RequestOutput]:
        if decision is None:
            try:
                decision = self.router.choose(list(request.prompt_ids), request.cache_salt)
            except LookupError as error:
                raise EngineDeadError(f"no worker can take the request: {error}") from None
        else:
            self.router.metrics.decision(decision.reason)
        decode = decision.decode
        body = {"request_id": request.request_id, "prompt_ids": list(request.prompt_ids),
                "params": params_to_json(request.params), "cache_salt": request.cache_salt,
                "prefill_url": decision.prefill.url if decision.prefill else None}
        arrival, first, logprobs = time.perf_counter(), None, None
        try:
            async with self._http().stream("POST", f"{decode.url}/pd/generate", json=body) as r:
                if r.status_code != 200:
                    message = (await r.aread()).decode(errors="replace")[:500]
                    if r.status_code == 400:
                        raise InvalidRequestError(_message(message))
                    if r.status_code == 503 and _code(message) == OVERLOADED:
                        raise OverloadedError(_message(message),
                                              _retry_after(r.headers.get("retry-after")),
                                              "worker")
                    raise EngineDeadError(f"decode worker {decode.name}: {_message(message)}")
                async for line in r.aiter_lines():
                    if self._closing is not None:
                        raise EngineDeadError(self._closing)
                    if not line:
                        continue
                    item = json.loads(line)
                    if "error" in item:
                        message = item["error"]["message"]
                        if item["error"].get("code") == "kv_handoff_failed" and decision.prefill:
                            # Passive health: stop routing to the prefill worker until a poll
                            # of its (possibly restarted) process says it is up again.
                            self.router.mark_down(decision.prefill.name)
                            raise EngineDeadError(f"the KV hand-off from {decision.prefill.name}"
                                                  f" to {decode.name} failed: {message}")
                        if item["error"].get("code") == "request_failed":
                            raise RequestFailedError(message)
                        raise EngineDeadError(message)
                    out = output_from_json(item["output"], logprobs)
                    logprobs = out.logprobs
                    now = time.perf_counter()
                    first = first or (now if out.token_ids else None)
                    out = attrs.evolve(out, arrival_time=arrival, first_token_time=first,
                                       finish_time=now if out.finished else None)
                    yield out
                    if out.finished:
                        return
        except httpx.TransportError as error:
            self.router.mark_down(decode.name)
            raise EngineDeadError(f"decode worker {decode.name} failed mid-request "
                                  f"({type(error).__name__}); retry the request") from None
        raise EngineDeadError(f"decode worker {decode.name} ended the stream early")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def _next(outputs: AsyncIterator[RequestOutput], deadline: float | None) -> RequestOutput:
    """The next output, waiting until ``deadline`` (``time.monotonic``; None: no limit).

    Raises:
        StopAsyncIteration: the outputs ended.
        TimeoutError: the deadline passed first (the pending read is cancelled).
    """
    if deadline is None:
        return await anext(outputs)
    return await asyncio.wait_for(anext(outputs), max(0.0, deadline - time.monotonic()))


def _code(text: str) -> str | None:
    try:
        return json.loads(text)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _retry_after(header: str | None) -> int:
    """A worker's ``Retry-After`` as it sent it (whole seconds; 1 if missing or unreadable)."""
    try:
        return max(1, int(header or "1"))
    except ValueError:
        return 1


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text


class _Forward:
    """Collector that yields another registry's metrics (router metrics on the app's /metrics)."""

    def __init__(self, registry) -> None:  # noqa: ANN001
        self.registry = registry

    def collect(self):  # noqa: ANN201
        yield from self.registry.collect()


def build_router_app(remote: RemoteEngine, *, model_name: str, aliases: set[str] | None = None,
                     api_key: str | None = None, public_metrics: bool = False,
                     deployment: dict | None = None, tool_call_parser: str = "hermes",
                     disable_any_whitespace: bool = True) -> FastAPI:
    """The OpenAI app over the cluster, plus ``GET /pd/workers``.

    Args:
        public_metrics: /metrics needs no API key (/pd/workers and /v1/* still do).
        tool_call_parser: ``--tool-call-parser``: the router renders tools, constrains and
            parses chat output (the workers see token ids and sampling parameters only).
        disable_any_whitespace: ``--structured-outputs-config``'s, filled in here (the
            workers compile the constraint as the router sent it).
    """
    from kthena_serve.server import build_app

    app = build_app(remote, model_name=model_name, aliases=aliases, api_key=api_key,
                    public_metrics=public_metrics, deployment=deployment,
                    tool_call_parser=tool_call_parser,
                    disable_any_whitespace=disable_any_whitespace)
    app.state.api.metrics.registry.register(_Forward(remote.router.metrics.registry))

    @app.get("/pd/workers")
    async def workers() -> dict:
        return {name: {"role": w.role, "url": w.url, "up": w.is_up, "load": w.load,
                       "kv_usage": w.kv_usage}
                for name, w in remote.router.workers.items()}

    return app
