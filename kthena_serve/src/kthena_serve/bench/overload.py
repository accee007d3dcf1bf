"""``kthena bench soak --overload``: under FACTOR x the sustainable load, the requests a server
admits keep their TTFT within its queue bound and the rest are refused fast.

::

    calibration  N closed-loop clients of good streams for S seconds
                 ─▶ sustainable rate X = streams completed per second, and T = their tokens
                    (prompt + output, from each stream's usage chunk) per second
    overload     Poisson arrivals at FACTOR x X for M minutes, open loop (an arrival never waits
                 for an earlier answer, as independent clients do)
                   200 ─▶ TTFT (first text event), must end with [DONE]
                   503 overloaded ─▶ its latency (send to headers) and Retry-After
                   503 queue_timeout ─▶ the same, counted apart: admitted, then refused at
                                        its queue deadline (admission.py), so not fast
                   anything else (or no [DONE]) ─▶ an error
    ─▶ accepted TTFT percentiles against the bound, 503 latency percentiles, counts, and
       goodput: the accepted streams' tokens per second over T (at least GOODPUT_TARGET: the
       shedding keeps the server as busy as the calibration did)

Requests are the soak's good streams (completions and chat, 16-512 words, half with a shared
preamble, 8-128 output tokens), drawn from ``seed``. Clients ignore ``Retry-After``: the offered
load stays FACTOR x X whatever the answers, which is the overload to survive.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import attrs
import httpx

from kthena_serve.bench.soak import (
    SoakOptions,
    Target,
    api_path,
    error_code,
    good_body,
    has_text,
    pcts_ms,
)

__all__ = ["GOODPUT_TARGET", "OverloadOptions", "run_overload", "soak_phase"]

GOODPUT_TARGET = 0.8  # accepted tokens/s under overload over the calibration's, at least
_JSON = {"Content-Type": "application/json"}
_MAX_ERRORS_SHOWN = 10
_REJECT_PAUSE_S = 0.5  # a closed-loop client refused during calibration waits this long


@attrs.frozen(kw_only=True)
class OverloadOptions:
    """The overload phase.

    Attributes:
        factor: offered load as a multiple of the calibrated sustainable rate.
        minutes: how long arrivals are offered.
        calibration_s: how long the closed-loop calibration runs.
        clients: closed-loop clients of the calibration.
        seed: arrivals and bodies are drawn from it.
        bound_s: the server's ``--max-queue-delay`` (reported next to the TTFT; None: unknown).
        request_timeout_s: one request's whole time.
    """

    factor: float = 4.0
    minutes: float = 2.0
    calibration_s: float = 60.0
    clients: int = 32
    seed: int = 0
    bound_s: float | None = None
    request_timeout_s: float = 120.0


@attrs.define
class _Answer:
    status: int | None = None
    headers_s: float | None = None  # send to response headers
    ttft_s: float | None = None  # send to the first text event
    retry_after: str | None = None
    is_done: bool = False
    problem: str | None = None
    code: str | None = None  # a non-200 answer's error code
    tokens: int | None = None  # prompt + output tokens, from the stream's usage chunk


def _completed(answer: _Answer) -> bool:
    return answer.status == 200 and answer.is_done and answer.problem is None


_REFUSAL_CODES = ("overloaded", "queue_timeout")  # at admission; at the queue deadline


def _refused(answer: _Answer) -> bool:
    """A 503 past the server's queue bound (any other 503 is an error)."""
    return answer.status == 503 and answer.code in _REFUSAL_CODES


def _draw(rng: random.Random, target: Target) -> tuple[str, str]:
    chat = rng.random() < 0.5
    body = good_body(rng, target, chat, rng.randint(8, 128))
    body["stream_options"] = {"include_usage": True}  # its tokens, for the goodput
    return api_path(chat), json.dumps(body)


async def _send(client: httpx.AsyncClient, path: str, body: str) -> _Answer:
    answer, start = _Answer(), time.perf_counter()
    async with client.stream("POST", path, content=body, headers=_JSON) as reply:
        answer.status = reply.status_code
        answer.headers_s = time.perf_counter() - start
        answer.retry_after = reply.headers.get("retry-after")
        if reply.status_code != 200:
            text = (await reply.aread()).decode(errors="replace")
            answer.problem, answer.code = text[:200], error_code(text)
            return answer
        async for line in reply.aiter_lines():
            if line == "data: [DONE]":
                answer.is_done = True
                break
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                answer.problem = f"error event: {json.dumps(event['error'])[:200]}"
                return answer
            if event.get("usage"):
                usage = event["usage"]
                answer.tokens = usage["prompt_tokens"] + usage["completion_tokens"]
            if answer.ttft_s is None and has_text(event):
                answer.ttft_s = time.perf_counter() - start
    return answer


async def _timed(client: httpx.AsyncClient, path: str, body: str, timeout: float) -> _Answer:
    try:
        return await asyncio.wait_for(_send(client, path, body), timeout)
    except asyncio.TimeoutError:
        return _Answer(problem=f"no end within {timeout:g} s")
    except (httpx.HTTPError, ValueError) as error:
        return _Answer(problem=f"{type(error).__name__}: {error}"[:200])


def _client(target: Target, headers: dict, timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=target.url, trust_env=False, headers=headers,
                             timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                  max_keepalive_connections=256))


async def _calibrate(target: Target, options: OverloadOptions, headers: dict) -> dict:
    """Closed-loop clients for ``calibration_s``: streams completed, and their tokens, per
    second."""
    deadline = time.monotonic() + options.calibration_s
    counts = {"completed": 0, "rejected": 0, "errors": 0, "tokens": 0}

    async def loop(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(options.seed + 10_000 + index)
        while time.monotonic() < deadline:
            answer = await _timed(client, *_draw(rng, target), options.request_timeout_s)
            if _completed(answer):
                counts["completed"] += 1
                counts["tokens"] += answer.tokens or 0
            elif _refused(answer):
                counts["rejected"] += 1
                await asyncio.sleep(_REJECT_PAUSE_S)
            else:
                counts["errors"] += 1

    start = time.monotonic()
    async with _client(target, headers, options.request_timeout_s) as client:
        await asyncio.gather(*(loop(i, client) for i in range(options.clients)))
    elapsed = time.monotonic() - start
    return {**counts, "seconds": round(elapsed, 1),
            "sustainable_rps": round(counts["completed"] / elapsed, 3),
            "sustainable_tokens_per_s": round(counts["tokens"] / elapsed, 1)}


async def _offer(target: Target, rate_rps: float, options: OverloadOptions,
                 headers: dict) -> tuple[list[_Answer], float]:
    """Poisson arrivals at ``rate_rps`` for ``minutes``; every answer, and the seconds taken."""
    rng = random.Random(options.seed + 20_000)
    answers: list[_Answer] = []
    tasks: set[asyncio.Task] = set()
    duration = 60 * options.minutes
    start = time.monotonic()
    async with _client(target, headers, options.request_timeout_s) as client:
        offset = 0.0
        while True:
            offset += rng.expovariate(rate_rps)
            if offset > duration:
                break
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            path, body = _draw(rng, target)

            async def one(path: str = path, body: str = body) -> None:
                answers.append(await _timed(client, path, body, options.request_timeout_s))

            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return answers, time.monotonic() - start


def _report(options: OverloadOptions, calibration: dict, rate_rps: float,
            answers: list[_Answer], seconds: float) -> dict:
    accepted = [a for a in answers if _completed(a)]
    rejected = [a for a in answers if _refused(a)]
    late = [a for a in rejected if a.code == "queue_timeout"]
    errors = [a for a in answers if not _completed(a) and not _refused(a)]
    ttft = [a.ttft_s for a in accepted if a.ttft_s is not None]
    retry = sorted(int(a.retry_after) for a in rejected
                   if a.retry_after and a.retry_after.isdigit())
    ttft_ms = pcts_ms(ttft)
    within = None
    if options.bound_s is not None and ttft_ms["p99"] is not None:
        within = ttft_ms["p99"] <= 1000 * options.bound_s
    return {**_goodput(calibration, accepted, seconds),
        "factor": options.factor, "minutes": options.minutes, "bound_s": options.bound_s,
        "calibration": calibration, "offered_rps": round(rate_rps, 3),
        "seconds": round(seconds, 1), "num_offered": len(answers),
        "num_accepted": len(accepted), "num_rejected": len(rejected),
        "num_errors": len(errors),
        "errors": [a.problem or f"HTTP {a.status}" for a in errors][:_MAX_ERRORS_SHOWN],
        "accepted_rps": round(len(accepted) / seconds, 3) if seconds else None,
        "accepted_ttft_ms": ttft_ms, "ttft_p99_within_bound": within,
        "num_rejected_late": len(late),
        "rejected_latency_ms": pcts_ms([a.headers_s for a in rejected
                                         if a.headers_s is not None and a.code != "queue_timeout"]),
        "rejected_late_latency_ms": pcts_ms([a.headers_s for a in late
                                              if a.headers_s is not None]),
        "retry_after_s": {"min": retry[0] if retry else None,
                          "p50": retry[len(retry) // 2] if retry else None,
                          "max": retry[-1] if retry else None},
    }


def _goodput(calibration: dict, accepted: list[_Answer], seconds: float) -> dict:
    """The accepted streams' tokens per second, and their ratio to the calibration's
    (None where the calibration measured no tokens or no time passed)."""
    tokens = sum(a.tokens or 0 for a in accepted)
    per_s = tokens / seconds if seconds else None
    sustainable = calibration.get("sustainable_tokens_per_s")
    ratio = per_s / sustainable if per_s is not None and sustainable else None
    return {"accepted_tokens": tokens,
            "accepted_tokens_per_s": None if per_s is None else round(per_s, 1),
            "goodput_ratio": None if ratio is None else round(ratio, 3),
            "goodput_target": GOODPUT_TARGET,
            "goodput_ok": None if ratio is None else ratio >= GOODPUT_TARGET}


async def run_overload(target: Target, options: OverloadOptions, headers: dict) -> dict:
    """Calibrate, then offer ``factor`` x the sustainable rate; the phase's report."""
    calibration = await _calibrate(target, options, headers)
    sustainable = calibration["sustainable_rps"]
    if not sustainable > 0:
        return {"factor": options.factor, "calibration": calibration,
                "error": "no stream completed during the calibration: nothing to scale"}
    rate = options.factor * sustainable
    answers, seconds = await _offer(target, rate, options, headers)
    return _report(options, calibration, rate, answers, seconds)


async def soak_phase(target: Target, options: SoakOptions, headers: dict) -> dict:
    """``kthena bench soak --overload``: `run_overload` with the soak's options."""
    return await run_overload(target, OverloadOptions(
        factor=options.overload, minutes=options.overload_minutes,
        calibration_s=options.calibration_s, clients=options.clients, seed=options.seed,
        bound_s=options.bound_s, request_timeout_s=options.request_timeout_s), headers)
