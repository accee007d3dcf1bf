"""StreamFront: what every engine front shares, without the engine (no torch is imported here).

The admission gate, one ``_Stream`` per request (an asyncio queue and its backpressure
counters) and the ``EngineClient`` verbs that only touch those. ``AsyncLLM`` (async_engine.py:
the engine on a thread of this process) and ``EngineCoreClient`` (engine_core.py: the engine in
a process of its own) are the two fronts; see their modules for how each reaches its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from kthena_serve.engine.admission import AdmissionGate, AdmissionLimits, KVOutlook
from kthena_serve.engine.errors import EngineDeadError, RequestFailedError
from kthena_serve.engine.request import EngineRequest, RequestOutput
from kthena_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kthena_serve.engine.input_processor import InputProcessor

__all__ = ["MAX_STREAM_LEAD", "STALLED_MESSAGE", "STALL_TIMEOUT_S", "STEP_FAILED",
           "StreamFront", "step_or_fail", "take_late"]

log = logging.getLogger(__name__)

MAX_STREAM_LEAD = 16  # outputs a consumer may fall behind before its request pauses
STALL_TIMEOUT_S = 120.0
STALLED_MESSAGE = ("the client read nothing for too long; the request was stopped "
                   "(read the stream as it arrives)")
# what a client hears when a step fails (no internals: those go to the log)
STEP_FAILED = "the engine failed while serving this request; retry it"


class _Stream:
    """One request's queue and its backpressure counters (``sent`` is written only on the
    thread that hands the engine's outputs over, ``taken`` only on the consumer's loop)."""

    __slots__ = ("loop", "paused_since", "queue", "sent", "taken")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop = loop
        self.queue = queue
        self.sent = 0
        self.taken = 0
        self.paused_since: float | None = None


class StreamFront:
    """What every engine front shares: the admission gate, one ``_Stream`` per request, and
    the verbs of ``EngineClient`` that only touch those (``AsyncLLM`` here, with the engine on
    a thread; ``EngineCoreClient`` in engine_core.py, with the engine in a process of its own).

    A front defines ``processor``, ``is_alive``, ``_submit`` (a command to the engine), the
    three commands (``_add_command``, ``_abort_command``, ``_abort_all_command``) and
    ``_caught_up`` (a paused request's consumer took enough to resume it).
    """

    def __init__(self, limits: AdmissionLimits, *, max_stream_lead: int,
                 stall_timeout: float | None) -> None:
        if max_stream_lead < 2:
            raise ValueError(f"max_stream_lead must be >= 2, got {max_stream_lead}")
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds or None, got {stall_timeout}")
        self.max_stream_lead = max_stream_lead
        self.stall_timeout = stall_timeout
        self.num_stalled = 0  # requests aborted because their reader stalled
        self._queues: dict[str, _Stream] = {}
        self.error: BaseException | None = None
        self.admission = AdmissionGate(limits)
        # the admission's inputs, as the engine last published them
        self._capacity: float | None = None
        self._kv_outlook: KVOutlook | None = None
        self._slowdown = 1.0

    @property
    def processor(self) -> InputProcessor:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def _submit(self, command: object) -> None:
        raise NotImplementedError

    def _add_command(self, request: EngineRequest, start_by: float | None) -> object:
        raise NotImplementedError

    def _abort_command(self, request_id: str) -> object:
        raise NotImplementedError

    def _abort_all_command(self, message: str) -> object:
        raise NotImplementedError

    def _caught_up(self, request_id: str, state: _Stream) -> None:
        raise NotImplementedError

    # ---- EngineClient (any thread) ----------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | Sequence[int],
                     params: SamplingParams | None = None, *,
                     cache_salt: str | None = None) -> EngineRequest:
        """Validate a request once (see ``InputProcessor.make_request``)."""
        return self.processor.make_request(request_id, prompt, params, cache_salt=cache_salt)

    def check_admission(self, requests: Sequence[EngineRequest]) -> None:
        """Queue one API call's requests, or refuse them all (see ``EngineClient``).

        Raises:
            OverloadedError: the queue is past its bound.
        """
        refusal = self.admission.try_admit([(r.request_id, len(r.prompt_ids)) for r in requests],
                                           self._capacity, self._kv_outlook, self._slowdown)
        if refusal is not None:
            raise refusal.error()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a validated request's outputs; leaving the loop early (or being cancelled)
        aborts it."""
        self.admission.claim(request.request_id, len(request.prompt_ids))
        start_by = self.admission.start_by(request.request_id)
        command = self._add_command(request, start_by)
        async with self._streaming(request.request_id, command) as stream:
            async for item in stream:
                yield item

    @contextlib.asynccontextmanager
    async def _streaming(self, request_id: str, command: object,
                         ) -> AsyncIterator[AsyncIterator[RequestOutput]]:
        try:
            if not self.is_alive:
                raise EngineDeadError("the engine is not running")
            state = _Stream(asyncio.get_running_loop(), asyncio.Queue())
            self._queues[request_id] = state
            self._submit(command)
            # aclosing: a consumer that stops early (client gone) aborts the request right away.
            async with contextlib.aclosing(self._stream(request_id, state)) as stream:
                yield stream
        finally:
            self._streamed(request_id)
            self.admission.forget(request_id)  # no-op once its first output was taken

    def _streamed(self, request_id: str) -> None:
        """A request's stream ended (a front's own bookkeeping)."""

    async def _stream(self, request_id: str, state: _Stream) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                item = await state.queue.get()
                if not state.taken and isinstance(item, RequestOutput) and item.token_ids:
                    self.admission.started(request_id)  # first token: it left the queue
                state.taken += 1
                if (state.paused_since is not None
                        and state.sent - state.taken <= self.max_stream_lead // 2):
                    self._caught_up(request_id, state)
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

    def _dispatch(self, outputs: Sequence, request_id: str | None = None) -> None:
        """Hand outputs to their streams (from the thread the engine's outputs arrive on): one
        thread-safe call of ``_deliver`` per event loop, not per item."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            rid = request_id or out.request_id
            target = self._queues.get(rid)
            if target is not None:
                target.sent += 1
                by_loop.setdefault(target.loop, []).append((rid, target, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list[tuple[str, _Stream, object]]) -> None:
        """On the consumer's loop: queue the outputs (a front may also act on its streams)."""
        for _, state, out in items:
            state.queue.put_nowait(out)

    def abort(self, request_id: str) -> None:
        """End the request wherever it is: admitted and never streamed (a refusal after
        admission), its queue place goes back; running, the engine drops it."""
        self.admission.forget(request_id)
        self._submit(self._abort_command(request_id))

    def abort_all(self, message: str) -> None:
        """End every live request now; each stream gets ``EngineDeadError(message)``."""
        self._submit(self._abort_all_command(message))


def take_late(engine: Any, start_by: dict[str, float]) -> list[str]:
    """The admitted requests still waiting to start past their ``start_by`` (request id ->
    ``time.monotonic`` deadline), taken out of ``engine``; every due entry leaves ``start_by``.
    An engine loop runs it after a step, so a request the step could have started is never
    refused: a lone prompt always runs."""
    if not start_by:
        return []
    now = time.monotonic()
    due = [rid for rid, when in list(start_by.items()) if when <= now]
    if not due:
        return []
    waiting = engine.not_started()
    late = []
    for request_id in due:
        start_by.pop(request_id, None)
        if request_id in waiting:
            engine.abort_request(request_id)
            late.append(request_id)
    return late


def step_or_fail(engine: Any, fail_all: Callable[[EngineDeadError], None]) -> list | None:
    """``engine.step()`` for an engine loop: a step that raises is logged and every live
    request fails (``fail_all``), so no client hangs; None then."""
    try:
        return engine.step()
    except Exception:  # noqa: BLE001 - whatever it was, the clients get STEP_FAILED
        log.exception("engine step failed")
        fail_all(EngineDeadError(STEP_FAILED))
        return None
