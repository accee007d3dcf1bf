"""Batch-1 decode step time of the model alone (no engine): ``python -m kthena_serve.bench.model``.

Prints one JSON line: median / p10 / p90 step time and tokens/s for a decode step at a given
context length, the dtype, threads, whether matmul weights are pre-packed, and the machine.
``cpu_median_ms`` is the process CPU time per step: on a busy shared machine, with one thread,
it is what the step would take on a core of its own (``load_avg_1m`` says how busy it was).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from kthena_core.dtypes import torch_dtype
from kthena_serve.model.loader import load_model
from mooncake_kv.paged import paged_batch


def measure(model: str, dtype: torch.dtype, context: int, steps: int, pack: bool,
            block_size: int = 16) -> dict[str, object]:
    """Time `steps` decode steps after prefilling `context` tokens; returns the result row."""
    torch.manual_seed(0)
    llm, _ = load_model(model, dtype=dtype, pack_weights=pack)
    num_blocks = -(-(context + steps + 8) // block_size)
    shape = (num_blocks, block_size, llm.num_kv_heads_per_rank, llm.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in llm.layers]
    table = range(num_blocks)  # one sequence over blocks 0..num_blocks-1
    prompt = torch.randint(0, llm.config.shape.vocab_size, (context,))
    prefill = paged_batch([(table, 0, context)], block_size)
    times, cpu_times = [], []
    with torch.inference_mode():
        token = llm(prompt, prefill.positions, prefill, caches).argmax(-1)
        for position in range(context, context + steps):
            batch = paged_batch([(table, position, 1)], block_size)
            start, cpu_start = time.perf_counter(), time.process_time()
            token = llm(token, batch.positions, batch, caches).argmax(-1)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    times, cpu_times = times[5:], cpu_times[5:]  # warm-up
    qs = statistics.quantiles(times, n=10)
    median = statistics.median(times)
    return {"bench": "model_decode_batch1", "model": model, "dtype": str(dtype).removeprefix("torch."),
            "context": context, "steps": len(times), "packed_weights": pack,
            "median_ms": round(median * 1e3, 2), "p10_ms": round(qs[0] * 1e3, 2),
            "p90_ms": round(qs[-1] * 1e3, 2), "tokens_per_s": round(1 / median, 1),
            "cpu_median_ms": round(statistics.median(cpu_times) * 1e3, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-pack", action="store_true", help="plain F.linear (the A/B switch)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    row = measure(args.model, torch_dtype(args.dtype), args.context, args.steps, not args.no_pack)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
