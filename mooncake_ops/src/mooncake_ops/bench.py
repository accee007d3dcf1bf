"""Benchmark of the mooncake_ops hot path (a script, not a test): JSON lines on stdout.

    python -m mooncake_ops.bench [--quick] [--only decode,prefill,layers,mc2] [--threads N]

* ``machine``: CPU, cores, torch, native build, load average (again at the end).
* ``bandwidth``: memory read bandwidth measured in this run (sum over a 512 MiB buffer).
* ``decode``: paged decode attention, batch 1/8/32 x context 512/2048 x {SmolLM2-135M,
  Llama-70B per TP-8 rank} in bf16 (and int8 KV): native vs reference vs contiguous SDPA on the
  same data; GB/s achieved and the bandwidth floor (bytes / measured bandwidth).
* ``prefill``: paged prefill attention, SmolLM2-135M in bf16: 1 x (512 cached + 32 new),
  32 x (512 + 32) with private and with shared prefix blocks, 1 x 1024 new, 32 x 128 new; the
  cpu path (flash kernel, cached/new split, batched by lengths) vs per-sequence masked SDPA.
* ``layer``: per-call cost of write_kv, rms_norm, rotary_embedding, silu_and_mul (decode shape).
* ``int8_accuracy``: decode output error of bf16 vs int8 KV against float64 (realistic K/V).
* ``mc2``: matmul_all_reduce tiled vs unfused over 2 gloo ranks, with the overlap ratio.

Fixed seed, warm-up, medians over repeats. Timed numbers never go into tests.
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
import torch.nn.functional as F

import mooncake_ops as mo
from mooncake_ops.backends import native, sdpa

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-70b-tp8-rank": (8, 1, 128)}  # heads, kv heads, dim
BLOCK_SIZE = 16


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def median_us(fn: Callable[[], object], min_repeats: int = 20, budget_s: float = 0.5) -> float:
    for _ in range(3):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < min_repeats or (time.perf_counter() < deadline and len(samples) < 2000):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    return {"bench": "machine", "cpu": model, "cores": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native": native.is_available(), "native_isa": native.isa(),
            "native_reason": native.unavailable_reason(),
            "loadavg": os.getloadavg()}


def bandwidth_gbs() -> float:
    buf = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MiB, far beyond L2
    us = median_us(lambda: buf.sum(), min_repeats=5, budget_s=1.0)
    row = {"bench": "bandwidth", "bytes": buf.numel() * 4, "read_gbs": buf.numel() * 4 / us / 1e3}
    emit(row)
    return row["read_gbs"]


def paged_case(batch, ctx, shape, dtype, int8, seed=0):
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * per_seq
    cache_dtype = torch.int8 if int8 else dtype
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = {}
    if int8:
        scales = {"k_scale": torch.zeros(num_blocks, BLOCK_SIZE, kv_heads),
                  "v_scale": torch.zeros(num_blocks, BLOCK_SIZE, kv_heads)}
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(torch.int32)
    k = torch.randn(batch * ctx, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(batch * ctx, kv_heads, dim, generator=gen).to(dtype)
    t = torch.arange(ctx)
    slots = torch.cat([tables[b].long()[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
                       for b in range(batch)])
    mo.write_kv(k, v, k_cache, v_cache, slots, **scales)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    contiguous = (k.view(batch, ctx, kv_heads, dim).transpose(1, 2).contiguous(),
                  v.view(batch, ctx, kv_heads, dim).transpose(1, 2).contiguous())
    return q, k_cache, v_cache, tables, lens, scales, contiguous


def bench_decode(bw_gbs: float, quick: bool) -> None:
    batches, contexts = ((1, 8), (512,)) if quick else ((1, 8, 32), (512, 2048))
    for name, shape in SHAPES.items():
        for batch in batches:
            for ctx in contexts:
                for int8 in (False, True):
                    decode_row(name, shape, batch, ctx, int8, bw_gbs)


def decode_row(name, shape, batch, ctx, int8, bw_gbs) -> None:
    q, kc, vc, tables, lens, scales, (k, v) = paged_case(batch, ctx, shape, torch.bfloat16, int8)
    scale = shape[2] ** -0.5
    call = lambda: mo.paged_decode_attention(q, kc, vc, tables, lens, scale, **scales)  # noqa: E731
    kv_bytes = 2 * batch * ctx * shape[1] * shape[2] * (1 if int8 else 2)
    if int8:
        kv_bytes += 2 * batch * ctx * shape[1] * 4
    row = {"bench": "decode", "shape": name, "batch": batch, "context": ctx,
           "kv_dtype": "int8" if int8 else "bfloat16", "kv_bytes": kv_bytes,
           "floor_us": kv_bytes / bw_gbs / 1e3}
    previous = mo.use_native(False)
    row["reference_us"] = median_us(call)
    mo.use_native(True)
    if native.is_available():
        row["native_us"] = median_us(call)
        row["native_gbs"] = kv_bytes / row["native_us"] / 1e3
        row["native_vs_reference"] = row["reference_us"] / row["native_us"]
        row["native_vs_floor"] = row["native_us"] / row["floor_us"]
    mo.use_native(previous)
    if not int8:
        row["sdpa_contiguous_us"] = median_us(lambda: F.scaled_dot_product_attention(
            q[:, :, None], k, v, scale=scale, enable_gqa=True))
    emit(row)


PREFILL_CASES = {  # name: (batch, cached, new, prefix blocks shared by all sequences)
    "1x(512+32)": (1, 512, 32, False),
    "32x(512+32)": (32, 512, 32, False),
    "32x(512 shared+32)": (32, 512, 32, True),
    "1x(0+1024)": (1, 0, 1024, False),
    "32x(0+128)": (32, 0, 128, False),
}


def prefill_case(batch, cached, new, shared, shape, dtype, seed=0):
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    per_seq = max(1, -(-cached // BLOCK_SIZE))
    num_blocks = batch * per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(torch.int32)
    if shared:
        tables = tables[:1].expand(batch, -1).contiguous()
    total = batch * new
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    return (q, k, v, k_cache, v_cache, tables, torch.full((batch,), cached, dtype=torch.int32),
            torch.full((batch,), new, dtype=torch.int32), dim ** -0.5)


def bench_prefill(quick: bool) -> None:
    name = "smollm2-135m"
    for case, (batch, cached, new, shared) in PREFILL_CASES.items():
        if quick and batch > 1 and not shared:
            continue
        args = prefill_case(batch, cached, new, shared, SHAPES[name], torch.bfloat16)
        row = {"bench": "prefill", "shape": name, "case": case, "batch": batch, "cached": cached,
               "new": new, "shared_prefix": shared, "dtype": "bfloat16"}
        row["cpu_us"] = median_us(lambda: mo.paged_prefill_attention(*args), min_repeats=5)  # noqa: B023
        row["per_sequence_sdpa_us"] = median_us(
            lambda: sdpa.paged_prefill_attention(*args), min_repeats=5)  # noqa: B023
        row["cpu_vs_per_sequence"] = row["per_sequence_sdpa_us"] / row["cpu_us"]
        emit(row)


def bench_layers() -> None:
    heads, kv_heads, dim = SHAPES["smollm2-135m"]
    dtype = torch.bfloat16
    x, w = torch.randn(1, 576).to(dtype), torch.ones(576, dtype=dtype)
    q, k = torch.randn(1, heads, dim).to(dtype), torch.randn(1, kv_heads, dim).to(dtype)
    rope = mo.build_rope_cache(dim, 8192, 100000.0)
    pos = torch.tensor([100])
    kc = torch.zeros(64, BLOCK_SIZE, kv_heads, dim, dtype=dtype)
    kc8, ks = torch.zeros_like(kc, dtype=torch.int8), torch.zeros(64, BLOCK_SIZE, kv_heads)
    gate = torch.randn(1, 2 * 1536).to(dtype)
    calls = {
        "write_kv": lambda: mo.write_kv(k, k, kc, kc, pos),
        "write_kv_int8": lambda: mo.write_kv(k, k, kc8, kc8, pos, k_scale=ks, v_scale=ks),
        "rms_norm_fused_add": lambda: mo.rms_norm(x, w, 1e-5, x),
        "rotary_embedding": lambda: mo.rotary_embedding(pos, q, k, rope),
        "silu_and_mul": lambda: mo.silu_and_mul(gate),
    }
    for op, fn in calls.items():
        row = {"bench": "layer", "op": op, "shape": "smollm2-135m decode, batch 1"}
        previous = mo.use_native(False)
        row["reference_us"] = median_us(fn)
        mo.use_native(True)
        kernel = {"write_kv_int8": "write_kv", "rms_norm_fused_add": "rms_norm"}.get(op, op)
        if native.is_available() and kernel in native.ops():
            row["native_us"] = median_us(fn)
            row["native_vs_reference"] = row["reference_us"] / row["native_us"]
        mo.use_native(previous)
        emit(row)


def realistic_kv(ctx: int, shape, seed: int = 0):
    """Activations shaped like a Llama layer's: K with a few outlier channels (x8) and RoPE
    applied, V plain Gaussian, queries aligned with some keys so attention is peaked."""
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    channel = torch.ones(dim)
    channel[torch.randperm(dim, generator=gen)[:4]] = 8.0
    k = torch.randn(ctx, kv_heads, dim, generator=gen) * channel
    v = torch.randn(ctx, kv_heads, dim, generator=gen)
    q = torch.randn(1, heads, dim, generator=gen) * channel
    q += 0.5 * k[torch.randint(0, ctx, (heads,), generator=gen), torch.arange(heads) // (heads // kv_heads)]
    rope = mo.build_rope_cache(dim, ctx, 10000.0)
    q, k = mo.rotary_embedding(torch.arange(ctx), q.expand(ctx, -1, -1).contiguous(), k, rope)
    return q[-1:], k, v


def int8_error(ctx: int = 1024, shape=SHAPES["smollm2-135m"], seed: int = 0) -> dict:
    """Decode attention output error of bf16 and int8 KV against float64 on `realistic_kv`."""
    q, k, v = realistic_kv(ctx, shape, seed)
    heads, kv_heads, dim = shape
    scale = dim ** -0.5
    table = torch.arange(-(-ctx // BLOCK_SIZE), dtype=torch.int32)[None]
    lens = torch.tensor([ctx], dtype=torch.int32)
    slots = torch.arange(ctx)
    exact = F.scaled_dot_product_attention(q.double()[:, :, None], k.double().transpose(0, 1)[None],
                                           v.double().transpose(0, 1)[None], scale=scale,
                                           enable_gqa=True)[:, :, 0]
    row = {"bench": "int8_accuracy", "context": ctx, "shape": shape}
    for name, cache_dtype in (("bf16", torch.bfloat16), ("int8", torch.int8)):
        kc = torch.zeros(table.shape[1], BLOCK_SIZE, kv_heads, dim, dtype=cache_dtype)
        vc = torch.zeros_like(kc)
        scales = {}
        if cache_dtype == torch.int8:
            scales = {n: torch.zeros(kc.shape[:3]) for n in ("k_scale", "v_scale")}
        mo.write_kv(k.bfloat16(), v.bfloat16(), kc, vc, slots, **scales)
        out = mo.paged_decode_attention(q.bfloat16(), kc, vc, table, lens, scale, **scales)
        err = out.double() - exact
        row[f"{name}_rel_l2"] = float(err.norm() / exact.norm())
        row[f"{name}_max_abs"] = float(err.abs().max())
    row["kv_bytes_per_token_bf16"] = 2 * kv_heads * dim * 2
    row["kv_bytes_per_token_int8"] = 2 * kv_heads * (dim + 4)
    return row


def bench_mc2(quick: bool) -> None:
    from mooncake_ops import _mc2_worker
    env = {"MC2_BENCH_REPEATS": "5" if quick else "15"}
    for out in _mc2_worker.launch("bench", world=2, timeout_s=600, extra_env=env):
        for line in out.strip().splitlines():
            print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mooncake_ops.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--only", default="decode,prefill,layers,mc2", help="comma-separated sections")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sections = set(args.only.split(","))
    emit(machine())
    if "decode" in sections:
        bench_decode(bandwidth_gbs(), args.quick)
    if "prefill" in sections:
        bench_prefill(args.quick)
    if "layers" in sections:
        bench_layers()
        for ctx in (256, 2048):
            emit(int8_error(ctx))
    if "mc2" in sections:
        bench_mc2(args.quick)
    emit({"bench": "end", "loadavg": os.getloadavg()})


if __name__ == "__main__":
    main()
