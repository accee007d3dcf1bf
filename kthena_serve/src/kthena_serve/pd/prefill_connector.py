"""The prefill worker's OpenAI side: one-token answers, and prefills a decode worker pulls.

The prefill worker serves the plain OpenAI app (``server.build_app``) over ``PrefillEngine``,
so the Kthena router's ``nixl`` / ``mooncake`` connectors can call it as they call vLLM::

    POST /v1/completions | /v1/chat/completions  (max_tokens 1: the router sets it)
      no kv_transfer_params          prefill into the own pool, answer the first token, free
      {"do_remote_decode": true}     the same, but the prompt's blocks stay pinned (pins.py)
                                     and the answer carries kv_transfer_params naming them
    decode worker ─ POST /pd/kv/lease, one-sided get, POST /pd/kv/release ─▶ control port

Every prefill is a job of the worker's ``PrefillExecutor``, batched with the other requests'
prefills (these and the ``/pd/prefill`` tasks) on its one compute thread; each answers as soon
as its own prefill is done. A prompt whose first token already ends it (EOS, a
stop string) pins nothing: its answer carries ``kv_transfer_params: null`` and the decode
worker simply computes it (vLLM's connectors hand over only length-capped prefills too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from kthena_serve.client import KVSession
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.errors import EngineDeadError, InvalidRequestError
from kthena_serve.engine.input_processor import EngineLimits, InputProcessor
from kthena_serve.engine.output_stream import OutputStream
from kthena_serve.engine.request import EngineRequest, FinishReason, RequestOutput
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.stats import EngineStats
from kthena_serve.model import IncrementalDetokenizer
from kthena_serve.pd.kv_params import (
    PARAM,
    KVAsk,
    check_prefill_tp_size,
    parse_kv_params,
    prefill_reply,
    prompt_digest,
)
from kthena_serve.pd.pins import Pin, PinTable
from kthena_serve.pd.prefill import ExecutorClosedError, OwnedPrefill, PrefillExecutor

__all__ = ["PrefillConnector", "PrefillEngine"]

_ONE_TOKEN = ("a prefill worker computes the prompt and samples its first token only: send "
              "max_tokens 1 (the Kthena router does), or send the request to a decode worker")


class _OneTokenProcessor(InputProcessor):
    """A prefill worker's input processor: what any engine refuses, and any budget but 1."""

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """The output budget, which must be one token here.

        Raises:
            InvalidRequestError: what any engine refuses, or a budget other than 1.
        """
        budget = super().check(prompt_ids, params)
        if budget != 1:
            raise InvalidRequestError(f"max_tokens={params.max_tokens}: {_ONE_TOKEN}",
                                      "max_tokens")
        return budget


class PrefillEngine:
    """``EngineClient`` of a prefill worker: every request is a prefill plus one token.

    Args:
        executor: the worker's executor, with its own pool (``own_pool``).
        tokenizer: the model's tokenizer.
        config: the engine config (limits, chat special tokens).
        pins: where pinned prefills wait for their decode worker.
    """

    def __init__(self, executor: PrefillExecutor, tokenizer, config: EngineConfig,  # noqa: ANN001
                 pins: PinTable) -> None:
        assert executor.pool is not None and executor.kv is not None, "needs its own pool"
        self.executor, self.tokenizer, self.pins = executor, tokenizer, pins
        model = executor.model.config
        self.processor = _OneTokenProcessor(tokenizer, EngineLimits.for_engine(
            config, max_position_embeddings=model.max_position_embeddings,
            vocab_size=model.shape.vocab_size, num_kv_blocks=executor.pool.layout.num_blocks),
            config.chat_special_tokens, executor.grammars)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self._closing: str | None = None

    # ---- EngineClient: validation ----------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._closing is None

    def check_admission(self, requests: Sequence[EngineRequest]) -> None:
        """Every prompt is admitted: a prefill worker's queue is bounded by its pool (a prompt
        that finds it full is a 503 at once); the bound on queued work (``--max-queue-delay``)
        is the decode workers' and the PD router's, which see each request to its first token."""

    # ---- EngineClient: generation -----------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Prefill, answer the first token, free the blocks."""
        out, _ = await self.prefill(request, pin=False)
        yield out

    async def prefill(self, request: EngineRequest, *, pin: bool,
                      ) -> tuple[RequestOutput, Pin | None]:
        """Prefill one prompt (batched with the others); with ``pin`` its blocks stay held
        (unless the first token ends the request), else they are freed.

        Raises:
            EngineDeadError: the worker is shutting down, or its pool has no room for the
                prompt now (the app answers 503: retry).
        """
        if self._closing is not None:
            raise EngineDeadError(self._closing)
        rid = request.request_id
        try:
            future = self.executor.submit_owned(rid, request.prompt_ids, request.params,
                                                request.cache_salt)
        except ExecutorClosedError as error:
            raise EngineDeadError(str(error)) from None
        try:
            owned = await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the client left: drop the job, or free what it holds
            self.executor.cancel(rid)
            future.add_done_callback(lambda done: self._drop(rid, done))
            raise
        except MemoryError as error:
            raise EngineDeadError(f"{error} ({len(self.pins)} prompts wait for their decode "
                                  "worker)") from None
        except ExecutorClosedError as error:  # closed while it waited
            raise EngineDeadError(str(error)) from None
        try:
            out = self._output(request, owned)
            if pin and out.finish_reason is FinishReason.LENGTH:
                logprobs = owned.logprobs.to_json() if owned.logprobs is not None else None
                return out, self.pins.add(rid, owned.block_ids, prompt_digest(request.prompt_ids),
                                          owned.token_id, logprobs)
        except BaseException:
            self._free(rid)
            raise
        freed = self._free(rid)
        if freed is not None:  # answered once the blocks are back (stats read right after)
            await asyncio.wrap_future(freed)
        return out, None

    def _free(self, rid: str) -> concurrent.futures.Future | None:
        """Free ``rid``'s blocks on the compute thread (None: it has shut down, pool too)."""
        try:
            return self.executor.call(self.executor.free, rid)
        except RuntimeError:
            return None

    def _drop(self, rid: str, future: concurrent.futures.Future) -> None:
        """A prefill whose client left finished anyway: give its blocks back."""
        if not future.cancelled() and future.exception() is None:
            self._free(rid)

    def _output(self, request: EngineRequest, owned: OwnedPrefill) -> RequestOutput:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_ids,
                                             request.params.skip_special_tokens)
        stream = OutputStream(detokenizer, request.params, self.eos_token_ids,
                              request.max_tokens)
        reason = stream.append(owned.token_id) or FinishReason.LENGTH
        now = time.perf_counter()
        wanted = request.params.logprobs is not None and owned.logprobs is not None
        return RequestOutput(
            request_id=request.request_id, new_token_ids=(owned.token_id,),
            new_text=stream.take_new_text(True), token_ids=(owned.token_id,), text=stream.text,
            finish_reason=reason, num_prompt_tokens=len(request.prompt_ids),
            num_cached_tokens=owned.num_cached_tokens, arrival_time=now - owned.compute_s,
            first_token_time=now, finish_time=now,
            logprobs=(owned.logprobs,) if wanted else None)

    def abort(self, request_id: str) -> None:
        """Drop the request's prefill at the next step boundary (its batch-mates go on)."""
        self.executor.cancel(request_id)

    def abort_all(self, message: str) -> None:
        """Refuse new prefills from now on (the worker is stopping)."""
        self._closing = message

    def stats(self) -> EngineStats:
        """Forward passes and prompt tokens computed, every prefill queued or running (the
        OpenAI routes' and the /pd/prefill tasks': one executor runs both), the own pool's KV and its offload tiers."""
        ex = self.executor
        num_waiting, num_running = ex.num_queued_running()
        return EngineStats(ex.num_steps, ex.num_computed_tokens, 0, 0, num_waiting,
                           num_running, ex.kv.stats(), kv_tiers=ex.kv_tier_stats())


class _PinnedPrefill:
    """One ``do_remote_decode`` request: prefill, pin, answer where the KV waits."""

    def __init__(self, connector: PrefillConnector) -> None:
        self.connector = connector
        self._params: dict[str, Any] | None = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        out, pin = await self.connector.engine.prefill(request, pin=True)
        if pin is not None:
            self._params = self.connector.reply(pin)
        yield out

    def response_params(self) -> dict[str, Any] | None:
        return self._params


class PrefillConnector:
    """``KVConnector`` of a prefill worker (see the module docs).

    Args:
        engine: the worker's ``PrefillEngine``.
        engine_id: this worker incarnation's id (``remote_engine_id``).
        host: the address decode workers reach this worker at (``remote_host``).
        port: its port (``remote_port``); 0 until ``set_port`` once the server listens.
        tp: this worker's TP size (``tp_size``; its ranks' pools hold the pinned blocks' heads).
    """

    def __init__(self, engine: PrefillEngine, engine_id: str, host: str, port: int = 0, *,
                 tp: int = 1) -> None:
        self.engine, self.engine_id, self.host, self.port = engine, engine_id, host, port
        self.tp = tp

    def set_port(self, port: int) -> None:
        self.port = port

    async def open(self, params: Mapping[str, Any], request: EngineRequest, *,
                   stream: bool) -> KVSession | None:
        """Raises InvalidRequestError for a decode ask, a stream, or a ``tp_size`` other than
        this worker's (the app answers 400)."""
        ask, _ = parse_kv_params(params)
        if ask is KVAsk.NONE:
            return None
        if ask is KVAsk.REMOTE_PREFILL:
            raise InvalidRequestError(f"{PARAM}: do_remote_prefill asks for a decode, and this "
                                      "is a prefill worker; send it to a decode worker", PARAM)
        check_prefill_tp_size(params, self.tp)
        if stream:
            raise InvalidRequestError(f"{PARAM}: a prefill for a remote decode answers one "
                                      "JSON object; leave out stream (the Kthena router "
                                      "removes it)", "stream")
        return _PinnedPrefill(self)

    def reply(self, pin: Pin) -> dict[str, Any]:
        return prefill_reply(self.engine_id, pin.transfer_id, pin.block_ids, self.host,
                             self.port, self.tp)
