#!/usr/bin/env python3
"""A/B of decode protection (``EngineConfig.target_step_ms``) on the in-process engine.

    python scripts/step_budget_ab.py [--targets 0,50,100,200] [--runs 3]

``--decoders`` requests (default 1) decode 64 tokens each (32-token prompts); from their 4th
token on, ``--prompts`` prompts (default 4) of ``--prompt-len`` (1,000) distinct tokens arrive,
``--gap`` seconds apart, each generating ``--output-len`` (16) tokens. With ``--decoders 0``
the prompts arrive from the start (``--gap 0``: a burst; the inter-token latency is then the
prompts').

For each target (0: off, every step fills ``max_num_batched_tokens``) the runs are interleaved
with the other targets' (load on shared cores hits every policy alike), and the medians of
``--runs`` are reported: the decoding requests' inter-token latency p50 / p99 and the time to
their last token, the prompts' time to first token (mean, max), and the wall time of the load;
with the cost model each engine fitted. Prints a Markdown table and one JSON line with the CPU
model and load. Default model, bf16, docs/kthena_serve.md "Decode protection" has the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_run(engine, seed: int, args: argparse.Namespace) -> dict:  # noqa: ANN001
    from kthena_serve.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    decode = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompt = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    decoders = [f"d{i}" for i in range(args.decoders)]
    for rid in decoders:
        engine.add_request(rid, [rng.randrange(1000, 40000) for _ in range(32)], decode)
    times: dict[str, list[float]] = {rid: [] for rid in decoders}
    arrivals: dict[str, float] = {}
    start = time.perf_counter()
    pending = [] if decoders else [(start + i * args.gap, f"p{i}") for i in range(args.prompts)]
    while engine.has_unfinished_requests() or pending:
        now = time.perf_counter()
        while pending and pending[0][0] <= now:
            _, rid = pending.pop(0)
            arrivals[rid] = time.perf_counter()
            engine.add_request(rid, [rng.randrange(1000, 40000)
                                     for _ in range(args.prompt_len)], prompt)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - time.perf_counter()))
            continue
        for out in engine.step():
            if out.new_token_ids:
                times.setdefault(out.request_id, []).append(time.perf_counter())
        if decoders and min(len(times[rid]) for rid in decoders) >= 4 and not arrivals \
                and not pending:
            base = time.perf_counter()
            pending = [(base + i * args.gap, f"p{i}") for i in range(args.prompts)]
    measured = decoders or list(arrivals)
    gaps = [b - a for rid in measured for a, b in itertools.pairwise(times[rid])]
    ttft = [times[rid][0] - arrivals[rid] for rid in arrivals]
    return {"itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_p99_ms": _percentile(gaps, 0.99) * 1e3,
            "last_token_s": max(times[rid][-1] for rid in measured) - start,
            "ttft_mean_s": statistics.fmean(ttft), "ttft_max_s": max(ttft),
            "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="0,50,100,200",
                        help="target_step_ms values, comma-separated (0: off)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.25, help="seconds between arrivals")
    parser.add_argument("--decoders", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--model", default="default")
    args = parser.parse_args()

    import torch

    from kthena_serve.engine import LLMEngine
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.sampling_params import SamplingParams

    targets = [float(t) for t in args.targets.split(",")]
    engines = {t: LLMEngine.from_config(EngineConfig(model=args.model, target_step_ms=t,
                                                     kv_cache_memory="256MiB"))
               for t in targets}
    for engine in engines.values():  # warm-up: a prefill and a few decodes
        engine.add_request("warm", list(range(1000, 1300)), SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
    loads = [os.getloadavg()[0]]
    results: dict[float, list[dict]] = {t: [] for t in targets}
    for run in range(args.runs):
        for target, engine in engines.items():
            results[target].append(one_run(engine, seed=run, args=args))
            loads.append(os.getloadavg()[0])
    rows = []
    for target in targets:
        runs = results[target]
        row = {"target_step_ms": target}
        row.update({k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]})
        cost = engines[target].step_cost
        if cost is not None:
            row["fitted_us"] = cost.current.coefficients()
        rows.append(row)
    print("| target_step_ms | ITL p50 ms | ITL p99 ms | last token s | TTFT mean s "
          "| TTFT max s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target_step_ms']:g} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
              f"{r['last_token_s']:.2f} | {r['ttft_mean_s']:.2f} | {r['ttft_max_s']:.2f} | "
              f"{r['wall_s']:.2f} |")
    print(json.dumps({"cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "model": args.model,
                      "load_1m_min_max": [round(min(loads), 2), round(max(loads), 2)],
                      "runs": args.runs, "gap_s": args.gap, "decoders": args.decoders,
                      "prompts": args.prompts, "prompt_len": args.prompt_len,
                      "output_len": args.output_len, "rows": rows}))
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
