"""AsyncLLM: the engine on a background thread, with one asyncio stream per request.

::

    asyncio (server)                           engine thread
    generate() ── inbox.append(Add) ─────────▶ drain inbox → engine.add
       await queue.get() ◀── call_soon_threadsafe(dispatch) ◀── engine.step() outputs
    client gone → finally: abort(id) ─ Abort ▶ engine.abort_request → blocks freed

Only the engine thread touches the engine (and so the KV manager); other threads talk to it
through the inbox of typed commands (``Add``, ``Abort``, and for PD decode ``Reserve``,
``AdmitPrefilled``, ``Release``). Validation (tokenising, length checks) runs in the caller,
once, through the engine's ``InputProcessor``, so a bad request fails before any streaming.
``AsyncLLM`` is the in-process ``EngineClient``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs

from kthena_serve.client import EngineLimits, EngineStats
from kthena_serve.config import EngineConfig
from kthena_serve.engine import LLMEngine
from kthena_serve.errors import EngineDeadError, RequestFailedError
from kthena_serve.logprobs import TokenLogprobs
from kthena_serve.request import EngineRequest, RequestOutput
from kthena_serve.sampling_params import SamplingParams
from kthena_serve.scheduler import Reservation

__all__ = ["AsyncLLM"]

log = logging.getLogger(__name__)


# ---- inbox commands: each runs on the engine thread ----------------------------------------------
@attrs.frozen
class Add:
    request: EngineRequest

    def run(self, llm: AsyncLLM) -> None:
        try:
            llm.engine.add(self.request)
        except ValueError as error:  # a duplicate id: only this request fails
            llm._dispatch([error], self.request.request_id)


@attrs.frozen
class Abort:
    request_id: str

    def run(self, llm: AsyncLLM) -> None:
        llm.engine.abort_request(self.request_id)


@attrs.frozen
class AbortAll:
    message: str

    def run(self, llm: AsyncLLM) -> None:
        llm._fail_all(EngineDeadError(self.message))


@attrs.frozen
class Reserve:
    request: EngineRequest
    future: concurrent.futures.Future

    def run(self, llm: AsyncLLM) -> None:
        _settle(self.future, lambda: llm.engine.reserve(self.request))


@attrs.frozen
class AdmitPrefilled:
    request_id: str
    first_token_id: int
    logprobs: TokenLogprobs | None = None

    def run(self, llm: AsyncLLM) -> None:
        try:
            out = llm.engine.admit_prefilled(self.request_id, self.first_token_id, self.logprobs)
        except Exception as error:  # noqa: BLE001 - the reservation is gone: fail this one
            llm.engine.release(self.request_id)
            log.warning("request %s could not be admitted: %s", self.request_id, error)
            llm._dispatch([EngineDeadError("the prefilled request could not be admitted; "
                                           "retry it")], self.request_id)
            return
        llm._dispatch([out])


@attrs.frozen
class Release:
    request_id: str
    future: concurrent.futures.Future

    def run(self, llm: AsyncLLM) -> None:
        _settle(self.future, lambda: llm.engine.release(self.request_id))


def _settle(future: concurrent.futures.Future, fn) -> None:  # noqa: ANN001
    try:
        future.set_result(fn())
    except Exception as error:  # noqa: BLE001 - handed to the awaiting caller
        future.set_exception(error)


class AsyncLLM:
    """Async front of an ``LLMEngine`` (see module docs). Use ``start()`` / ``shutdown()``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: deque = deque()
        self._wakeup = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine.from_config(config))

    # ---- lifetime -----------------------------------------------------------------------------
    def start(self) -> AsyncLLM:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kthena-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- EngineClient (any thread) ----------------------------------------------------------------
    def limits(self) -> EngineLimits:
        return self.engine.processor.limits

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.engine.processor.encode(prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.engine.processor.encode_chat(messages)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """The output budget; raises InvalidRequestError for a request the engine would refuse."""
        return self.engine.processor.check(prompt_ids, params)

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.engine.tokenizer.token_bytes(token_ids)

    def make_request(self, request_id: str, prompt: str | Sequence[int],
                     params: SamplingParams | None = None, *,
                     cache_salt: str | None = None) -> EngineRequest:
        """Validate a request once (see ``InputProcessor.make_request``)."""
        return self.engine.processor.make_request(request_id, prompt, params,
                                                  cache_salt=cache_salt)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a validated request's outputs; leaving the loop early (or being cancelled)
        aborts it."""
        async with self._streaming(request.request_id, Add(request)) as stream:
            async for item in stream:
                yield item

    # ---- PD decode verbs (any thread) ---------------------------------------------------------------
    async def reserve(self, request: EngineRequest) -> Reservation | None:
        """Hold blocks for a prompt a prefill worker will fill; None if the pool is full now."""
        return await self._call(lambda future: Reserve(request, future))

    async def release(self, request_id: str) -> bool:
        """Give back a reservation that will not be admitted."""
        return await self._call(lambda future: Release(request_id, future))

    async def generate_prefilled(self, request_id: str, first_token_id: int,
                                 logprobs: TokenLogprobs | None = None,
                                 ) -> AsyncIterator[RequestOutput]:
        """Like ``generate``, for a reserved request whose prompt KV is written (``logprobs``:
        the first token's, when the request asked for them)."""
        command = AdmitPrefilled(request_id, first_token_id, logprobs)
        async with self._streaming(request_id, command) as s:
            async for item in s:
                yield item

    async def _call(self, make) -> Any:  # noqa: ANN001
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(make(future))
        return await asyncio.wrap_future(future)

    @contextlib.asynccontextmanager
    async def _streaming(self, request_id: str, command: object):  # noqa: ANN202
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._submit(command)
        # aclosing: a consumer that stops early (client gone) aborts the request right away.
        async with contextlib.aclosing(self._stream(request_id, queue)) as stream:
            yield stream

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(Abort(request_id))

    def abort_all(self, message: str) -> None:
        """End every live request now; each stream gets ``EngineDeadError(message)``."""
        self._submit(AbortAll(message))

    def stats(self) -> EngineStats:
        """The engine thread's last counters with a fresh KV snapshot (never blocks)."""
        return attrs.evolve(self._stats, kv=self.engine.kv.stats())

    def _submit(self, command: object) -> None:
        self._inbox.append(command)
        self._wakeup.set()

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._drain_inbox()
            if not engine.has_unfinished_requests():
                self._stats = engine.stats()
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception:  # a failed step must not hang any client (details: the log)
                log.exception("engine step failed")
                self._fail_all(EngineDeadError("the engine failed while serving this request; "
                                               "retry it"))
                continue
            self._stats = engine.stats()
            self._dispatch(outputs)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine.close()  # on the owner thread: the KV manager allows no other

    def _drain_inbox(self) -> None:
        while self._inbox:
            self._inbox.popleft().run(self)

    def _dispatch(self, outputs: list, request_id: str | None = None) -> None:
        """Hand outputs to their streams: one thread-safe call per event loop, not per item."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._queues.get(request_id or out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: EngineDeadError) -> None:
        """End every live request with ``error`` (a message for clients: no internals)."""
        for request_id in self.engine.live_request_ids():
            self.engine.abort_request(request_id)
            self._dispatch([error], request_id)
        self._stats = self.engine.stats()


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
