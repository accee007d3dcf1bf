"""EngineCoreClient: the engine in a process of its own, the API's event loop in this one.

::

    API process (event loop)                        engine process (its main thread)
    generate() ── ("add", request, start_by) ─pipe─▶ commands between steps → engine.add
       await queue.get() ◀── reader thread ◀─pipe── ("step", outputs, admission inputs, stats)
    consumer behind ── ("pause" / "resume") ───────▶ engine.pause / resume
    client gone ── ("abort", id) ──────────────────▶ engine.abort_request → blocks freed

Why a process: in one process the engine thread's Python between two model steps (scheduling,
the paged batch, sampling, detokenising) and the event loop's Python for the token just made
(the HTTP chunk, the metrics) take turns on one GIL, so a batch-1 token pays for both, one after
the other. Here they run at once, the event loop on the core the engine's second compute thread
leaves idle between steps (docs/bench_serve.md, "The engine in a process of its own").

What stays the same as ``AsyncLLM`` (the front both share is ``stream_front.StreamFront``):
validation in the caller through an ``InputProcessor`` over the same tokenizer and the engine's
limits, the admission gate in this process, a stream per request with the same backpressure
(the pause and resume are decided here, where the consumer's reads are counted, and sent), the
same errors. ``stats()`` is the engine's last report: sent with every step that finished a
request, when the engine goes idle, and at least every ``STATS_INTERVAL_S`` while it is busy.
The admission gate's inputs (the prefill capacity, the KV outlook, the slowdown) come with each
report and with the first step after a request arrived. A structured-output request's grammar is
compiled here, off the event loop, as with ``AsyncLLM``; its xgrammar JSON goes with the request
and the engine process loads it (milliseconds) instead of compiling it on its loop. Messages are
pickled with ``pickle`` itself (no file descriptors travel).

The engine process is spawned (no fork of a process with threads). It ignores SIGINT and
SIGTERM, which a terminal or a process manager may send to the whole process group: the API
process drains the requests in flight, then stops it. It ends when the pipe closes, so the API
process exiting in any way, killed included, ends it within a step. If the engine process dies,
every stream fails with ``EngineDeadError`` and ``is_alive`` turns false.

``kthena serve`` runs this front by default for one rank with no KV events publisher
(``ServeSpec.engine_process``). The publisher reads the engine's KV manager in the API process,
and a tp x pp > 1 engine starts its ranks from there, so those keep ``AsyncLLM``, as do the PD
workers and the DP replicas.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import attrs

from kthena_serve.engine.admission import AdmissionLimits
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.errors import EngineDeadError, RequestFailedError
from kthena_serve.engine.request import EngineRequest
from kthena_serve.engine.stats import EngineStats
from kthena_serve.stream_front import (
    MAX_STREAM_LEAD,
    STALL_TIMEOUT_S,
    STALLED_MESSAGE,
    STEP_FAILED,
    StreamFront,
    _Stream,
    step_or_fail,
    take_late,
)

if TYPE_CHECKING:
    from kthena_serve.engine.input_processor import InputProcessor

__all__ = ["EngineCoreClient"]

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1  # a busy engine reports its stats at least this often
START_TIMEOUT_S = 600.0  # loading the model (a first conversion of the default GGUF included)
STOP_TIMEOUT_S = 30.0


class EngineCoreClient(StreamFront):
    """The ``EngineClient`` over an engine in a process of its own (module docs). Use
    ``start()`` (loads the model there; raises what loading raised) and ``shutdown()``."""

    def __init__(self, config: EngineConfig, *, max_stream_lead: int = MAX_STREAM_LEAD,
                 stall_timeout: float | None = STALL_TIMEOUT_S) -> None:
        super().__init__(AdmissionLimits.of(config), max_stream_lead=max_stream_lead,
                         stall_timeout=stall_timeout)
        self.config = config
        self._processor: InputProcessor | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Any = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._stats: EngineStats | None = None
        self._idle_since: float | None = None  # perf_counter (system-wide) the engine went idle
        self._closed = False

    @classmethod
    def from_config(cls, config: EngineConfig, **options: Any) -> EngineCoreClient:
        return cls(config, **options)

    # ---- lifetime -----------------------------------------------------------------------------
    def start(self) -> EngineCoreClient:
        """Spawn the engine process and wait until its model is loaded.

        Raises:
            whatever building the engine raised there (a bad model, config or kernel choice);
            EngineDeadError: the process died while loading.
        """
        if self._process is not None:
            return self
        from kthena_serve.model.source import resolve_checkpoint

        # here, before the engine process starts: a conversion or download happens once, and
        # a model that does not resolve is refused without a process
        folder = resolve_checkpoint(self.config.model)
        context = multiprocessing.get_context("spawn")
        here, there = context.Pipe()
        # the kernel library's lines on stderr there too, if this process shows them
        notices = bool(logging.getLogger("mooncake_ops").handlers)
        process = context.Process(target=_core_main, args=(self.config, there, notices),
                                  name="kthena-engine-core")
        process.start()
        there.close()
        self._process, self._conn = process, here
        try:
            # while the engine process imports and loads: this process's own imports (torch
            # among them) and the tokenizer, on the other core
            from kthena_serve.engine.grammar import Grammars
            from kthena_serve.engine.input_processor import InputProcessor
            from kthena_serve.model.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_pretrained(folder)
            kind, *rest = self._first_message(process, here)
            if kind == "failed":
                raise rest[0]
            limits, capacity, outlook, stats = rest
        except BaseException:
            self._stop_process()
            raise
        self._processor = InputProcessor(tokenizer, limits, self.config.chat_special_tokens,
                                         Grammars(tokenizer, limits.vocab_size, serialize=True))
        self._capacity, self._kv_outlook, self._stats = capacity, outlook, stats
        self._idle_since = time.perf_counter()
        self._reader = threading.Thread(target=self._read, name="kthena-engine-reader",
                                        daemon=True)
        self._reader.start()
        return self

    @staticmethod
    def _first_message(process: multiprocessing.process.BaseProcess, conn: Any) -> tuple:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not conn.poll(0.2):
            if not process.is_alive():
                raise EngineDeadError(f"the engine process exited with code {process.exitcode} "
                                      "while loading the model (its log is above)")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine process loaded nothing in "
                                      f"{START_TIMEOUT_S:.0f} s")
        return pickle.loads(conn.recv_bytes())

    def shutdown(self) -> None:
        """Stop the engine process (each live stream fails with ``EngineDeadError``)."""
        if self._process is None or self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout=STOP_TIMEOUT_S)
        self._stop_process()

    def _stop_process(self) -> None:
        process = self._process
        if process is None:
            return
        process.join(timeout=STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(OSError):
            self._conn.close()

    @property
    def is_alive(self) -> bool:
        return (self._reader is not None and self._reader.is_alive() and not self._closed
                and self.error is None)

    @property
    def processor(self) -> InputProcessor:
        """The input processor over the model's tokenizer and the engine's limits."""
        if self._processor is None:
            raise EngineDeadError("the engine is not started")
        return self._processor

    def stats(self) -> EngineStats:
        """The engine's last report, with the admission queue and the idle time up to now
        (never blocks)."""
        stats, since = self._stats, self._idle_since
        if stats is None:
            raise EngineDeadError("the engine is not started")
        idle_s = stats.step_times.idle_s
        if since is not None:
            idle_s += time.perf_counter() - since
        return attrs.evolve(stats, queue=self.admission.load(self._capacity, self._kv_outlook,
                                                             self._slowdown),
                            step_times=attrs.evolve(stats.step_times, idle_s=idle_s))

    # ---- StreamFront's commands ------------------------------------------------------------------
    def _submit(self, command: object) -> None:
        try:
            self._send(command)
        except OSError:  # the process is gone: the reader fails every stream
            pass

    def _send(self, message: object) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)

    def _add_command(self, request: EngineRequest, start_by: float | None) -> object:
        spec = request.params.structured_outputs  # compiled here already: its JSON goes along
        grammar = None if spec is None else self.processor.grammars.serialized(spec)
        return ("add", request, start_by, self.admission.num_queued, grammar)

    def _abort_command(self, request_id: str) -> object:
        return ("abort", request_id)

    def _abort_all_command(self, message: str) -> object:
        return ("abort_all", message)

    def _caught_up(self, request_id: str, state: _Stream) -> None:
        state.paused_since = None
        self._submit(("resume", request_id))

    # ---- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        conn = self._conn
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "step":
                _, outputs, admission, report, late = message
                if admission is not None:
                    self._capacity, self._kv_outlook, self._slowdown = admission
                if report is not None:
                    self._stats, self._idle_since = report
                self._dispatch(outputs)
                for request_id in late:
                    self._dispatch([self.admission.timed_out(request_id)], request_id)
            elif kind == "fail":
                _, request_id, error = message
                self._dispatch([error], request_id)
            elif kind == "report":
                self._stats, self._idle_since = message[1]
            elif kind == "stopped":
                break
        if not self._closed:
            log.error("the engine process ended (exit code %s); failing every request",
                      self._process.exitcode if self._process is not None else None)
            self.error = EngineDeadError("the engine process ended")
        for request_id in list(self._queues):
            self._dispatch([EngineDeadError("the engine was shut down" if self._closed else
                                            STEP_FAILED)], request_id)

    def _deliver(self, items: list[tuple[str, _Stream, object]]) -> None:
        """On the consumer's loop: queue the outputs, and pause a request whose consumer is
        ``max_stream_lead`` behind (its stall timer starts)."""
        super()._deliver(items)
        for request_id, state, _ in items:
            if (state.paused_since is None and not self._closed
                    and state.sent - state.taken >= self.max_stream_lead):
                state.paused_since = time.monotonic()
                self._submit(("pause", request_id))
                if self.stall_timeout is not None:
                    state.loop.call_later(self.stall_timeout, self._stalled, request_id, state,
                                          state.paused_since)

    def _stalled(self, request_id: str, state: _Stream, paused_since: float) -> None:
        if state.paused_since != paused_since or self._queues.get(request_id) is not state:
            return  # resumed (or paused again later, or ended) since
        log.warning("request %s: its client read nothing for %.0f s; aborting it", request_id,
                    time.monotonic() - paused_since)
        self.num_stalled += 1
        state.paused_since = None
        self._submit(("abort", request_id))
        state.sent += 1
        state.queue.put_nowait(RequestFailedError(STALLED_MESSAGE))


# ---- the engine process ------------------------------------------------------------------------------
def _core_main(config: EngineConfig, conn: Any, notices: bool) -> None:
    """The engine process: load, report, then serve commands and steps until told to stop or
    the pipe closes (``notices``: show the kernel library's lines on stderr)."""
    for name in ("SIGINT", "SIGTERM"):  # the API process drains, then stops this one
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if notices:
        from kthena_serve.cluster.worker import show_library_notices

        show_library_notices()
    try:
        from kthena_serve.engine import LLMEngine

        engine = LLMEngine.from_config(config)
    except BaseException as error:  # noqa: BLE001 - the API process raises it
        conn.send_bytes(pickle.dumps(("failed", _portable(error))))
        return
    core = _Core(engine, conn)
    core._send(("ready", engine.processor.limits, engine.prefill_capacity(), engine.kv_outlook(),
                engine.stats()))
    try:
        core.run()
    finally:
        engine.close()
    # Nothing is left to tear down: skip the interpreter's (torch's among it), which the API
    # process would otherwise wait for at every stop.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _portable(error: BaseException) -> BaseException:
    """``error`` if it pickles, else a RuntimeError with its text."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


class _Core:
    """The engine process's loop (its main thread; the only one that touches the engine)."""

    def __init__(self, engine: Any, conn: Any) -> None:
        self.engine = engine
        self.conn = conn
        self.start_by: dict[str, float] = {}
        self.num_queued = 0
        self.stopping = False
        self.idle_s = 0.0
        self.reported_at = 0.0
        self.admission_due = True  # a request came since the admission inputs were last sent

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            if not engine.has_runnable_requests():
                since = time.perf_counter()
                self._report(since)
                self._receive(None)
                self.idle_s += time.perf_counter() - since
                continue
            self._receive(0.0)
            if self.stopping or not engine.has_runnable_requests():
                continue
            outputs = step_or_fail(engine, self._fail_all)
            if outputs is None:
                continue
            late = take_late(engine, self.start_by)
            finished = [out.request_id for out in outputs if out.finished]
            for request_id in finished:
                self.start_by.pop(request_id, None)
            now = time.perf_counter()
            report = admission = None
            if finished or now - self.reported_at >= STATS_INTERVAL_S:
                report = (self._stats(), None)
                self.reported_at = now
            if report is not None or self.admission_due:
                admission = (engine.prefill_capacity(), engine.kv_outlook(),
                             engine.prefill_slowdown(self.num_queued))
                self.admission_due = False
            self._send(("step", outputs, admission, report, late))
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._send(("stopped",))

    def _stats(self) -> EngineStats:
        stats = self.engine.stats()
        return attrs.evolve(stats, step_times=attrs.evolve(stats.step_times,
                                                           idle_s=self.idle_s))

    def _report(self, idle_since: float) -> None:
        self._send(("report", (self._stats(), idle_since)))
        self.reported_at = time.perf_counter()

    def _send(self, message: object) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except OSError:  # the API process is gone
            self.stopping = True

    def _receive(self, timeout: float | None) -> None:
        """Run the commands waiting (after waiting up to ``timeout`` s for one; None: until one
        comes)."""
        try:
            if not self.conn.poll(timeout):
                return
            while True:
                self._command(pickle.loads(self.conn.recv_bytes()))
                if self.stopping or not self.conn.poll(0):
                    return
        except (EOFError, OSError):  # the API process is gone
            self.stopping = True

    def _command(self, message: tuple) -> None:
        kind = message[0]
        engine = self.engine
        if kind == "add":
            _, request, start_by, self.num_queued, grammar = message
            self.admission_due = True
            if grammar is not None:  # compiled in the API process: no compile on this loop
                engine.processor.grammars.load(request.params.structured_outputs, grammar)
            if start_by is not None:
                self.start_by[request.request_id] = start_by
            try:
                engine.add(request)
            except ValueError as error:  # a duplicate id: only this request fails
                self.start_by.pop(request.request_id, None)
                self._send(("fail", request.request_id, error))
        elif kind == "abort":
            self.start_by.pop(message[1], None)
            engine.abort_request(message[1])
        elif kind == "pause":
            engine.pause(message[1])
        elif kind == "resume":
            engine.resume(message[1])
        elif kind == "abort_all":
            self._fail_all(EngineDeadError(message[1]))
        elif kind == "stop":
            self.stopping = True

    def _fail_all(self, error: EngineDeadError) -> None:
        for request_id in self.engine.live_request_ids():
            self.engine.abort_request(request_id)
            self.start_by.pop(request_id, None)
            self._send(("fail", request_id, error))
        self._report(time.perf_counter())
