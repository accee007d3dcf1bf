"""What a vLLM user reads in a server's output: the periodic stats line, the per-request
lines of --enable-log-requests, and the flags and variable that control them."""

from __future__ import annotations

import time

import httpx
import pytest
from _tiny import tiny_engine

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.engine.stats import EngineStats
from kthena_serve.server import BackgroundServer, build_app
from kthena_serve.server.stats_log import INTERVAL_ENV, StatsLine, StatsLogger, log_interval
from mooncake_kv.results import KVCacheStats


def _stats(prompt: int, generated: int, running: int, waiting: int, used: int, queries: int,
           hits: int) -> EngineStats:
    kv = KVCacheStats(num_blocks=100, block_size=16, num_used_blocks=used,
                      num_free_blocks=100 - used, num_cached_blocks=0, num_running_requests=running,
                      num_queries=0, num_query_tokens=queries, num_hit_tokens=hits,
                      num_evicted_blocks=0)
    return EngineStats(num_steps=0, num_computed_prompt_tokens=prompt,
                       num_generated_tokens=generated, num_preemptions=0, num_waiting=waiting,
                       num_running=running, kv=kv)


def test_the_stats_line_is_over_the_last_interval_and_quiet_when_idle():
    line = StatsLine(_stats(100, 10, 0, 0, 0, 200, 50), now=0.0)
    text = line.update(_stats(1100, 60, 3, 2, 25, 400, 150), now=10.0)
    assert text == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 5.0 "
                    "tokens/s, Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix "
                    "cache hit rate: 50.0%")
    assert line.update(_stats(1100, 60, 0, 0, 0, 400, 150), now=20.0) is None  # idle


def test_the_logger_prints_while_busy_and_stops(monkeypatch):
    lines: list[str] = []
    counter = iter(range(10**6))

    def busy() -> EngineStats:
        n = next(counter)
        return _stats(n * 10, n, 1, 0, 1, n, 0)

    logger = StatsLogger(busy, 0.01, lines.append).start()
    deadline = time.monotonic() + 10
    while len(lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    logger.stop()
    assert len(lines) >= 2 and lines[0].startswith("Avg prompt throughput:")
    assert not logger._thread.is_alive()


def test_the_interval_variable_is_checked(monkeypatch):
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert log_interval() == 10.0
    monkeypatch.setenv(INTERVAL_ENV, "2.5")
    assert log_interval() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        with pytest.raises(ValueError, match=f"{INTERVAL_ENV}='{bad}': seconds between stats "
                                             "lines, a number > 0"):
            log_interval()


def test_flags_reach_the_spec():
    from kthena_core.cli import build_parser
    from kthena_serve.cli import spec_from_args

    default = spec_from_args(build_parser().parse_args(["serve"]))
    assert (default.log_stats, default.log_requests) == (True, False)
    both = spec_from_args(build_parser().parse_args(
        ["serve", "--disable-log-stats", "--enable-log-requests"]))
    assert (both.log_stats, both.log_requests) == (False, True)


def test_request_lines_when_asked(capsys):
    engine = AsyncLLM(tiny_engine(num_kv_blocks=64)).start()
    try:
        for log_requests in (False, True):
            app = build_app(engine, model_name="tiny", log_requests=log_requests)
            with BackgroundServer(app) as server:
                answer = httpx.post(f"{server.url}/v1/completions", json={
                    "model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0},
                    timeout=60)
                assert answer.status_code == 200
            out = capsys.readouterr().out
            received = [line for line in out.splitlines() if "received request" in line]
            finished = [line for line in out.splitlines() if "finished request" in line]
            assert (len(received), len(finished)) == ((1, 1) if log_requests else (0, 0)), out
        assert "n=1, params: SamplingParams(" in received[0]
        assert "length, " in finished[0] and "3 output tokens" in finished[0]
    finally:
        engine.shutdown()


def test_stats_line_reads_a_real_engine():
    engine = AsyncLLM(tiny_engine(num_kv_blocks=64)).start()
    try:
        line = StatsLine(engine.stats(), time.monotonic())
        with BackgroundServer(build_app(engine, model_name="tiny")) as server:
            httpx.post(f"{server.url}/v1/completions", json={
                "model": "tiny", "prompt": "Hello there", "max_tokens": 4}, timeout=60)
        text = line.update(engine.stats(), time.monotonic())
    finally:
        engine.shutdown()
    assert text is not None and "Avg generation throughput:" in text
