"""AsyncLLM: the engine on a background thread, with one asyncio stream per request.

::

    asyncio (server)                           engine thread
    generate() ── inbox.append(add) ─────────▶ drain inbox → engine.add_request
       await queue.get() ◀── call_soon_threadsafe(dispatch) ◀── engine.step() outputs
    client gone → finally: abort(id) ─ inbox ▶ engine.abort_request → blocks freed

Only the engine thread touches the engine (and so the KV manager); other threads talk to it
through the inbox. Validation (tokenising, length checks) runs in the caller so a bad request
fails before any streaming starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence

from kthena_serve.config import EngineConfig
from kthena_serve.engine import EngineStats, LLMEngine
from kthena_serve.errors import EngineDeadError
from kthena_serve.request import RequestOutput
from kthena_serve.sampling_params import SamplingParams

__all__ = ["AsyncLLM"]

log = logging.getLogger(__name__)


class AsyncLLM:
    """Async front of an ``LLMEngine`` (see module docs). Use ``start()`` / ``shutdown()``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

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

    # ---- requests (any thread) ------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.engine.encode(prompt)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """Raise InvalidRequestError now for a request the engine would refuse."""
        return self.engine.resolve_max_tokens(len(prompt_ids), params)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       *, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the loop early (or being cancelled) aborts it."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        self.check(prompt_ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._submit(("add", request_id, prompt_ids, params, cache_salt))
        # aclosing: a consumer that stops early (client gone) aborts the request right away.
        async with contextlib.aclosing(self._stream(request_id, queue)) as stream:
            async for item in stream:
                yield item

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
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def stats(self) -> EngineStats:
        """The last snapshot the engine thread published (never blocks)."""
        return self._stats

    def _submit(self, command: tuple) -> None:
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
            except Exception as error:  # a failed step must not hang any client
                log.exception("engine step failed")
                self._fail_all(error)
                continue
            self._stats = engine.stats()
            self._dispatch(outputs)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine.close()  # on the owner thread: the KV manager allows no other

    def _drain_inbox(self) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                continue
            _, request_id, prompt_ids, params, salt = command
            try:
                self.engine.add_request(request_id, prompt_ids, params, cache_salt=salt)
            except ValueError as error:
                self._dispatch([error], request_id)

    def _dispatch(self, outputs: list, request_id: str | None = None) -> None:
        """Hand outputs to their streams: one thread-safe call per event loop, not per item."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._queues.get(request_id or out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in self.engine.live_request_ids():
            self.engine.abort_request(request_id)
            self._dispatch([EngineDeadError(f"request {request_id} failed: {error}")], request_id)
        self._stats = self.engine.stats()


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
