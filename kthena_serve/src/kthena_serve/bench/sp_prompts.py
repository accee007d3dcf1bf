"""``kthena bench layouts --sp-prompts 2048,4096,8191``: long prompts at TP=2 with and without
sequence parallelism, measured over HTTP next to the planner's prediction for each.

::

    collectives: 2 gloo ranks (one core, one thread each), [tokens, hidden] bf16 per prompt
                 length: all-reduce, reduce-scatter, all-gather -> sp_collective_factor
                 = (reduce-scatter + all-gather) / all-reduce, measured in this run
    kthena serve --tp 2                                --max-num-batched-tokens MAX
    kthena serve --tp 2 --sp 2 --sp-min-tokens MIN     (each prompt is one forward), side by
        side on the same 2 cores -> warm-up both
    for each prompt length, shortest first: runs x (one request to each server in turn, the
        order swapped every run, max_tokens 1, streamed) -> TTFT, prefill tokens/s; then each
        rank's peak RSS (VmHWM: it only grows, so after the longest prompt so far it is that
        prompt's peak)
    SIGTERM both
    predictions: the planner on Layout(2, sp=1 or 2) on auto:cores, prompt_len = the length,
                 latency objective; with the default factors, and with the measured
                 sp_collective_factor (and a calibration's factors with --calibrate-cores)

Fresh fixed-seed prompts per run (no prefix hits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kthena_core.discovery.host_probe import sample_times
from kthena_core.layout import Layout
from kthena_serve.bench.layouts import (
    LayoutBenchError,
    LayoutBenchOptions,
    LayoutServer,
    calibrate,
    log,
    machine_record,
    random_prompts,
    run_one,
)

if TYPE_CHECKING:
    from kthena_core.cost_model import CostParams
    from kthena_core.model_spec import ModelSpec
    from kthena_core.topology import Topology

__all__ = ["SpBenchOptions", "add_sp_arguments", "format_sp_table", "measure_collectives",
           "parse_prompt_lens", "plot_sp", "predict_sp", "run_sp_bench", "write_sp_result"]

DEFAULT_SP_PROMPTS = (2048, 4096, 8191)  # 8K: SmolLM2's context is 8192, one token is generated


def parse_prompt_lens(text: str) -> tuple[int, ...]:
    """``"2048,4096,8191"`` -> (2048, 4096, 8191), ascending.

    Raises:
        ValueError: not comma-separated ints >= 2.
    """
    try:
        lens = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--sp-prompts: {text!r} is not comma-separated prompt lengths, "
                         "e.g. 2048,4096,8191") from None
    if not lens or lens[0] < 2:
        raise ValueError(f"--sp-prompts: {text!r}: give prompt lengths of at least 2 tokens")
    return tuple(lens)


@attrs.frozen
class SpBenchOptions:
    """What `run_sp_bench` serves and sends."""

    prompt_lens: tuple[int, ...] = DEFAULT_SP_PROMPTS
    runs: int = 3
    model: str = "default"
    kv_cache_memory: str = "512MiB"
    seed: int = 0
    calibrate_cores: str | None = None  # a `kthena bench serve --threads 1` JSON
    ready_timeout_s: float = 300.0


# ---- collectives ----------------------------------------------------------------------------------
def _collective_rank(rank: int, port: int, rows: Sequence[int], hidden: int, repeat: int,
                     out: Any) -> None:  # noqa: ANN401 - a multiprocessing queue
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    result = {}
    for n in rows:
        n += n % 2
        full = torch.randn(n, hidden).to(torch.bfloat16)
        half = torch.empty(n // 2, hidden, dtype=torch.bfloat16)
        ops = {"all_reduce": lambda f=full: dist.all_reduce(f),
               "reduce_scatter": lambda f=full, h=half: scatter(h, f),
               "all_gather": lambda f=full, h=half: gather(f, h)}
        times: dict[str, float] = {}
        for name, op in ops.items():
            times[name] = statistics.median(sample_times(op, repeat))
        result[n] = times
    dist.destroy_process_group()
    if rank == 0:
        out.put(result)


def measure_collectives(rows: Sequence[int], hidden: int, repeat: int = 10) -> dict[str, Any]:
    """Median seconds of an all-reduce, reduce-scatter and all-gather of [rows, hidden] bf16
    over 2 gloo ranks on loopback (one core, one thread each, as the engine's ranks run), and
    their ratio ``(reduce_scatter + all_gather) / all_reduce`` per size."""
    import multiprocessing as mp

    from kthena_core.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        procs = [ctx.Process(target=_collective_rank, args=(r, port, list(rows), hidden, repeat,
                                                            queue)) for r in range(2)]
        for p in procs:
            p.start()
        result = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    sizes = {str(n): {**t, "sp_collective_factor": (t["reduce_scatter"] + t["all_gather"])
                      / t["all_reduce"]} for n, t in result.items()}
    return {"hidden": hidden, "dtype": "bfloat16", "ranks": 2, "backend": "gloo",
            "sizes": sizes}


# ---- predictions --------------------------------------------------------------------------------
def predict_sp(model: ModelSpec, prompt_len: int, sp: int, params: CostParams,
               cores: Topology) -> dict[str, Any]:
    """The planner's TTFT and activation memory per device for one prompt of ``prompt_len``
    at TP=2 (sp 1 or 2) on one device per core."""
    from kthena_core.planner import Planner
    from kthena_core.workload import Workload

    wl = Workload(prompt_len, 1, 1, "bf16", "bf16", objective="latency")
    judged = Planner(params).evaluate(model, cores, wl, Layout(2, sp=sp))
    if judged.estimate is None or judged.memory is None:
        return {"feasible": False, "reasons": list(judged.reasons)}
    return {"feasible": judged.feasible, "ttft_s": judged.estimate.ttft_s,
            "activations_mib": judged.memory.activations / 2**20}


# ---- measurement ----------------------------------------------------------------------------------
def _rank_pids(server_pid: int) -> list[int]:
    """Rank 0 (the server) and its spawned ranks (multiprocessing children, not its helpers)."""
    from kthena_serve.bench.soak import process_tree

    ranks = [server_pid]
    for pid in process_tree(server_pid)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            ranks.append(pid)
    return ranks


def _peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _serve_args(sp: int, options: SpBenchOptions) -> list[str]:
    extra = ["--max-num-batched-tokens", str(max(options.prompt_lens)), "--max-num-seqs", "1"]
    if sp > 1:
        extra += ["--sp", str(sp), "--sp-min-tokens", str(min(options.prompt_lens))]
    return extra


def measure_sp(options: SpBenchOptions) -> dict[int, dict[str, Any]]:
    """Serve TP=2 without and with SP side by side and time every prompt length on each in
    turn (the order swapped every run), so both see the same load; rows per length per sp."""
    import asyncio

    import httpx

    serve = LayoutBenchOptions(model=options.model, kv_cache_memory=options.kv_cache_memory)
    servers: dict[int, LayoutServer] = {}
    rows: dict[int, dict[str, Any]] = {1: {}, 2: {}}
    try:
        for sp in (1, 2):  # one at a time: two servers loading at once would double the wait
            servers[sp] = LayoutServer(Layout(2), serve, _serve_args(sp, options))
            servers[sp].wait_url(options.ready_timeout_s)
        urls = {sp: server.wait_url(0) for sp, server in servers.items()}
        ranks = {sp: _rank_pids(server.proc.pid) for sp, server in servers.items()}

        async def run() -> None:
            async with httpx.AsyncClient(timeout=900.0) as client:
                models = {sp: (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
                          for sp, url in urls.items()}
                for sp, url in urls.items():  # kernels, allocator
                    for warm in random_prompts(2, min(options.prompt_lens), options.seed - 1):
                        await run_one(client, url, models[sp], warm, 1)
                for n in options.prompt_lens:
                    ttfts: dict[int, list[float]] = {1: [], 2: []}
                    for run_index in range(options.runs):
                        prompt = random_prompts(1, n, options.seed + 1000 * run_index + n)[0]
                        for sp in ((1, 2) if run_index % 2 == 0 else (2, 1)):
                            sample = await run_one(client, urls[sp], models[sp], prompt, 1)
                            ttfts[sp].append(sample["ttft_s"])
                    for sp in (1, 2):
                        ttft = statistics.median(ttfts[sp])
                        rows[sp][str(n)] = {
                            "ttft_s": ttft, "ttft_s_min": min(ttfts[sp]),
                            "ttft_s_per_run": ttfts[sp], "prefill_tok_s": n / ttft,
                            "peak_rss_mib_per_rank": [_peak_rss_mib(p) for p in ranks[sp]],
                            "loadavg_1m": round(os.getloadavg()[0], 2)}
                        log(f"sp={sp} prompt {n}: TTFT {ttft:.3f} s "
                             f"(runs {', '.join(f'{t:.3f}' for t in ttfts[sp])})")

        asyncio.run(run())
    finally:
        stopped = {sp: server.stop() for sp, server in servers.items()}
    return {sp: {"rows": rows[sp], **stopped[sp]} for sp in servers}


def run_sp_bench(options: SpBenchOptions) -> dict[str, Any]:
    """Measure the collectives and both servers, predict each row; the JSON-ready result.

    Raises:
        LayoutBenchError: a server did not start or failed a request.
        CalibrationError: ``calibrate_cores`` does not fit the model.
    """
    from kthena_core.bench_record import load_bench
    from kthena_core.cache_dir import default_cache_dir, host_probe_file
    from kthena_core.cost_model import CostParams
    from kthena_core.discovery import cpu_topology, measure_host, read_cpu_facts
    from kthena_core.known_models import load_model_spec

    machine = machine_record()
    model = load_model_spec(options.model)
    facts = read_cpu_facts()
    host = measure_host(default_cache_dir(), probe_file=host_probe_file())
    cores = cpu_topology(facts, per_core=True, host=host)
    log("measuring all-reduce, reduce-scatter and all-gather over 2 gloo ranks")
    collectives = measure_collectives(options.prompt_lens, model.shape.hidden_size)
    measured = measure_sp(options)
    base = CostParams()
    if options.calibrate_cores:
        base = calibrate(load_bench(options.calibrate_cores), model, facts,
                         options.calibrate_cores, host).params
    rows = []
    for n in options.prompt_lens:
        factor = collectives["sizes"][str(n + n % 2)]["sp_collective_factor"]
        for sp in (1, 2):
            rows.append({
                "prompt_len": n, "sp": sp, "measured": measured[sp]["rows"][str(n)],
                "predicted_default": predict_sp(model, n, sp, CostParams(), cores),
                "predicted_measured_collectives": predict_sp(
                    model, n, sp, attrs.evolve(base, sp_collective_factor=factor), cores)})
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return {"bench": "kthena layouts sp", "machine": machine,
            "workload": {"model": options.model, "dtype": "bfloat16", "tp": 2,
                         "prompt_lens": list(options.prompt_lens), "runs": options.runs,
                         "max_tokens": 1, "seed": options.seed,
                         "kv_cache_memory": options.kv_cache_memory,
                         "calibration": options.calibrate_cores},
            "collectives": collectives, "servers": {str(sp): {k: v for k, v in m.items()
                                                              if k != "rows"}
                                                    for sp, m in measured.items()},
            "rows": rows}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def format_sp_table(result: Mapping[str, Any]) -> str:
    """Markdown: a row per prompt length and SP setting; TTFT as measured / predicted with the
    default factors / predicted with this run's measured collectives."""
    head = ["prompt", "SP", "TTFT ms: measured median (min) / predicted, default factors / "
            "predicted, measured collectives",
            "prefill tok/s", "peak RSS MiB per rank", "activations MiB (predicted)",
            "SP / no SP TTFT (measured minima / predicted)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["prompt_len"], r["sp"]): r for r in result["rows"]}
    for (n, sp), row in by.items():
        m, d, c = row["measured"], row["predicted_default"], row["predicted_measured_collectives"]
        rss = " / ".join("-" if x is None else f"{x:.0f}" for x in m["peak_rss_mib_per_rank"])
        ratio = "-"
        if sp > 1 and (n, 1) in by:
            plain = by[(n, 1)]
            ratio = (f"{m['ttft_s_min'] / plain['measured']['ttft_s_min']:.2f} / "
                     f"{c['ttft_s'] / plain['predicted_measured_collectives']['ttft_s']:.2f}")
        lines.append(f"| {n} | {'on' if sp > 1 else 'off'} | {_ms(m['ttft_s'])} "
                     f"({_ms(m.get('ttft_s_min'))}) / "
                     f"{_ms(d.get('ttft_s'))} / {_ms(c.get('ttft_s'))} | "
                     f"{m['prefill_tok_s']:.0f} | {rss} | {c.get('activations_mib', 0):.1f} | "
                     f"{ratio} |")
    factors = ", ".join(f"{n}: {v['sp_collective_factor']:.2f}"
                        for n, v in result["collectives"]["sizes"].items())
    mach = result["machine"]
    lines.append(f"\nmeasured sp_collective_factor (reduce-scatter + all-gather over all-reduce, "
                 f"gloo, 2 ranks) by tokens: {factors}")
    lines.append(f"\n{mach.get('cpu')}, {mach.get('cores')} cores, load "
                 f"{mach.get('loadavg_before')} -> {mach.get('loadavg_after')}")
    return "\n".join(lines)


def write_sp_result(result: Mapping[str, Any], out: str | None, plot: str | None = None) -> None:
    """JSON to ``out`` (the table on stdout), or JSON on stdout (the table on stderr); the PNG
    to ``plot`` when given."""
    if plot:
        plot_sp(result, plot)
    text = json.dumps(result)
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")
        print(format_sp_table(result))
    else:
        print(text)
        print(format_sp_table(result), file=sys.stderr)


def plot_sp(result: Mapping[str, Any], path: str) -> None:
    """A PNG of the run: TTFT by prompt length with and without SP (measured median and
    minimum, the planner's prediction with the measured collectives), and each rank's peak RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kthena_serve.bench.plot import save_figure

    fig, (ttft, rss) = plt.subplots(1, 2, figsize=(9, 3.6))
    styles = {1: ("#8a8a8a", "TP=2"), 2: ("#2f6db5", "TP=2 + SP")}
    for sp, (color, label) in styles.items():
        rows = [r for r in result["rows"] if r["sp"] == sp]
        lens = [r["prompt_len"] for r in rows]
        ttft.plot(lens, [r["measured"]["ttft_s"] for r in rows], "o-", color=color,
                  label=f"{label} measured (median)")
        ttft.plot(lens, [r["measured"]["ttft_s_min"] for r in rows], "v:", color=color,
                  label=f"{label} measured (min)")
        ttft.plot(lens, [r["predicted_measured_collectives"].get("ttft_s") for r in rows], "x--",
                  color=color, label=f"{label} predicted")
        for rank in range(len(rows[0]["measured"]["peak_rss_mib_per_rank"])):
            rss.plot(lens, [r["measured"]["peak_rss_mib_per_rank"][rank] for r in rows],
                     "o-" if rank == 0 else "s--", color=color, label=f"{label} rank {rank}")
    ttft.set(xlabel="prompt tokens", ylabel="TTFT s", title="time to first token")
    rss.set(xlabel="prompt tokens", ylabel="MiB", title="peak RSS per rank (VmHWM)")
    for ax in (ttft, rss):
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    mach = result["machine"]
    save_figure(fig, path, f"kthena bench layouts --sp-prompts: {result['workload']['model']} "
                           f"bf16, {mach.get('cpu')}, {mach.get('cores')} cores, load "
                           f"{mach.get('loadavg_before')} -> {mach.get('loadavg_after')}")


# ---- command line: `kthena bench layouts --sp-prompts` -------------------------------------------
def add_sp_arguments(parser: argparse.ArgumentParser) -> None:
    """Give ``kthena bench layouts`` (built by `kthena_serve.bench.layouts.add_parser`) its
    ``--sp-prompts`` and ``--sp-plot`` flags: with ``--sp-prompts`` it runs this bench instead
    of the layouts one."""
    parser.add_argument("--sp-prompts", default=None, metavar="N1,N2,...",
                        help="instead of --layouts: one prompt of each length at TP=2 with and "
                             "without sequence parallelism (TTFT, prefill tok/s, peak RSS per "
                             "rank) beside the planner's predictions, e.g. 2048,4096,8191; "
                             "--runs, --model, --seed, --calibrate-cores and --out apply")
    parser.add_argument("--sp-plot", default=None, metavar="FILE.png",
                        help="with --sp-prompts: also draw TTFT and peak RSS by prompt length")
    layouts = parser.get_default("func")

    def command(args: argparse.Namespace) -> int:
        if args.sp_prompts is not None:
            return _cmd_sp_prompts(args)
        if args.sp_plot is not None:
            print("kthena bench layouts: --sp-plot draws the --sp-prompts run; give "
                  "--sp-prompts too, or drop it", file=sys.stderr)
            return 2
        return layouts(args)

    parser.set_defaults(func=command)


def _cmd_sp_prompts(args: argparse.Namespace) -> int:
    from kthena_core.bench_record import CalibrationError

    try:
        options = SpBenchOptions(prompt_lens=parse_prompt_lens(args.sp_prompts), runs=args.runs,
                                 model=args.model, seed=args.seed,
                                 calibrate_cores=args.calibrate_cores)
        if options.runs < 1:
            raise ValueError("--runs must be >= 1")
        result = run_sp_bench(options)
    except (ValueError, LayoutBenchError, CalibrationError) as error:
        print(f"kthena bench layouts: {error}", file=sys.stderr)
        return 2
    write_sp_result(result, args.out, args.sp_plot)
    return 0
