"""MLA attention paths timed: ``python -m mooncake_ops.mla_bench [--quick] [--threads N]``.

JSON lines: a machine row, one row per (case, dtype) with the median microseconds of the
reference and of every candidate path of `mooncake_ops.mla` (timed interleaved, caches flushed)
and each candidate's largest difference from the reference, then the load average.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from mooncake_ops.bench import emit, machine
from mooncake_ops.mla import CANDIDATES, _check_attention, paged_mla_attention_reference

# DeepSeek-V2-Lite's attention: 16 heads, kv_lora_rank 512, qk_rope_head_dim 64 (nope 128)
BENCH_HEADS, BENCH_LORA, BENCH_ROPE, BENCH_BLOCK = 16, 512, 64, 16
BENCH_CASES = {  # name: (batch, cached tokens per sequence, new tokens per sequence)
    "decode 1x512": (1, 511, 1), "decode 1x2048": (1, 2047, 1),
    "decode 8x512": (8, 511, 1), "decode 8x2048": (8, 2047, 1),
    "decode 32x128": (32, 127, 1), "prefill 1x(256+256)": (1, 256, 256),
}


def bench_case(batch: int, cached: int, new: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """Arguments of one `paged_mla_attention` call: shuffled blocks, random entries (fixed
    seed), scale as DeepSeek-V2-Lite's ((128 + 64) ** -0.5)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = math.ceil((cached + new) / BENCH_BLOCK)
    num_blocks = batch * per_seq
    cache = torch.randn(num_blocks, BENCH_BLOCK, BENCH_LORA + BENCH_ROPE, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch * new, BENCH_HEADS, BENCH_LORA + BENCH_ROPE, generator=gen)
    lens = (torch.full((batch,), cached, dtype=torch.int32),
            torch.full((batch,), new, dtype=torch.int32))
    return q.to(dtype), cache.to(dtype), tables, *lens, (128 + 64) ** -0.5, BENCH_LORA


def interleaved_medians(calls: dict[str, Callable[[], object]], min_rounds: int = 15,
                        budget_s: float = 3.0, seed: int = 0) -> dict[str, float]:
    """Median microseconds per call of each of ``calls``, timed in rounds of one call each in a
    shuffled order, after a warm-up round, with the CPU caches flushed before every call (a
    decode step meets each layer's cache cold): load from neighbours on a shared machine falls
    on every candidate alike, and none inherits the previous one's data in cache."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order, rng = list(calls), random.Random(seed)
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8)
    for fn in calls.values():
        fn()
    deadline = time.perf_counter() + budget_s
    while len(samples[order[0]]) < min_rounds or time.perf_counter() < deadline:
        rng.shuffle(order)
        for name in order:
            flush.fill_(len(samples[name]) & 0xFF)
            start = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) * 1e6 for name, times in samples.items()}


_FLUSH_BYTES = 64 << 20  # twice a 32 MiB L3


def bench_rows(quick: bool = False) -> list[dict]:
    """One row per (case, dtype): median us of the reference and of every candidate (timed
    interleaved), and the largest difference of each candidate from the reference."""
    rows = []
    for case, (batch, cached, new) in BENCH_CASES.items():
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
            args = bench_case(batch, cached, new, dtype)
            row = {"bench": "mla", "case": case, "dtype": str(dtype).removeprefix("torch."),
                   "heads": BENCH_HEADS, "kv_lora_rank": BENCH_LORA, "rope_dim": BENCH_ROPE,
                   "block_size": BENCH_BLOCK, "paged_mla_attention_runs": "batched-decode"}
            lens = _check_attention(*args)
            calls = {"reference": lambda: paged_mla_attention_reference(*args)}  # noqa: B023
            calls.update({name: functools.partial(path, *args[:3], lens, *args[5:])
                          for name, path in CANDIDATES.items()})
            expected = calls["reference"]()
            for name in CANDIDATES:
                got = calls[name]()
                row[f"{name}_max_diff"] = float((got.float() - expected.float()).abs().max())
            row.update({f"{name}_us": us for name, us in interleaved_medians(calls).items()})
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    """The benchmark's command line: a machine row, one JSON line per `bench_rows` row, the
    load average at the end (arguments from ``sys.argv`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(prog="python -m mooncake_ops.mla_bench",
                                     description="MLA attention paths timed (JSON lines)")
    parser.add_argument("--quick", action="store_true", help="bf16 only")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    emit(machine())
    for row in bench_rows(args.quick):
        emit(row)
    emit({"bench": "end", "loadavg": os.getloadavg()})


if __name__ == "__main__":
    main()
