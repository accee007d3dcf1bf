"""Same-run A/B: the packed bf16 matmul's row buckets on vs off, engine tokens/s.

    .venv/bin/python tools/bench_row_buckets.py [ROUNDS]      # one JSON line

Each round runs 16 requests (50-500 prompt tokens, 32 output tokens, prefix caching off) once
with ``mooncake_ops.linear.row_bucket`` and once with exact row counts, alternating the order;
every run draws new prompt lengths, so the exact mode meets new shapes as a server does.
docs/bench_serve.md quotes it.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads

import torch  # noqa: E402

import mooncake_ops.linear as linear  # noqa: E402
from kthena_serve.engine import LLMEngine  # noqa: E402
from kthena_serve.engine.config import EngineConfig  # noqa: E402
from kthena_serve.engine.sampling_params import SamplingParams  # noqa: E402

NUM_REQUESTS, MAX_TOKENS = 16, 32


def run(engine: LLMEngine, seed: int) -> float:
    """Tokens (prompt + output) per second for one batch of requests drawn from ``seed``."""
    rng = random.Random(seed)
    num_prompt = 0
    for i in range(NUM_REQUESTS):
        length = rng.randrange(50, 500)
        num_prompt += length
        engine.add_request(f"r{seed}-{i}", [rng.randrange(3, 40000) for _ in range(length)],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (NUM_REQUESTS * MAX_TOKENS + num_prompt) / (time.perf_counter() - start)


def main(rounds: int) -> dict:
    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory="256MiB",
                                                enable_prefix_caching=False))
    bucketed = linear.row_bucket
    results: dict[str, list[float]] = {"bucketed": [], "exact": []}
    run(engine, 999)  # warm-up
    for r in range(rounds):
        for mode in ("bucketed", "exact") if r % 2 == 0 else ("exact", "bucketed"):
            linear.row_bucket = bucketed if mode == "bucketed" else (lambda rows: rows)
            results[mode].append(run(engine, 1000 + 2 * r + (mode == "exact")))
    linear.row_bucket = bucketed
    medians = {mode: statistics.median(values) for mode, values in results.items()}
    cpu = next((line.split(":")[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    return {"cpu": cpu, "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
            "tokens_per_s_median": {mode: round(v, 1) for mode, v in medians.items()},
            "ratio_bucketed_over_exact": round(medians["bucketed"] / medians["exact"], 3),
            "runs": {mode: [round(v, 1) for v in values] for mode, values in results.items()}}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)))
