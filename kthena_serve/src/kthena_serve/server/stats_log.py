"""The periodic stats line a vLLM user looks for in a server's output (vLLM's wording):

    kthena serve: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 41.0
    tokens/s, Running: 6 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, Prefix cache hit rate:
    37.0%

Every ``interval_s`` (10 s, ``KTHENA_LOG_STATS_INTERVAL`` to change it, as vLLM's
``VLLM_LOG_STATS_INTERVAL``) from the engine's own counters (``EngineClient.stats()``): the
throughputs and the hit rate are over the last interval, the rest a snapshot. Nothing is
printed while the engine is idle (nothing ran, nothing queued), as vLLM keeps an idle server's
log quiet. ``kthena serve --disable-log-stats`` turns it off.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from kthena_serve.engine.stats import EngineStats

__all__ = ["INTERVAL_ENV", "StatsLine", "StatsLogger", "log_interval"]

INTERVAL_ENV = "KTHENA_LOG_STATS_INTERVAL"


def log_interval(default: float = 10.0) -> float:
    """Seconds between stats lines: ``$KTHENA_LOG_STATS_INTERVAL`` or ``default``.

    Raises:
        ValueError: the variable is not a positive number (named in the message).
    """
    text = os.environ.get(INTERVAL_ENV)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{INTERVAL_ENV}={text!r}: seconds between stats lines, a number > 0")
    return value


class StatsLine:
    """Turns successive ``EngineStats`` snapshots into the stats line (None when idle)."""

    def __init__(self, first: EngineStats, now: float) -> None:
        self._last, self._when = first, now

    def update(self, stats: EngineStats, now: float) -> str | None:
        last, seconds = self._last, max(now - self._when, 1e-9)
        self._last, self._when = stats, now
        prompt = stats.num_computed_prompt_tokens - last.num_computed_prompt_tokens
        generated = stats.num_generated_tokens - last.num_generated_tokens
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        kv = stats.kv
        total = kv.num_used_blocks + kv.num_free_blocks
        queries = kv.num_query_tokens - last.kv.num_query_tokens
        hits = kv.num_hit_tokens - last.kv.num_hit_tokens
        return (f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation "
                f"throughput: {generated / seconds:.1f} tokens/s, Running: {stats.num_running} "
                f"reqs, Waiting: {stats.num_waiting} reqs, KV cache usage: "
                f"{100 * kv.num_used_blocks / max(total, 1):.1f}%, Prefix cache hit rate: "
                f"{100 * hits / max(queries, 1):.1f}%")


class StatsLogger:
    """A daemon thread printing ``StatsLine`` every ``interval_s`` until ``stop()``.

    Args:
        stats: what to read (an ``EngineClient``'s ``stats``).
        interval_s: seconds between lines.
        emit: where a line goes (default: stdout with the ``kthena serve:`` prefix).
    """

    def __init__(self, stats: Callable[[], EngineStats], interval_s: float,
                 emit: Callable[[str], None] | None = None) -> None:
        self._stats, self._interval = stats, interval_s
        self._emit = emit or (lambda line: print(f"kthena serve: {line}", file=sys.stdout,
                                                 flush=True))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kthena-stats", daemon=True)

    def start(self) -> StatsLogger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        line = StatsLine(self._stats(), time.monotonic())
        while not self._stop.wait(self._interval):
            try:
                text = line.update(self._stats(), time.monotonic())
            except Exception as error:  # noqa: BLE001 - a stats read must not end the server
                text = f"stats unavailable ({type(error).__name__}: {error})"
            if text is not None:
                self._emit(text)
