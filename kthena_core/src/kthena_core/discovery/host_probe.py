"""Host probe: this CPU's memory bandwidth and matmul peak, measured once and cached.

CPU discovery reads flags, cores and RAM from /proc and /sys, but no file states how fast memory
is or how many FLOP/s torch's kernels reach. Both are measured here, on torch's current threads,
each the best of a few runs (a limit is the best the machine did; on a shared machine the slower
runs measure the neighbours)::

    memory bandwidth   bytes read / seconds of a ``sum`` over BANDWIDTH_BYTES, in bf16 and in
                       float32; the larger counts (a bf16 sum can be bound by its conversions)
    matmul peak        2 x rows x in x out / seconds of ``F.linear`` [rows, in] x [out, in]^T,
                       in bf16 and in float32; the larger is the bf16 peak (a CPU without bf16
                       arithmetic runs the engine's bf16 matmuls in fp32), float32's is fp32's

``kthena bench serve``'s limits probe (``kthena_serve.bench.limits``) times the same two
operations with these functions, at the model's own matmul shape.

A measurement is cached as JSON under ``<cache_dir>/host/<key>.json``, keyed like the kernel
timings (``mooncake_ops.selection``): the CPU (model name and a hash of its flags), torch's
version and thread count, and the probe sizes; a change to any of them measures again. Without
torch nothing can be measured: ``measure_host`` returns None and discovery keeps its estimate.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["BANDWIDTH_BYTES", "HostFigures", "MATMUL_SHAPE", "best_time_s", "cpu_identity",
           "host_key", "measure_bandwidth", "measure_host", "measure_matmul_peak"]

BANDWIDTH_BYTES = 256 * 2**20   # well past any L3, so the sum streams from DRAM
MATMUL_SHAPE = (2048, 1024, 1024)  # rows, in, out: ~4.3 GFLOP a call, near torch's peak
REPEATS = 5


@attrs.frozen
class HostFigures:
    """What the host measured: bytes/s read and FLOP/s per dtype, on ``threads`` torch threads.

    Attributes:
        memory_bw: bytes/s a streaming read reached (the larger of the bf16 and float32 sums).
        peak_flops: {"bf16": ..., "fp32": ...} FLOP/s of ``F.linear``; bf16 is the larger of the
            two (the engine runs bf16 weights in fp32 where that is faster).
        threads: torch's intra-op threads during the measurement.
        key: the cache key (hex).
        source: ``measured`` or ``cached`` (a measurement read back).
        details: the raw figures and how they were taken (JSON-able).
    """

    memory_bw: float = attrs.field(validator=attrs.validators.gt(0))
    peak_flops: Mapping[str, float] = attrs.field(converter=dict)
    threads: int = 1
    key: str = ""
    source: str = "measured"
    details: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, eq=False)

    def describe(self) -> str:
        """One line for a DeviceSpec's ``source``."""
        return (f"{self.source}: {self.memory_bw / 1e9:.1f} GB/s read, "
                f"{self.peak_flops['bf16'] / 1e9:.0f} GFLOP/s bf16 matmul on {self.threads} "
                f"torch thread(s) (host probe, key {self.key})")

    def to_dict(self) -> dict[str, Any]:
        return {"memory_bw": self.memory_bw, "peak_flops": dict(self.peak_flops),
                "threads": self.threads, "key": self.key, "details": dict(self.details)}


def best_time_s(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up call (page faults, oneDNN
    primitive creation)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(num_bytes: int = BANDWIDTH_BYTES, repeats: int = REPEATS) -> dict[str, float]:
    """Bytes/s read by a ``sum`` over ``num_bytes``, per dtype: {"bfloat16": ..., "float32": ...}."""
    import torch

    out = {}
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            data = torch.ones(num_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
            out[str(dtype).removeprefix("torch.")] = num_bytes / best_time_s(data.sum, repeats)
            del data
    return out


def measure_matmul_peak(rows: int, in_features: int, out_features: int,
                        repeats: int = REPEATS) -> dict[str, float]:
    """FLOP/s of ``F.linear`` [rows, in] x [out, in]^T per dtype: {"bfloat16": ..., "float32": ...}."""
    import torch
    import torch.nn.functional as F

    flops = 2 * rows * in_features * out_features
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator)
    w = torch.randn(out_features, in_features, generator=generator)
    out = {}
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            xd, wd = x.to(dtype), w.to(dtype)
            out[str(dtype).removeprefix("torch.")] = flops / best_time_s(
                lambda xd=xd, wd=wd: F.linear(xd, wd), repeats)
    return out


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """[model name, hash of the flags]: what tells one CPU model from another."""
    model, flags = "", ""
    with contextlib.suppress(OSError), open(cpuinfo) as f:
        for line in f:
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not model:
                model = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:16]
    return [model or platform.processor(), flags]


def host_key(threads: int, torch_version: str, sizes: object) -> str:
    """The hex key of a host measurement: what would make another measurement differ."""
    parts = [cpu_identity(), torch_version, threads, sizes]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def measure_host(cache_dir: str | os.PathLike[str] | None = None, *,
                 bandwidth_bytes: int = BANDWIDTH_BYTES,
                 matmul_shape: tuple[int, int, int] = MATMUL_SHAPE,
                 repeats: int = REPEATS) -> HostFigures | None:
    """This host's memory bandwidth and matmul peak on torch's current threads.

    Args:
        cache_dir: where measurements are kept (``<cache_dir>/host/<key>.json``); None:
            measure every time.
        bandwidth_bytes, matmul_shape, repeats: probe sizes (tests pass tiny ones).

    Returns:
        The figures, or None when torch is not installed (nothing to measure with).
    """
    try:
        import torch
    except ImportError:
        return None
    threads = torch.get_num_threads()
    key = host_key(threads, torch.__version__, [bandwidth_bytes, list(matmul_shape), repeats])
    path = None if cache_dir is None else Path(cache_dir) / "host" / f"{key}.json"
    if path is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(path.read_text())
            if record.get("key") == key:
                return HostFigures(record["memory_bw"], record["peak_flops"], record["threads"],
                                   key, "cached", record["details"])
    figures = _measure(key, threads, bandwidth_bytes, matmul_shape, repeats)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(figures.to_dict(), indent=1))
        tmp.replace(path)
    return figures


def _measure(key: str, threads: int, bandwidth_bytes: int, matmul_shape: tuple[int, int, int],
             repeats: int) -> HostFigures:
    reads = measure_bandwidth(bandwidth_bytes, repeats)
    rows, in_features, out_features = matmul_shape
    peaks = measure_matmul_peak(rows, in_features, out_features, repeats)
    details = {**{f"sum_{k}_gb_s": round(v / 1e9, 2) for k, v in reads.items()},
               **{f"matmul_{k}_gflop_s": round(v / 1e9, 1) for k, v in peaks.items()},
               "bandwidth_probe": f"sum over {bandwidth_bytes / 2**20:g} MiB, best of {repeats}",
               "matmul_probe": f"F.linear [{rows}, {in_features}] x [{out_features}, "
                               f"{in_features}]^T in bf16 and float32, best of {repeats}",
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return HostFigures(max(reads.values()),
                       {"bf16": max(peaks.values()), "fp32": peaks["float32"]},
                       threads, key, "measured", details)
