"""Benchmark of the MoE compute (a script, not a test): JSON lines on stdout.

    python -m mooncake_ops.moe_bench [--quick] [--only grouped,choice,ep] [--threads N]
                                     [--shapes mixtral-tiny,deepseek-v2-lite]

* ``machine``: the CPU (/proc/cpuinfo model name, family, model), cores, torch and its
  threads, OpenMP wait policy, the native build, the load average (again at the end).
* ``grouped``: every grouped-kernel candidate (`moe_kernels.grouped_candidates`) through
  `run_experts` at each shape, dtype (float32, bfloat16) and token count (1, 8, 256):
  median ms, the expert weight bytes the call reads (the experts routed to, at least once)
  and the GB/s that makes.
* ``choice``: what ``choose_moe_kernels("auto", ...)`` picks at each shape and dtype, with its
  own timings (no cache).
* ``ep``: 2 gloo ranks on this machine, one thread each, bf16, 8 and 64 tokens per rank: the
  EP layer fused (MC2-style) and unfused, and one rank alone with every expert (experts packed
  for the ``native`` choice); medians of 30 calls, off-rank bytes of the fused dispatch.

Shapes (experts, hidden, expert intermediate, top-k): ``mixtral-tiny`` 8 x 256 x 512, top 2
(Mixtral's routing at a toy width); ``deepseek-v2-lite`` 64 x 2048 x 1408, top 6 (DeepSeek-V2-
Lite's routed experts; Qwen1.5-MoE-A2.7B has the same 1408 width over 60 experts, top 4).
Routing: softmax top-k over random logits, fixed seed. Timed numbers never go into tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

import mooncake_ops as mo
from mooncake_ops.backends import native
from mooncake_ops.moe_kernels import GroupedKernel, grouped_candidates
from mooncake_ops.moe_selection import choose_moe_kernels

SHAPES = {"mixtral-tiny": (8, 256, 512, 2), "deepseek-v2-lite": (64, 2048, 1408, 6)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENS = (1, 8, 256)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def machine() -> dict:
    info: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    return {"bench": "machine", "cpu": info.get("model name", platform.processor()),
            "cpu_family": info.get("cpu family"), "cpu_model": info.get("model"),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native": native.is_available(), "native_isa": native.isa(),
            "loadavg": os.getloadavg()}


def layer(shape: str, dtype: torch.dtype, seed: int = 0):
    experts, hidden, inter, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen).div_(hidden ** 0.5)
    down = torch.randn(experts, hidden, inter, generator=gen).div_(inter ** 0.5)
    return gate_up.to(dtype), down.to(dtype)


def tokens_of(shape: str, tokens: int, dtype: torch.dtype, seed: int = 1):
    experts, hidden, _, top_k = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = mo.route_experts(logits, mo.RoutingRule(top_k, renormalize=True))
    return torch.randn(tokens, hidden, generator=gen).to(dtype), weights, ids


def bench_grouped(shapes: list[str], repeats: int) -> None:
    for shape in shapes:
        for dtype_name, dtype in DTYPES.items():
            gate_up, down = layer(shape, dtype)
            for kernel in grouped_candidates(gate_up):
                for row in _kernel_rows(shape, gate_up, down, kernel, repeats):
                    emit({"bench": "grouped", "shape": shape, "dtype": dtype_name, **row})


def _kernel_rows(shape: str, gate_up: torch.Tensor, down: torch.Tensor,
                 kernel: GroupedKernel, repeats: int) -> list[dict]:
    """One row per token count; the packed experts are dropped on return."""
    experts = mo.pack_experts(gate_up, down, kernels=(kernel, kernel))
    per_expert = gate_up[0].nbytes + down[0].nbytes
    rows = []
    for tokens in TOKENS:
        x, weights, ids = tokens_of(shape, tokens, gate_up.dtype)
        ms = median_ms(lambda: mo.run_experts(x, weights, ids, experts), repeats)  # noqa: B023
        read = int(ids.unique().numel()) * per_expert
        rows.append({"kernel": kernel.name, "tokens": tokens, "median_ms": round(ms, 3),
                     "weight_bytes": read, "gbs": round(read / ms / 1e6, 2)})
    return rows


def bench_choice(shapes: list[str]) -> None:
    for shape in shapes:
        for dtype_name, dtype in DTYPES.items():
            gate_up, down = layer(shape, dtype)
            choice = choose_moe_kernels("auto", gate_up, down, SHAPES[shape][3])
            emit({"bench": "choice", "shape": shape, "dtype": dtype_name,
                  **choice.as_dict()})


def bench_ep(shapes: list[str], repeats: int) -> None:
    from mooncake_ops import _ep_worker

    cases = []
    for shape in shapes:
        experts, hidden, inter, top_k = SHAPES[shape]
        for tokens in (8, 64):
            cases.append({"name": f"{shape}-{tokens}", "dtype": "bfloat16",
                          "num_experts": experts, "hidden": hidden, "inter": inter,
                          "top_k": top_k, "tokens": [tokens, tokens], "seed": 1})
    spec = {"cases": cases, "repeats": repeats}
    for out in _ep_worker.launch("bench", spec, world=2, timeout_s=1800):
        for line in out.strip().splitlines():
            if line.startswith("{"):
                print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mooncake_ops.moe_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--only", default="grouped,choice,ep", help="comma-separated sections")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shapes.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    sections, repeats = set(args.only.split(",")), 3 if args.quick else 7
    torch.manual_seed(0)
    emit(machine())
    if "grouped" in sections:
        bench_grouped(shapes, repeats)
    if "choice" in sections:
        bench_choice(shapes)
    if "ep" in sections:  # gloo latency on shared cores varies by milliseconds: more calls
        bench_ep(shapes, 10 if args.quick else 30)
    emit({"bench": "end", "loadavg": os.getloadavg()})


if __name__ == "__main__":
    main()
