"""Layout benchmark: block-major vs per-layer pools, for transfer and for attention reads.

    python -m mooncake_kv.layout_bench [--batch 64] [--repeats 20] [--seed 0]

For each model shape (SmolLM2-135M; Llama-70B per TP rank at tp=8), each layout and each batch
pattern (random or contiguous block ids) it measures:
  ranges       coalesced byte ranges a one-sided transfer of the batch needs
  ranges_us    time to compute them
  gather_ms    copying those ranges into a staging buffer, one copy per range (what a
               transfer engine does per descriptor, minus the wire)
  attn_ms      reading the batch through the per-layer views: index_select of the blocks'
               K and V for every layer (what paged attention gathers)
Prints one JSON line (medians, machine described). Fixed seed, one warm-up round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

from mooncake_kv.layout import KVLayout, LayoutKind
from mooncake_kv.pool import KVPool
from mooncake_kv.sizing import KVShape

SHAPES = {
    "smollm2-135m": (KVShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16), 512),
    # Llama-2-70B's 8 KV heads over tp=8: one head per rank.
    "llama-70b-tp8": (KVShape(num_layers=80, num_kv_heads=1, head_dim=128), 256),
}


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _gather(pool: KVPool, ranges, staging: torch.Tensor) -> None:
    position = 0
    for r in ranges:
        staging[position : position + r.length].copy_(pool.buffer[r.offset : r.end])
        position += r.length


def _attention_read(pool: KVPool, table: torch.Tensor) -> None:
    for layer in range(pool.layout.shape.num_layers):
        pool.k_cache(layer).index_select(0, table)
        pool.v_cache(layer).index_select(0, table)


def _measure(pool: KVPool, block_ids: list[int], repeats: int) -> dict[str, float]:
    layout = pool.layout
    ranges = layout.batch_ranges(block_ids)
    staging = torch.empty(len(block_ids) * layout.bytes_per_block, dtype=torch.uint8)
    table = torch.tensor(block_ids, dtype=torch.long)
    return {
        "ranges": len(ranges),
        "ranges_us": round(_median_ms(lambda: layout.batch_ranges(block_ids), repeats) * 1e3, 1),
        "gather_ms": round(_median_ms(lambda: _gather(pool, ranges, staging), repeats), 3),
        "attn_ms": round(_median_ms(lambda: _attention_read(pool, table), repeats), 3),
    }


def _batches(num_blocks: int, batch: int, rng: random.Random) -> dict[str, list[int]]:
    start = rng.randrange(num_blocks - batch)
    return {
        "random": rng.sample(range(num_blocks), batch),
        "contiguous": list(range(start, start + batch)),
    }


def run(batch: int, repeats: int, seed: int) -> dict:
    rng = random.Random(seed)
    results = {}
    for model, (shape, num_blocks) in SHAPES.items():
        batches = _batches(num_blocks, batch, rng)
        for kind in LayoutKind:
            with KVPool.create(KVLayout(shape, num_blocks, kind)) as pool:
                pool.buffer.random_(0, 256)
                for pattern, block_ids in batches.items():
                    key = f"{model}/{kind.value}/{pattern}"
                    results[key] = _measure(pool, block_ids, repeats)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="blocks per transfer batch")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": args.threads,
    }
    results = run(args.batch, args.repeats, args.seed)
    print(json.dumps({"bench": "layout", "batch": args.batch, "seed": args.seed,
                      "machine": machine, "results": results}))


if __name__ == "__main__":
    main()
