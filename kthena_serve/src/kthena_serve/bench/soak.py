"""``kthena bench soak``: a bounded soak run of one server under mixed streaming load.

::

    start the server (or attach to --url) ─▶ warm-up ─▶ N clients loop until the deadline
        each turn, a seeded draw:  completion | chat | disconnect after k events | bad request
        every 5 s: RSS of the server's process tree
    ─▶ with --overload: calibration, then FACTOR x the sustainable load (bench/overload.py)
    ─▶ wait until idle ─▶ /metrics (KV gauges, finished requests) ─▶ SIGTERM ─▶ one JSON line

An error is a 5xx, a transport error or timeout, a stream without ``[DONE]``, an error event in
a good request's stream, or a bad request that did not get a 4xx. A good request refused past
the server's queue bound (503, code ``overloaded``: ``--max-queue-delay``) is counted apart,
not as an error: it is the answer overload control gives. Clients talk to loopback only.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import httpx

from kthena_serve.bench.machine import host_info

__all__ = ["SoakOptions", "process_tree", "run_soak"]

RSS_PERIOD_S = 5.0
IDLE_TIMEOUT_S = 30.0
MAX_ERRORS_SHOWN = 10
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_JSON = {"Content-Type": "application/json"}
_GAUGES = ("kthena_kv_blocks_used", "kthena_kv_blocks_free", "kthena_num_requests_running",
           "kthena_num_requests_waiting")
_WORDS = ("the a of to and in is it that for on with as was at by this from or one have an be "
          "are not but what all were when we there can more if out so up said about into than "
          "them only other new some could time these two may then first any like now my such "
          "make over our even most after also made many before must through back years where "
          "much your way well down should because each just those people how too little state "
          "good very world still own see men work long get here between both life being under "
          "never day same another know while last might us great old year off come since").split()


def _check_url(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and urlsplit(value).hostname not in _LOOPBACK:
        raise ValueError(f"--url {value}: the soak sends load and malformed requests, so it "
                         f"only talks to loopback ({', '.join(_LOOPBACK)})")


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{attribute.name} must be 0 or more, got {value!r}")


@attrs.frozen(kw_only=True)
class SoakOptions:
    """One soak run.

    Attributes:
        mode: ``colocated`` or ``pd`` (1 prefill + 1 decode worker) for the server it starts.
        dp: replicas of the colocated server it starts (``--dp``).
        clients: concurrent streaming clients (the calibration's too).
        minutes: how long clients start new requests (in-flight ones then finish); 0 skips
            this mixed phase (with ``overload``).
        max_queue_delay: the server's ``--max-queue-delay`` (None: its default).
        overload: run the overload phase at this many times the sustainable load (None: no).
        overload_minutes, calibration_s: how long it offers that load, and calibrates.
        seed: client ``i`` draws from ``random.Random(seed + i)``.
        url: attach to this loopback server instead of starting one.
        server_pid: with ``url``, the server process whose tree's RSS is sampled.
        kv_cache_memory, model: flags of the server it starts.
        request_timeout_s: one request's whole time, headers to ``[DONE]``.
        api_key: with ``url``, sent as ``Authorization: Bearer``.
    """

    mode: str = attrs.field(default="colocated",
                            validator=attrs.validators.in_(("colocated", "pd")))
    dp: int = attrs.field(default=1, validator=_positive)
    clients: int = attrs.field(default=32, validator=_positive)
    minutes: float = attrs.field(default=5.0, validator=_non_negative)
    max_queue_delay: float | None = None
    overload: float | None = attrs.field(default=None, validator=attrs.validators.optional(
        _positive))
    overload_minutes: float = attrs.field(default=2.0, validator=_positive)
    calibration_s: float = attrs.field(default=60.0, validator=_positive)
    seed: int = 0
    url: str | None = attrs.field(default=None, validator=_check_url)
    server_pid: int | None = None
    kv_cache_memory: str = "256MiB"
    model: str = "default"
    request_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    api_key: str | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.minutes and self.overload is None:
            raise ValueError("--minutes 0 leaves nothing to run without --overload")
        if self.dp > 1 and self.mode == "pd":
            raise ValueError("--dp takes a colocated server; PD runs 1 prefill + 1 decode")

    @property
    def bound_s(self) -> float | None:
        """The server's --max-queue-delay (its default when not given; None with --url)."""
        if self.max_queue_delay is not None:
            return self.max_queue_delay or None
        if self.url is not None:
            return None
        from kthena_serve.engine.config import DEFAULT_MAX_QUEUE_DELAY_S

        return DEFAULT_MAX_QUEUE_DELAY_S


# ---- what each client sends ---------------------------------------------------------------------
@attrs.frozen
class Target:
    """What requests need to know about the server."""

    url: str
    model: str
    max_model_len: int
    preambles: tuple[str, ...]  # shared prompt openings: prefix-cache hits and evictions


@attrs.frozen
class _Plan:
    kind: str  # completion | chat | disconnect | bad_<what>
    path: str
    body: str  # the JSON text as sent (one bad kind is not strict JSON)
    close_after: int | None = None  # disconnect after this many text events

    @property
    def is_bad(self) -> bool:
        return self.kind.startswith("bad_")


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def good_body(rng: random.Random, target: Target, chat: bool, max_tokens: int) -> dict:
    text = _text(rng, rng.randint(16, 512))
    if rng.random() < 0.5:
        text = rng.choice(target.preambles) + " " + text
    body = {"model": target.model, "stream": True, "max_tokens": max_tokens,
            "temperature": rng.choice((0.0, 0.7, 1.0)), "seed": rng.randrange(2**32),
            "ignore_eos": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def api_path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _bad_plan(rng: random.Random, target: Target) -> _Plan:
    """A request the server must refuse with a 4xx before anything streams."""
    body = {"model": target.model, "prompt": _text(rng, 8), "max_tokens": 8, "stream": True}
    what = rng.choice(("seed", "top_k", "temperature", "model", "empty_prompt", "max_tokens"))
    if what == "seed":
        body["seed"] = 2**64
    elif what == "top_k":
        body["top_k"] = 2**40
    elif what == "temperature":
        body["temperature"] = math.inf  # json.dumps writes the bare text Infinity
    elif what == "model":
        body["model"] = "no-such-model"
    elif what == "empty_prompt":
        body["prompt"] = ""
    else:
        body["max_tokens"] = target.max_model_len
    return _Plan(f"bad_{what}", "/v1/completions", json.dumps(body))


def _plan(rng: random.Random, target: Target) -> _Plan:
    """The next request of a client: 70 % good streams, 15 % disconnects, 15 % bad."""
    draw = rng.random()
    if draw >= 0.85:
        return _bad_plan(rng, target)
    chat = rng.random() < 0.5
    if draw >= 0.70:
        body = good_body(rng, target, chat, rng.randint(32, 128))
        body["ignore_eos"] = True  # long enough to be cut
        return _Plan("disconnect", api_path(chat), json.dumps(body), rng.randint(1, 8))
    body = good_body(rng, target, chat, rng.randint(8, 128))
    return _Plan("chat" if chat else "completion", api_path(chat), json.dumps(body))


# ---- sending one request and judging it ---------------------------------------------------------
@attrs.define
class _Outcome:
    status: int | None = None
    start: float = 0.0
    stamps: list[float] = attrs.Factory(list)  # arrival of each event that carries text
    is_done: bool = False  # saw [DONE]
    problem: str | None = None  # transport error, error event or unreadable event
    code: str | None = None  # the error body's code of a non-200 answer


def has_text(event: dict) -> bool:
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))


async def _send(client: httpx.AsyncClient, plan: _Plan) -> _Outcome:
    out = _Outcome(start=time.perf_counter())
    async with client.stream("POST", plan.path, content=plan.body, headers=_JSON) as reply:
        out.status = reply.status_code
        if reply.status_code != 200:
            text = (await reply.aread()).decode(errors="replace")
            out.problem, out.code = text[:200], error_code(text)
            return out
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.is_done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                out.problem = f"error event: {json.dumps(event['error'])[:200]}"
                return out
            if has_text(event):
                out.stamps.append(time.perf_counter())
            if plan.close_after is not None and len(out.stamps) >= plan.close_after:
                return out  # leaving the block closes the connection mid-stream
    return out


def error_code(text: str) -> str | None:
    try:
        return json.loads(text)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _is_overloaded(out: _Outcome) -> bool:
    """A 503 refusal past the server's queue bound (the answer overload control gives)."""
    return out.status == 503 and out.code == "overloaded"


def _judge(plan: _Plan, out: _Outcome) -> str | None:
    """What went wrong, or None."""
    if out.status is None:
        return f"{plan.kind}: {out.problem}"
    if plan.is_bad:
        return None if 400 <= out.status < 500 else f"{plan.kind}: HTTP {out.status}, want 4xx"
    if _is_overloaded(out):
        return None
    if out.status != 200:
        return f"{plan.kind}: HTTP {out.status}: {out.problem}"
    if out.problem:
        return f"{plan.kind}: {out.problem}"
    closed_early = plan.close_after is not None and len(out.stamps) >= plan.close_after
    return None if out.is_done or closed_early else f"{plan.kind}: stream ended without [DONE]"


class _Tally:
    """Counts, errors and latencies of every client."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.num_bad_4xx = 0
        self.num_overloaded = 0  # good requests refused with 503 past the queue bound
        self.num_errors = 0
        self.errors: list[str] = []
        self.ttft_s: list[float] = []
        self.itl_s: list[float] = []

    def record(self, plan: _Plan, out: _Outcome) -> None:
        self.sent[plan.kind] += 1
        problem = _judge(plan, out)
        if problem is not None:
            self.record_error(problem)
        elif plan.is_bad:
            self.num_bad_4xx += 1
        elif _is_overloaded(out):
            self.num_overloaded += 1
        if out.stamps:
            self.ttft_s.append(out.stamps[0] - out.start)
            self.itl_s.extend(b - a for a, b in zip(out.stamps, out.stamps[1:], strict=False))

    def record_error(self, problem: str) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_ERRORS_SHOWN:
            self.errors.append(problem)


@attrs.frozen
class _Run:
    """What every client of one run shares."""

    target: Target
    options: SoakOptions
    deadline: float
    tally: _Tally
    headers: dict
    exited: Callable[[], int | None]  # the server's exit code once it has exited


async def _client(index: int, run: _Run) -> None:
    rng = random.Random(run.options.seed + index)
    timeout = run.options.request_timeout_s
    async with httpx.AsyncClient(base_url=run.target.url, trust_env=False, headers=run.headers,
                                 timeout=timeout) as client:
        while time.monotonic() < run.deadline:
            plan = _plan(rng, run.target)
            try:
                out = await asyncio.wait_for(_send(client, plan), timeout)
            except asyncio.TimeoutError:
                out = _Outcome(problem=f"no end within {timeout:g} s")
            except (httpx.HTTPError, ValueError) as error:  # ValueError: an unreadable event
                out = _Outcome(problem=f"{type(error).__name__}: {error}"[:200])
            run.tally.record(plan, out)
            code = run.exited() if out.status is None else None
            if code is not None:  # no point in spinning on a dead server until the deadline
                run.tally.record_error(f"client {index}: the server exited with code {code}")
                return


# ---- the server: process, RSS, metrics ----------------------------------------------------------
class _ServerProcess:
    """``kthena serve --port 0`` as a child; its stdout is drained by a thread."""

    def __init__(self, options: SoakOptions) -> None:
        argv = [sys.executable, "-m", "kthena_core.cli", "serve", "--port", "0",
                "--model", options.model, "--kv-cache-memory", options.kv_cache_memory,
                "--shutdown-timeout", "5"]
        if options.mode == "pd":
            argv += ["--mode", "pd", "--prefill", "1", "--decode", "1"]
        if options.dp > 1:
            argv += ["--dp", str(options.dp)]
        if options.max_queue_delay is not None:
            argv += ["--max-queue-delay", f"{options.max_queue_delay:g}"]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
        env.pop("KTHENA_API_KEY", None)  # the soak sends no key to a server it starts
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._drain, name="soak-server-stdout", daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_url(self, timeout: float = 600.0) -> str:
        """The base URL from the ``curl`` line the server prints once it accepts connections.

        Raises:
            RuntimeError: the server exited or printed no such line within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith("curl "):
                return line.split()[1].split("/v1/", 1)[0]
        self.stderr.seek(0)
        raise RuntimeError("the server printed no curl line; its stderr ends with:\n"
                           + self.stderr.read()[-3000:])

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains), then wait; the exit code, or None if it had to be killed."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            self.stderr.close()


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (PD: router + workers), from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree = [pid]
    for parent in tree:  # grows while iterating: breadth-first
        tree.extend(children.get(parent, ()))
    return tree


def _rss_mib(pid: int) -> tuple[float, int]:
    """Summed VmRSS of the process tree of ``pid`` and the number of processes in it."""
    total_kib, num_processes = 0, 0
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue  # exited meanwhile
        num_processes += 1
        total_kib += next((int(line.split()[1]) for line in status.splitlines()
                           if line.startswith("VmRSS:")), 0)
    return round(total_kib / 1024, 1), num_processes


async def _sample_rss(pid: int, t0: float, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append([round(time.monotonic() - t0, 1), *_rss_mib(pid)])
        try:
            await asyncio.wait_for(stop.wait(), RSS_PERIOD_S)
        except asyncio.TimeoutError:
            pass


async def _scrape(client: httpx.AsyncClient) -> tuple[dict, dict]:
    """(the KV and queue gauges, finished requests by finish_reason) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = await client.get("/metrics")
    reply.raise_for_status()
    gauges: dict[str, float] = {}
    reasons: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            if sample.name in _GAUGES:
                gauges[sample.name] = sample.value
            elif sample.name == "kthena_requests_total":
                reasons[sample.labels.get("finish_reason", "")] = sample.value

    return gauges, reasons


async def _num_rejected(client: httpx.AsyncClient) -> float:
    """Refusals past the queue bound the server counted (a DP replica's that the router passed
    on to another replica too)."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = await client.get("/metrics")
    reply.raise_for_status()
    return sum(s.value for f in text_string_to_metric_families(reply.text) for s in f.samples
               if s.name in ("kthena_requests_rejected_total",
                             "kthena_dp_rejected_requests_total"))


async def _wait_idle(client: httpx.AsyncClient) -> tuple[dict, dict, bool | None]:
    """Scrape until nothing runs, waits or holds a block (None: the server has no such gauges)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        gauges, reasons = await _scrape(client)
        if set(_GAUGES) - set(gauges):
            return gauges, reasons, None
        if not (gauges["kthena_num_requests_running"] or gauges["kthena_num_requests_waiting"]
                or gauges["kthena_kv_blocks_used"]):
            return gauges, reasons, True
        if time.monotonic() > deadline:
            return gauges, reasons, False
        await asyncio.sleep(0.5)


# ---- the run ------------------------------------------------------------------------------------
async def _target(client: httpx.AsyncClient, options: SoakOptions) -> Target:
    card = (await client.get("/v1/models")).raise_for_status().json()["data"][0]
    rng = random.Random(options.seed)
    preambles = tuple(_text(rng, 128) for _ in range(4))
    return Target(str(client.base_url), card["id"], int(card["max_model_len"]), preambles)


async def _warm_up(client: httpx.AsyncClient, target: Target) -> None:
    body = {"model": target.model, "max_tokens": 4, "messages": [{"role": "user",
                                                                  "content": "Hello"}]}
    (await client.post("/v1/chat/completions", json=body)).raise_for_status()


def pcts_ms(values: list[float]) -> dict:
    ordered = sorted(values)

    def pct(q: float) -> float | None:
        if not ordered:
            return None
        return round(1000 * ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 1)

    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "n": len(ordered)}


async def _soak(url: str, pid: int | None, exited: Callable[[], int | None],
                options: SoakOptions, overload_phase: OverloadPhase | None) -> dict:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    async with httpx.AsyncClient(base_url=url, trust_env=False, headers=headers,
                                 timeout=options.request_timeout_s) as admin:
        target = await _target(admin, options)
        await _warm_up(admin, target)
        samples: list = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        sampler = asyncio.create_task(_sample_rss(pid, t0, samples, stop)) if pid else None
        run = _Run(target, options, t0 + 60 * options.minutes, _Tally(), headers, exited)
        await asyncio.gather(*(_client(i, run) for i in range(options.clients)))
        elapsed = time.monotonic() - t0
        overload = None
        if options.overload:
            if overload_phase is None:
                raise ValueError("--overload needs the overload phase: run_soak(options, "
                                 "overload_phase=kthena_serve.bench.overload.soak_phase)")
            overload = await overload_phase(target, options, headers)
            overload["server_rejections"] = await _num_rejected(admin)
        try:
            gauges, reasons, is_idle = await _wait_idle(admin)
        except httpx.HTTPError as error:
            run.tally.record_error(f"/metrics after the run: {type(error).__name__}: {error}")
            gauges, reasons, is_idle = {}, {}, None
        if sampler is not None:
            stop.set()
            await sampler
            samples.append([round(time.monotonic() - t0, 1), *_rss_mib(pid)])
    result = _report(options, target.model, run.tally, elapsed, samples,
                     (gauges, reasons, is_idle))
    if overload is not None:
        result["overload"] = overload
    return result


# The overload phase (``bench.overload.soak_phase``), passed in by the caller: that module
# builds on this one's request plans, so this one cannot import it.
OverloadPhase = Callable[["Target", "SoakOptions", dict], Awaitable[dict]]


def _report(options: SoakOptions, served_model: str, tally: _Tally, elapsed: float,
            samples: list, after: tuple[dict, dict, bool | None]) -> dict:
    gauges, reasons, is_idle = after
    values = [mib for _, mib, _ in samples]
    rss = {"samples": [[t, mib] for t, mib, _ in samples],
           "num_processes": samples[-1][2] if samples else None,  # in the tree, at the end
           "first": values[0] if values else None, "last": values[-1] if values else None,
           "max": max(values, default=None)}
    return {"bench": "kthena soak", "mode": options.mode, "dp": options.dp,
            "max_queue_delay": options.max_queue_delay, "clients": options.clients,
            "minutes": options.minutes, "seed": options.seed, "model": served_model,
            "kv_cache_memory": None if options.url else options.kv_cache_memory,
            "url": options.url,
            "elapsed_s": round(elapsed, 1), "counts": dict(sorted(tally.sent.items())),
            "num_requests": sum(tally.sent.values()), "num_bad_4xx": tally.num_bad_4xx,
            "num_overloaded_503": tally.num_overloaded,
            "num_errors": tally.num_errors, "errors": tally.errors,
            "ttft_ms": pcts_ms(tally.ttft_s), "itl_ms": pcts_ms(tally.itl_s), "rss_mib": rss,
            "kv_after": gauges, "idle_after": is_idle, "finish_reasons": reasons}


def run_soak(options: SoakOptions, overload_phase: OverloadPhase | None = None) -> dict:
    """Start the server (unless ``options.url``), soak it, stop it; the JSON-ready result.

    ``overload_phase`` runs ``options.overload`` (``kthena_serve.bench.overload.soak_phase``).

    Raises:
        RuntimeError: the server did not start, or did not answer /v1/models or the warm-up.
    """
    machine = host_info()
    server = None if options.url else _ServerProcess(options)
    exit_code = None
    try:
        url = options.url.rstrip("/") if options.url else server.wait_url()
        pid = options.server_pid if options.url else server.proc.pid
        print(f"kthena bench soak: {options.clients} clients for {options.minutes:g} min "
              f"against {url}", file=sys.stderr, flush=True)
        exited = (lambda: None) if server is None else server.proc.poll
        try:
            result = asyncio.run(_soak(url, pid, exited, options, overload_phase))
        except httpx.HTTPError as error:
            raise RuntimeError(f"{url} did not answer: {type(error).__name__}: {error}") from None
    finally:
        if server is not None:
            exit_code = server.stop()
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["machine"] = machine
    if server is not None:
        result["server_exit_code"] = exit_code
    return result
