"""AsyncLLM: the engine on a background thread, with one asyncio stream per request.

::

    asyncio (server)                           engine thread
    generate() ── inbox.append(Add) ─────────▶ drain inbox → engine.add
       await queue.get() ◀── call_soon_threadsafe(dispatch) ◀── engine.step() outputs
    client gone → finally: abort(id) ─ Abort ▶ engine.abort_request → blocks freed

Backpressure: each stream counts the outputs handed to it and the outputs its consumer took.
When a consumer falls ``max_stream_lead`` outputs behind (its client stopped reading, so the
server's ``send`` waits on a full socket), the engine pauses that request: it keeps its seat and
blocks but takes no decode step, so no tokens pile up for a reader that does not read. It
resumes once the consumer is halfway caught up; a request paused for ``stall_timeout`` seconds
is aborted and its blocks freed (its stream ends with ``RequestFailedError``).

Only the engine thread touches the engine (and so the KV manager); other threads talk to it
through the inbox of typed commands (``Add``, ``Abort``, and for PD decode ``Reserve``,
``SettleReserved``, ``AdmitPrefilled``, ``Release``). Validation (tokenising, length checks) runs in the caller,
once, through the engine's ``InputProcessor``, so a bad request fails before any streaming.
``AsyncLLM`` is the in-process ``EngineClient``.

Admission (``check_admission``, admission.py): each request is queued in an ``AdmissionGate``
from admission (or its stream's start, or a PD ``reserve``) until its first output reaches its
stream, and the gate refuses an API call past ``EngineConfig.max_queue_delay_s`` /
``max_queued_tokens`` before anything is submitted. The engine thread publishes the step cost
model's prefill capacity after every step: the gate's prior rate. An admitted request that
has not started computing by its gate's ``start_by`` is taken out of the engine's waiting queue
by the engine thread and its stream fails with the gate's ``timed_out`` refusal
(``OverloadedError``, limit ``queue_timeout``), so the bound holds for the requests served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs

from kthena_serve.engine import LLMEngine
from kthena_serve.engine.admission import AdmissionLimits
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.errors import EngineDeadError, RequestFailedError
from kthena_serve.engine.input_processor import InputProcessor
from kthena_serve.engine.logprobs import TokenLogprobs
from kthena_serve.engine.request import EngineRequest, RequestOutput
from kthena_serve.engine.scheduled import Reservation
from kthena_serve.engine.stats import EngineStats
from kthena_serve.stream_front import (
    MAX_STREAM_LEAD,
    STALL_TIMEOUT_S,
    STALLED_MESSAGE,
    StreamFront,
    _Stream,
    step_or_fail,
    take_late,
)
from mooncake_kv import KVCacheManager

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
class SettleReserved:
    request_id: str
    future: concurrent.futures.Future

    def run(self, llm: AsyncLLM) -> None:
        _settle(self.future, lambda: llm.engine.settle_reserved(self.request_id))


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


def _settle(future: concurrent.futures.Future, fn: Callable[[], object]) -> None:
    try:
        future.set_result(fn())
    except Exception as error:  # noqa: BLE001 - handed to the awaiting caller
        future.set_exception(error)


class AsyncLLM(StreamFront):
    """Async front of an ``LLMEngine`` (see module docs). Use ``start()`` / ``shutdown()``."""

    def __init__(self, engine: LLMEngine, *, max_stream_lead: int = MAX_STREAM_LEAD,
                 stall_timeout: float | None = STALL_TIMEOUT_S) -> None:
        super().__init__(AdmissionLimits.of(engine.config), max_stream_lead=max_stream_lead,
                         stall_timeout=stall_timeout)
        self.engine = engine
        self._inbox: deque = deque()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()
        # (seconds idle so far, when the current idle wait began or None): one tuple, so
        # stats() on another thread reads a consistent pair
        self._idle: tuple[float, float | None] = (0.0, None)
        self._capacity = engine.prefill_capacity()  # written by the engine thread
        self._kv_outlook = engine.kv_outlook()  # and these two
        # request id -> when it must have started (admission.py ``start_by``); written on the
        # event loop, read and dropped on the engine thread (single dict operations)
        self._start_by: dict[str, float] = {}

    @classmethod
    def from_config(cls, config: EngineConfig, **options: Any) -> AsyncLLM:
        return cls(LLMEngine.from_config(config), **options)

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
    @property
    def processor(self) -> InputProcessor:
        """The engine's input processor (tokenise, check; safe from any thread)."""
        return self.engine.processor

    # ---- PD decode verbs (any thread) ---------------------------------------------------------------
    async def reserve(self, request: EngineRequest) -> Reservation | None:
        """Hold blocks for a prompt a prefill worker will fill; None if the pool is full now.
        It is queued (admission) until its first output or ``release``."""
        self.admission.claim(request.request_id, len(request.prompt_ids))
        try:
            reservation = await self._call(lambda future: Reserve(request, future))
        except BaseException:
            self.admission.forget(request.request_id)
            raise
        if reservation is None or not reservation.num_promoting_blocks:
            return reservation
        rid = request.request_id
        try:  # blocks coming up from the offload tiers: wait off the engine thread
            await asyncio.to_thread(self.engine.wait_reserved, rid)
            return await self._call(lambda future: SettleReserved(rid, future))
        except BaseException:  # the caller left: give the blocks back (promotion ended first)
            self.admission.forget(rid)
            if self.is_alive:
                self._submit(Release(rid, concurrent.futures.Future()))
            raise

    async def release(self, request_id: str) -> bool:
        """Give back a reservation that will not be admitted."""
        self.admission.forget(request_id)
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

    async def _call(self, make: Callable[[concurrent.futures.Future], object]) -> Any:
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(make(future))
        return await asyncio.wrap_future(future)

    @property
    def kv_cache(self) -> KVCacheManager:
        """The engine's KV manager, for the verbs any thread may call (``subscribe``,
        ``unsubscribe``, ``snapshot``, ``stats``); mutating verbs belong to the engine thread."""
        return self.engine.kv

    def stats(self) -> EngineStats:
        """The engine thread's last counters with a fresh KV and tier snapshot, the
        admission queue and the idle time up to now (never blocks)."""
        idle_s, since = self._idle
        if since is not None:
            idle_s += time.perf_counter() - since
        return attrs.evolve(self._stats, kv=self.engine.kv.stats(),
                            kv_tiers=self.engine.kv_tier_stats(),
                            queue=self.admission.load(self._capacity, self._kv_outlook,
                                                      self._slowdown),
                            step_times=attrs.evolve(self._stats.step_times, idle_s=idle_s))

    def _submit(self, command: object) -> None:
        self._inbox.append(command)
        self._wakeup.set()

    def _add_command(self, request: EngineRequest, start_by: float | None) -> object:
        if start_by is not None:
            self._start_by[request.request_id] = start_by
        return Add(request)

    def _abort_command(self, request_id: str) -> object:
        return Abort(request_id)

    def _abort_all_command(self, message: str) -> object:
        return AbortAll(message)

    def _caught_up(self, request_id: str, state: _Stream) -> None:
        self._wakeup.set()  # the engine thread resumes the request

    def _streamed(self, request_id: str) -> None:
        self._start_by.pop(request_id, None)

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._drain_inbox()
            num_paused = self._apply_backpressure()
            if not engine.has_runnable_requests():
                self._stats = engine.stats()
                self._idle = (self._idle[0], time.perf_counter())
                # paused streams: look again now and then for the stall timeout
                self._wakeup.wait(timeout=1.0 if num_paused else None)
                self._wakeup.clear()
                idle_s, since = self._idle
                self._idle = (idle_s + time.perf_counter() - since, None)
                continue
            outputs = step_or_fail(engine, self._fail_all)
            if outputs is None:
                continue
            self._stats = engine.stats()
            self._capacity = engine.prefill_capacity()
            self._kv_outlook = engine.kv_outlook()
            self._slowdown = engine.prefill_slowdown(self.admission.num_queued)
            self._dispatch(outputs)
            self._refuse_late()  # after a step: each request had a chance to start
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine.close()  # on the owner thread: the KV manager allows no other

    def _drain_inbox(self) -> None:
        while self._inbox:
            self._inbox.popleft().run(self)

    def _refuse_late(self) -> None:
        """Refuse the admitted requests still waiting to start past their ``start_by``."""
        for request_id in take_late(self.engine, self._start_by):
            self._dispatch([self.admission.timed_out(request_id)], request_id)

    def _apply_backpressure(self) -> int:
        """Pause requests whose consumers fell behind, resume those that caught up, abort
        those stalled past the timeout; returns how many stay paused."""
        now = time.monotonic()
        num_paused = 0
        for request_id, state in list(self._queues.items()):
            lead = state.sent - state.taken
            if state.paused_since is None:
                if lead >= self.max_stream_lead and self.engine.pause(request_id):
                    state.paused_since = now
                    num_paused += 1
            elif lead <= self.max_stream_lead // 2:
                self.engine.resume(request_id)
                state.paused_since = None
            elif self.stall_timeout is not None and now - state.paused_since > self.stall_timeout:
                log.warning("request %s: its client read nothing for %.0f s; aborting it",
                            request_id, now - state.paused_since)
                self.engine.abort_request(request_id)
                self.num_stalled += 1
                state.paused_since = None
                self._dispatch([RequestFailedError(STALLED_MESSAGE)], request_id)
            else:
                num_paused += 1
        return num_paused

    def _fail_all(self, error: EngineDeadError) -> None:
        """End every live request with ``error`` (a message for clients: no internals)."""
        for request_id in self.engine.live_request_ids():
            self.engine.abort_request(request_id)
            self._dispatch([error], request_id)
        self._stats = self.engine.stats()
