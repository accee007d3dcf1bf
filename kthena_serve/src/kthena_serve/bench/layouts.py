"""``kthena bench layouts``: TP / PP / DP layouts of this host, measured over HTTP next to the
planner's prediction for each, before and after calibration.

::

    calibration: `kthena bench serve` JSONs (--calibrate, --calibrate-cores), or its cases
                 a, b run now at TP=1: with every core's threads, and with one thread
    for each layout (tp1, pp2, dp2, ...):
        kthena serve --tp T --pp P --dp D --port 0 (a child on the same cores) -> warm-up
        runs x { batch 1:     requests one at a time, streamed   -> TTFT, TPOT
                 concurrent:  --requests at --concurrency        -> output tok/s, median TPOT }
        SIGTERM; every process of its tree must be gone
    predictions: the planner on that pinned layout, default CostParams and calibrated ones
    -> one JSON (--out) and a markdown table

Every layout gets the same fixed-seed prompts (token ids, ``ignore_eos``, greedy), fresh ones
each run so no run hits the prefix cache of an earlier one.

**Which topology a prediction uses** follows how the engine places ranks. One rank (tp1)
runs on every core through torch's intra-op threads: the host as one device (``kthena topo``'s
CPU device). Several ranks are pinned one per core (parallel_runner.py, dp/launcher.py when
replicas = cores): ``auto:cores``. Each is calibrated on a bench that ran like it: the host on
every core's threads, a core on one thread (`_calibrations`); `calibrate` fits a bench on the
cores it used, with the per-core figures, so the factors carry over.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kthena_core.layout import Layout
from kthena_serve.bench.machine import cpu_model

if TYPE_CHECKING:
    import httpx

    from kthena_core.calibrate import Calibration
    from kthena_core.cost_model import CostParams
    from kthena_core.discovery import CpuFacts, HostFigures
    from kthena_core.model_spec import ModelSpec
    from kthena_core.topology import Topology

__all__ = ["LayoutBenchError", "LayoutBenchOptions", "LayoutSpec", "add_parser", "assemble",
           "calibrate", "format_table", "parse_layouts", "predict_layout", "predictions",
           "run_layout_bench", "summarize"]

# The figures compared with the planner, and how each is shown in the table.
MEASURES = ("batch1_ttft_s", "batch1_tpot_s", "throughput_tok_s", "tpot_s")
_LABELS = {"batch1_ttft_s": "batch-1 TTFT ms", "batch1_tpot_s": "batch-1 TPOT ms",
           "throughput_tok_s": "throughput tok/s", "tpot_s": "TPOT @c ms"}
_PROMPT_IDS = (100, 40000)  # token ids drawn for prompts, as `kthena bench serve` draws them


class LayoutBenchError(RuntimeError):
    """A server did not start, or answered a benchmark request with an error."""


@attrs.frozen
class LayoutSpec:
    """One layout to serve (``kthena serve --tp tp --pp pp --dp dp``), under the name given."""

    name: str
    layout: Layout = Layout(1)


def parse_layouts(text: str) -> tuple[LayoutSpec, ...]:
    """``"tp1,pp2,dp2"`` (also ``tp2``, ``tp1pp2``) -> layouts; unnamed sizes are 1.

    Raises:
        ValueError: a name that is not (tp|pp|dp)N..., a size < 1, or a repeated layout.
    """
    layouts: list[LayoutSpec] = []
    for name in filter(None, (part.strip() for part in text.split(","))):
        parts = re.findall(r"(tp|pp|dp)(\d+)", name)
        if not parts or "".join(k + n for k, n in parts) != name or len({k for k, _ in parts}) < len(parts):
            raise ValueError(f"--layouts: {name!r} is not a layout; write tpN, ppN, dpN or a "
                             "combination such as tp1pp2")
        sizes = {k: int(n) for k, n in parts}
        if min(sizes.values()) < 1:
            raise ValueError(f"--layouts: {name!r}: sizes must be >= 1")
        layout = Layout(**{"tp": 1, **sizes})
        if any(x.layout == layout for x in layouts):
            raise ValueError(f"--layouts: {name!r} repeats a layout given before it")
        layouts.append(LayoutSpec(name, layout))
    if not layouts:
        raise ValueError("--layouts: name at least one layout, e.g. tp1,pp2,dp2")
    return tuple(layouts)


@attrs.frozen
class LayoutBenchOptions:
    """What `run_layout_bench` serves and sends (the ``kthena bench layouts`` flags)."""

    layouts: tuple[LayoutSpec, ...] = parse_layouts("tp1,pp2,dp2")
    requests: int = 16
    prompt_len: int = 128
    output_len: int = 32
    concurrency: int = 8
    runs: int = 3
    calibrate: str | None = None  # a `kthena bench serve` JSON; None: run its cases a, b now
    calibrate_cores: str | None = None  # the same with --threads 1, for the auto:cores layouts
    model: str = "default"
    kv_cache_memory: str = "256MiB"
    seed: int = 0
    batch1_requests: int = 2  # per run
    ready_timeout_s: float = 300.0


# ---- measurement: pure summaries ----------------------------------------------------------------
def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarize(runs: Sequence[Mapping[str, float | None]]) -> dict[str, Any]:
    """Medians over runs of each figure, plus the per-run values they came from."""
    keys = list(runs[0])
    out: dict[str, Any] = {k: _median([r[k] for r in runs]) for k in keys}
    out["per_run"] = {k: [r[k] for r in runs] for k in keys}
    return out


# ---- predictions --------------------------------------------------------------------------------
def predict_layout(model: ModelSpec, spec: LayoutSpec, options: LayoutBenchOptions,
                   params: CostParams, host: Topology, cores: Topology) -> dict[str, Any]:
    """The planner's figures for ``spec``'s layout pinned, with ``params``, on the host device
    (one rank) or on one device per core (several ranks): batch 1 and at ``concurrency``."""
    from kthena_core.planner import Planner
    from kthena_core.shape import equal_split_points
    from kthena_core.workload import Workload

    pinned = spec.layout
    topology = host if pinned.num_devices == 1 else cores
    out: dict[str, Any] = {"topology": topology.source, "feasible": False}
    if pinned.num_devices > topology.num_devices:
        out["reasons"] = [f"{pinned.num_devices} ranks > {topology.num_devices} devices"]
        return out
    planner = Planner(params)
    # the server below runs --pp alone: equal stages, so they are what is predicted
    equal = (equal_split_points(model.shape.num_layers, pinned.pp)
             if pinned.pp > 1 and model.shape.num_layers % pinned.pp == 0 else None)
    figures: dict[str, float] = {}
    for concurrency, prefix in ((1, "batch1_"), (options.concurrency, "")):
        wl = Workload(options.prompt_len, options.output_len, concurrency, "bf16", "bf16")
        judged = planner.evaluate(model, topology, wl, pinned, split_points=equal)
        if not judged.feasible or judged.estimate is None:
            out["reasons"] = list(judged.reasons)
            return out
        est = judged.estimate
        figures.update({f"{prefix}ttft_s": est.ttft_s, f"{prefix}tpot_s": est.tpot_s})
        if not prefix:
            figures["throughput_tok_s"] = est.throughput_tok_s
        else:
            # The planner's TPOT spreads the batch's prefills over its tokens (cost_model
            # estimate_colocated: step + batch x TTFT / output_len). A request alone is timed
            # from its first token, after its prefill: compare the decode step, as calibrate does.
            figures["batch1_tpot_s"] = est.tpot_s - est.ttft_s / options.output_len
    return {**out, "feasible": True, **{k: figures[k] for k in MEASURES}}


def predictions(model: ModelSpec, layout: LayoutSpec, options: LayoutBenchOptions,
                cals: Mapping[str, Any], host: Topology, cores: Topology,
                ) -> dict[str, dict[str, Any]]:
    """``predicted_default`` and ``predicted_calibrated`` of ``layout``; the calibration is
    ``cals["host"]`` for one rank, ``cals["cores"]`` for one rank per core."""
    from kthena_core.cost_model import CostParams

    cal = cals["host" if layout.layout.num_devices == 1 else "cores"]
    return {"predicted_default": predict_layout(model, layout, options, CostParams(), host, cores),
            "predicted_calibrated": {**predict_layout(model, layout, options, cal.params, host, cores),
                                     "calibration": cal.source}}


def calibrate(bench: Mapping[str, Any], model: ModelSpec, facts: CpuFacts,
              source: str, host: HostFigures | None = None) -> Calibration:
    """Fit the cost model to ``bench`` on the device it ran on: ``machine.torch_threads`` cores
    (default all), with the figures of the bench's own probe where it carries one
    (``kthena_core.bench_record.bench_topology``), else those of ``auto:cores`` devices of this host
    (measured by ``host``: the host probe's figures). The factors then scale the per-core
    figures the predictions use, whatever the bench's threads. A bench of another CPU model is
    said so on stderr, naming both.

    Raises:
        CalibrationError: the bench JSON does not fit this model, or the fit is unphysical.
    """
    from kthena_core.bench_record import bench_cpu, cpu_text, same_cpu
    from kthena_core.calibrate import fit_calibration
    from kthena_core.discovery import cpu_topology
    from kthena_core.discovery.host_probe import cpu_label

    ran, here = bench_cpu(bench), dict(host.cpu) if host is not None and host.cpu else cpu_label()
    if not same_cpu(ran, here):
        log(f"{source} ran on {cpu_text(ran)}, this machine is {cpu_text(here)}: the factors "
             "are fitted to that CPU's own probe and applied here to this machine's figures")
    threads = int((bench.get("machine") or {}).get("torch_threads") or facts.num_cores)
    core = cpu_topology(facts, per_core=True, host=host).devices[0].spec
    ran_on = cpu_topology(facts, host=host)
    device = ran_on.devices[0]
    spec = attrs.evolve(device.spec, memory_bw=core.memory_bw * threads,
                        peak_flops={k: v * threads for k, v in core.peak_flops.items()},
                        source=f"{threads} x ({core.source})")
    ran_on = attrs.evolve(ran_on, devices=(attrs.evolve(device, spec=spec),))
    return fit_calibration(bench, model, ran_on, source=source)


# ---- the result: JSON and table -----------------------------------------------------------------
def _ratios(measured: Mapping[str, Any], predicted: Mapping[str, Any]) -> dict[str, float | None]:
    return {k: (measured[k] / predicted[k] if measured.get(k) and predicted.get(k) else None)
            for k in MEASURES}


def assemble(machine: Mapping[str, Any], workload: Mapping[str, Any],
             calibration: Mapping[str, Any] | None,
             layouts: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON of a run. ``layouts``: name -> {"layout", "measured", "predicted_default",
    "predicted_calibrated"}; ratios (measured / predicted) and the figures relative to tp1 are
    added here."""
    out: dict[str, Any] = {}
    base = layouts.get("tp1")
    for name, entry in layouts.items():
        row = dict(entry)
        row["ratio"] = {kind: _ratios(entry["measured"], entry[f"predicted_{kind}"])
                        for kind in ("default", "calibrated")}
        if base is not None:
            row["vs_tp1"] = {src: _ratios(entry[src], base[src]) for src in
                             ("measured", "predicted_default", "predicted_calibrated")}
        out[name] = row
    return {"bench": "kthena layouts", "machine": dict(machine), "workload": dict(workload),
            "calibration": dict(calibration) if calibration else None, "layouts": out}


def _cell(value: float | None, key: str) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if key == "throughput_tok_s" else f"{value * 1e3:.1f}"


def format_table(result: Mapping[str, Any]) -> str:
    """Markdown: one row per layout, each figure as measured / default / calibrated prediction."""
    head = ["layout", "planned on", *(_LABELS[k] for k in MEASURES), "tok/s vs tp1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in result["layouts"].items():
        source = row["predicted_default"].get("topology", "")
        cells = [name, "auto:cores" if source.endswith(":per-core") else "host"]
        for key in MEASURES:
            cells.append(" / ".join(_cell(row[src].get(key), key) for src in
                                    ("measured", "predicted_default", "predicted_calibrated")))
        vs = row.get("vs_tp1")
        cells.append(" / ".join("-" if vs is None or vs[s]["throughput_tok_s"] is None
                                else f"{vs[s]['throughput_tok_s']:.2f}x"
                                for s in ("measured", "predicted_default", "predicted_calibrated")))
        lines.append("| " + " | ".join(cells) + " |")
    ratios = [r for row in result["layouts"].values()
              for r in row.get("ratio", {}).get("calibrated", {}).values() if r]
    if ratios:
        within = sum(abs(1 / r - 1) <= 0.25 for r in ratios)
        lines.append(f"\ncalibrated prediction within ±25% of measured: {within} of "
                     f"{len(ratios)} figures (worst {max(abs(1 / r - 1) for r in ratios):.0%})")
    m = result["machine"]
    lines.append(f"\nmeasured / planner default / planner calibrated; {m.get('cpu')}, "
                 f"{m.get('cores')} cores, load {m.get('loadavg_before')} -> {m.get('loadavg_after')}")
    return "\n".join(lines)


# ---- the server ---------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc/*/stat)."""
    from kthena_serve.bench.soak import process_tree

    return process_tree(pid)[1:]


def _alive(pid: int) -> bool:
    """``pid`` runs and is not a zombie (exited, not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class LayoutServer:
    """``kthena serve`` of one layout as a child process; its output is drained by a thread."""

    def __init__(self, layout: Layout, options: LayoutBenchOptions,
                 extra: Sequence[str] = ()) -> None:
        argv = [sys.executable, "-m", "kthena_core.cli", "serve", "--port", "0",
                "--tp", str(layout.tp), "--pp", str(layout.pp), "--dp", str(layout.dp),
                "--model", options.model, "--dtype", "bfloat16",
                "--kv-cache-memory", options.kv_cache_memory, "--shutdown-timeout", "5", *extra]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
        env.pop("KTHENA_API_KEY", None)  # it sends no key to a server it starts
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.tail: list[str] = []
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._drain, name="layout-bench-server", daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-40:]
            if self.url is None and (m := re.search(r" on (http://\S+) ", line)):
                self.url = m[1]
            if line.startswith("curl ") and self.url:
                self.ready.set()
        self.ready.set()  # exited: wait_url sees no URL

    def wait_url(self, timeout: float) -> str:
        """The base URL once the server accepts connections.

        Raises:
            LayoutBenchError: it exited or printed no ready line within ``timeout``.
        """
        if not self.ready.wait(timeout) or self.proc.poll() is not None or self.url is None:
            raise LayoutBenchError("kthena serve printed no ready line; its output ends with:\n"
                                   + "".join(self.tail[-20:]))
        return self.url

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        """SIGTERM, wait; then any process of its tree still alive is killed and counted."""
        tree = _descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
            self.proc.wait()
        deadline = time.monotonic() + 10.0  # helpers (multiprocessing's resource tracker)
        while (left := [pid for pid in tree if _alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)  # exit a moment after the server, on their own
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return {"exit_code": code, "leftover_processes": len(left)}


# ---- the workload over HTTP ---------------------------------------------------------------------
def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(*_PROMPT_IDS) for _ in range(length)] for _ in range(count)]


async def run_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
               max_tokens: int) -> dict:
    """Stream one completion: TTFT, TPOT (first to last token over tokens - 1), replica."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise LayoutBenchError(f"POST /v1/completions: {resp.status_code} "
                                   f"{(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise LayoutBenchError(f"error event in a stream: {event['error']}")
            if event.get("choices"):
                last = time.perf_counter()
                first = first or last
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if first is None or last is None or tokens < 1:
        raise LayoutBenchError("a stream ended without tokens")
    return {"ttft_s": first - start, "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens, "replica": resp.headers.get("x-kthena-replica")}


async def _concurrent(client: httpx.AsyncClient, url: str, model: str, prompts: list[list[int]],
                      max_tokens: int, concurrency: int) -> tuple[dict, list[dict]]:
    import asyncio

    gate = asyncio.Semaphore(concurrency)

    async def go(prompt: list[int]) -> dict:
        async with gate:
            return await run_one(client, url, model, prompt, max_tokens)

    start = time.perf_counter()
    samples = await asyncio.gather(*(go(p) for p in prompts))
    wall = time.perf_counter() - start
    return ({"throughput_tok_s": sum(s["tokens"] for s in samples) / wall,
             "tpot_s": _median([s["tpot_s"] for s in samples]),
             "ttft_s": _median([s["ttft_s"] for s in samples])}, samples)


async def _measure(url: str, options: LayoutBenchOptions) -> dict[str, Any]:
    import httpx

    o = options
    async with httpx.AsyncClient(timeout=600.0) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await run_one(client, url, model, random_prompts(1, o.prompt_len, o.seed - 1)[0], o.output_len)
        await _concurrent(client, url, model, random_prompts(o.concurrency, o.prompt_len, o.seed - 2),
                          4, o.concurrency)  # warm-up: batch 1, then the batched shapes
        runs, replicas = [], {}
        for run in range(o.runs):
            seed = o.seed + 1000 * (run + 1)
            batch1 = [await run_one(client, url, model, p, o.output_len)
                      for p in random_prompts(o.batch1_requests, o.prompt_len, seed)]
            figures, samples = await _concurrent(client, url, model,
                                                 random_prompts(o.requests, o.prompt_len, seed + 1),
                                                 o.output_len, o.concurrency)
            for s in batch1 + samples:
                if s["replica"]:
                    replicas[s["replica"]] = replicas.get(s["replica"], 0) + 1
            runs.append({"batch1_ttft_s": _median([s["ttft_s"] for s in batch1]),
                         "batch1_tpot_s": _median([s["tpot_s"] for s in batch1]), **figures})
            log(f"  run {run + 1}/{o.runs}: " + ", ".join(f"{k} {v:.4g}" for k, v in runs[-1].items()
                                                         if v is not None))
    out = summarize(runs)
    if replicas:
        out["requests_per_replica"] = dict(sorted(replicas.items()))
    return out


def measure_layout(layout: LayoutSpec, options: LayoutBenchOptions) -> dict[str, Any]:
    """Serve ``layout``, run the workload, stop the server; the medians and how it went."""
    import asyncio  # here: `kthena` builds this parser on every command

    load = os.getloadavg()[0]
    started = time.perf_counter()
    server = LayoutServer(layout.layout, options)
    try:
        url = server.wait_url(options.ready_timeout_s)
        log(f"{layout.name}: serving on {url} after {time.perf_counter() - started:.0f} s")
        measured = asyncio.run(_measure(url, options))
    finally:
        stopped = server.stop()
    return {**measured, **stopped, "loadavg_1m_before": round(load, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2)}


# ---- the run ------------------------------------------------------------------------------------
def log(text: str) -> None:
    print(f"kthena bench layouts: {text}", file=sys.stderr, flush=True)


def machine_record() -> dict[str, Any]:
    cpu = cpu_model()
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = None
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "torch": torch,
            "loadavg_before": [round(x, 2) for x in os.getloadavg()]}


def _bench_serve(options: LayoutBenchOptions, threads: int | None) -> dict[str, Any]:
    """Run ``kthena bench serve --cases a,b`` (TP=1, no transformers) and return its JSON."""
    argv = [sys.executable, "-m", "kthena_core.cli", "bench", "serve", "--cases", "a,b",
            "--no-hf", "--plot", "", "--runs", str(options.runs), "--model", options.model,
            "--dtype", "bfloat16", *(["--threads", str(threads)] if threads else [])]
    log("calibrating: " + " ".join(["kthena", *argv[3:]]))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise LayoutBenchError(f"kthena bench serve exited with {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _calibrations(options: LayoutBenchOptions, model: ModelSpec, facts: CpuFacts,
                  host_figures: HostFigures | None = None) -> dict[str, Any]:
    """{"host": Calibration, "cores": Calibration, "benches": {...}}: one fit per kind of device.

    Threads do not scale a small model's step evenly (batch 1 on this project's 2 cores: one
    thread is as fast as two), so the host is fitted on a bench with every core's threads and
    a core on a one-thread bench. ``--calibrate`` alone serves both; with neither flag both
    benches run now (one when the host has a single core).
    """
    from kthena_core.bench_record import load_bench

    host_bench = load_bench(options.calibrate) if options.calibrate else _bench_serve(options, None)
    if options.calibrate_cores:
        core_bench = load_bench(options.calibrate_cores)
    elif options.calibrate or facts.num_cores == 1:
        core_bench = None
    else:
        core_bench = _bench_serve(options, 1)
    this_run = "kthena bench serve --cases a,b{} (this run)"
    host = calibrate(host_bench, model, facts, options.calibrate or this_run.format(""),
                     host_figures)
    cores = host if core_bench is None else calibrate(
        core_bench, model, facts, options.calibrate_cores or this_run.format(" --threads 1"),
        host_figures)
    return {"host": host, "cores": cores, "benches": {"host": host_bench, "cores": core_bench}}


def run_layout_bench(options: LayoutBenchOptions) -> dict[str, Any]:
    """Calibrate, measure every layout, predict each; returns the JSON-ready result.

    Raises:
        CalibrationError: the bench JSON does not fit the model.
        LayoutBenchError: a server did not start or failed a request.
    """
    from kthena_core.cache_dir import default_cache_dir, host_probe_file
    from kthena_core.discovery import cpu_topology, measure_host, read_cpu_facts
    from kthena_core.known_models import load_model_spec

    machine = machine_record()
    model = load_model_spec(options.model)
    facts = read_cpu_facts()
    # the peaks the factors are fractions of (KTHENA_HOST_PROBE: a recorded probe instead)
    measured = measure_host(default_cache_dir(), probe_file=host_probe_file())
    machine["host_probe"] = measured.to_dict() if measured else None
    cals = _calibrations(options, model, facts, measured)
    host = cpu_topology(facts, host=measured)
    cores = cpu_topology(facts, per_core=True, host=measured)
    rows: dict[str, dict[str, Any]] = {}
    for layout in options.layouts:
        lay = layout.layout
        log(f"{layout.name}: starting kthena serve --tp {lay.tp} --pp {lay.pp} --dp {lay.dp}")
        rows[layout.name] = {"layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp},
                             "measured": measure_layout(layout, options),
                             **predictions(model, layout, options, cals, host, cores)}
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    workload = {"model": options.model, "dtype": "bfloat16", "prompt_len": options.prompt_len,
                "output_len": options.output_len, "requests": options.requests,
                "concurrency": options.concurrency, "runs": options.runs,
                "batch1_requests_per_run": options.batch1_requests, "seed": options.seed,
                "kv_cache_memory": options.kv_cache_memory}
    calibration = {kind: {**cals[kind].to_dict(), "bench": cals["benches"][kind] or "as host"}
                   for kind in ("host", "cores")}
    return assemble(machine, workload, calibration, rows)


# ---- command line -------------------------------------------------------------------------------
def add_parser(children: argparse._SubParsersAction) -> None:
    """Add ``kthena bench layouts`` to the ``kthena bench`` subcommands."""
    parser = children.add_parser("layouts", help="TP / PP / DP layouts of this host over HTTP: "
                                 "throughput and TPOT next to the planner's predictions")
    parser.add_argument("--layouts", default="tp1,pp2,dp2", help="e.g. tp1,pp2,dp2,tp2")
    parser.add_argument("--requests", type=int, default=16, help="requests of the concurrent phase")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per layout (median)")
    parser.add_argument("--calibrate", default=None, metavar="BENCH.json",
                        help="a `kthena bench serve` JSON of this model on this machine "
                             "(default: run its cases a and b at TP=1 first)")
    parser.add_argument("--calibrate-cores", default=None, metavar="BENCH.json",
                        help="the same from `kthena bench serve --threads 1`, for the layouts "
                             "of one rank per core (default: --calibrate's; with neither, run "
                             "both benches first)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV pool of each server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, metavar="FILE.json",
                        help="write the JSON here and print the table (default: JSON on "
                             "stdout, the table on stderr)")
    parser.set_defaults(func=_cmd_layouts)


def _cmd_layouts(args: argparse.Namespace) -> int:
    try:
        options = LayoutBenchOptions(
            layouts=parse_layouts(args.layouts), requests=args.requests, prompt_len=args.prompt_len,
            output_len=args.output_len, concurrency=args.concurrency, runs=args.runs,
            calibrate=args.calibrate, calibrate_cores=args.calibrate_cores, model=args.model,
            kv_cache_memory=args.kv_cache_memory, seed=args.seed)
        if min(options.requests, options.prompt_len, options.output_len, options.concurrency,
               options.runs) < 1:
            raise ValueError("--requests, --prompt-len, --output-len, --concurrency and --runs "
                             "must be >= 1")
        result = run_layout_bench(options)
    except (ValueError, LayoutBenchError) as error:
        print(f"kthena bench layouts: {error}", file=sys.stderr)
        return 2
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(format_table(result))
    else:
        print(text)
        print(format_table(result), file=sys.stderr)
    return 0
