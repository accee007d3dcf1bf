"""Host probe: this CPU's memory bandwidth and matmul peak, measured, flagged when taken under
load, and cached.

CPU discovery reads flags, cores and RAM from /proc and /sys, but no file states how fast memory
is or how many FLOP/s torch's kernels reach. Both are measured here, on torch's current threads::

    memory bandwidth   bytes read / seconds of a ``sum`` over BANDWIDTH_BYTES, in bf16 and in
                       float32; the larger counts (a bf16 sum can be bound by its conversions)
    matmul peak        2 x rows x in x out / seconds of ``F.linear`` [rows, in] x [out, in]^T,
                       in bf16 and in float32; the larger is the bf16 peak (a CPU without bf16
                       arithmetic runs the engine's bf16 matmuls in fp32), float32's is fp32's

Each figure is the **median of SAMPLES short timed calls** after one warm-up call, and the
probe records the 1-minute load average read just before it and the cores this process may
use. A probe is **provisional** when it was taken under load: the load average was above
cores / 2 (other work was running), or its samples were more than SPREAD_LIMIT apart (the
range of the samples, less the fastest and the slowest one, over their median). A provisional
probe is used and flagged (``describe`` says so), and the next `measure_host` measures again
instead of reading it back; a probe that is not provisional is read back for good.

The figures are those of ``threads`` torch threads. `HostFigures.per_thread` divides them by
the threads they ran on, which is how discovery scales them to a device of any number of cores
(``discovery.cpu``): a one-thread and a two-thread probe of the same FLOP/s are different
machines.

``kthena bench serve``'s limits probe (``kthena_serve.bench.limits``) times the same two
operations with `measure_bandwidth` and `measure_matmul_peak`, at the model's own matmul shape
and keeping the best run (a limit is the best the machine did).

A measurement is cached as JSON under ``<cache_dir>/host/<key>.json`` (`HostFigures.to_dict`),
keyed by the CPU (model name and a hash of its flags), torch's version and thread count, and the
probe sizes; a change to any of them measures again. The same JSON in a file named by the
command lines' ``KTHENA_HOST_PROBE`` (`load_host_probe`) stands in for the measurement: for
tests, for planning away from the machine, and for reproducing a user's plan. Without torch
nothing can be measured: `measure_host` returns None and discovery keeps its estimate.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from kthena_core.discovery._common import parse_cpuinfo

__all__ = ["BANDWIDTH_BYTES", "HostFigures", "HostProbeError", "MATMUL_SHAPE", "SAMPLES",
           "SPREAD_LIMIT", "age_text", "best_time_s", "cpu_identity", "cpu_label", "host_key", "is_busy", "isa_class",
           "load_host_probe", "measure_bandwidth", "measure_host", "measure_matmul_peak",
           "sample_times"]

_log = logging.getLogger("kthena_core")

BANDWIDTH_BYTES = 256 * 2**20   # well past any L3, so the sum streams from DRAM
MATMUL_SHAPE = (2048, 1024, 1024)  # rows, in, out: ~4.3 GFLOP a call, near torch's peak
REPEATS = 5
SAMPLES = 7
SPREAD_LIMIT = 0.25
FILE_KIND = "kthena host probe"


class HostProbeError(ValueError):
    """A host-probe file cannot be used; the message names the file and the field."""


def _now_s() -> float:
    return time.time()


@attrs.frozen
class HostFigures:
    """What the host measured: bytes/s read and FLOP/s per dtype, on ``threads`` torch threads.

    Attributes:
        memory_bw: bytes/s a streaming read reached (the larger of the bf16 and float32 sums).
        peak_flops: {"bf16": ..., "fp32": ...} FLOP/s of ``F.linear``; bf16 is the larger of the
            two (the engine runs bf16 weights in fp32 where that is faster).
        threads: torch's intra-op threads during the measurement.
        key: the cache key (hex).
        source: ``measured`` (now), ``cached`` (a measurement read back) or ``file <path>``
            (``KTHENA_HOST_PROBE``).
        details: the raw figures and how they were taken (JSON-able).
        cpu: the CPU it ran on: {"model_name", "family", "model"} (`cpu_label`).
        load_avg: the 1-minute load average just before the probe (None: unknown).
        cores: the cores the probing process could use.
        spread: the samples' range (less the extremes) over their median, the larger of the
            bandwidth and matmul ones.
        measured_at: seconds since the epoch when it was measured (0: unknown).
        provisional: taken under load (see the module docstring): measured again next time.
    """

    memory_bw: float = attrs.field(validator=attrs.validators.gt(0))
    peak_flops: Mapping[str, float] = attrs.field(converter=dict)
    threads: int = attrs.field(default=1, validator=attrs.validators.gt(0))
    key: str = ""
    source: str = "measured"
    details: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, eq=False)
    cpu: Mapping[str, Any] = attrs.field(factory=dict, converter=dict, eq=False)
    load_avg: float | None = attrs.field(default=None, eq=False)
    cores: int = attrs.field(default=0, eq=False)
    spread: float = attrs.field(default=0.0, eq=False)
    measured_at: float = attrs.field(default=0.0, eq=False)
    provisional: bool = attrs.field(default=False, eq=False)

    def per_thread(self) -> tuple[float, dict[str, float]]:
        """(bytes/s, {dtype: FLOP/s}) of one of the threads it ran on."""
        return self.memory_bw / self.threads, {k: v / self.threads
                                                for k, v in self.peak_flops.items()}

    def age_s(self, now: float | None = None) -> float | None:
        """Seconds since it was measured (None: unknown)."""
        return None if not self.measured_at else max(0.0, (now or _now_s()) - self.measured_at)

    def describe(self, now: float | None = None, *, with_age: bool = True) -> str:
        """One line: the figures, where they came from, their age and the load they were taken
        under (``kthena doctor`` prints it). ``with_age=False``: the time it was measured
        instead of its age, for a value that must not change as time passes (a DeviceSpec's
        ``source``, which a plan's JSON carries)."""
        peaks = self.peak_flops
        fp32 = f", {peaks['fp32'] / 1e9:.0f} fp32" if "fp32" in peaks else ""
        line = (f"{self.source}: {self.memory_bw / 1e9:.1f} GB/s read, "
                f"{peaks['bf16'] / 1e9:.0f} GFLOP/s bf16{fp32} matmul on {self.threads} "
                f"torch thread(s) (host probe")
        cpu = _cpu_text(self.cpu)
        line += f" on {cpu}" if cpu else ""
        age = self.age_s(now)
        if age is not None:
            line += (f", {age_text(age)} old" if with_age else
                     f", measured {time.strftime('%Y-%m-%dT%H:%M:%S%z', time.localtime(self.measured_at))}")
        if self.load_avg is not None:
            line += f", taken at load {self.load_avg:.2f} on {self.cores or '?'} core(s)"
        line += f", key {self.key})" if self.key else ")"
        if self.provisional:
            line += "; provisional: taken under load, measured again next time"
        return line

    def to_dict(self) -> dict[str, Any]:
        """The cache's JSON form (also what ``KTHENA_HOST_PROBE`` files hold)."""
        return {"kind": FILE_KIND, "memory_bw": self.memory_bw,
                "peak_flops": dict(self.peak_flops), "threads": self.threads, "key": self.key,
                "cpu": dict(self.cpu), "load_avg_1m": self.load_avg, "cores": self.cores,
                "spread": self.spread, "measured_at": self.measured_at,
                "provisional": self.provisional, "details": dict(self.details)}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], source: str, *, where: str = "") -> HostFigures:
        """Read `to_dict`'s form back.

        Raises:
            HostProbeError: a field missing or of the wrong kind (named, with ``where``).
        """
        where = where or "host probe"

        def number(name: str, value: Any, positive: bool = True) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    value > 0 if positive else value >= 0) or not math.isfinite(value):
                raise HostProbeError(f"{where}: field {name!r}: expected a "
                                     f"{'positive' if positive else 'non-negative'} number, "
                                     f"got {value!r}")
            return float(value)

        if not isinstance(record, Mapping):
            raise HostProbeError(f"{where}: expected a JSON object (the host probe's cache form)")
        for name in ("memory_bw", "peak_flops", "threads"):
            if name not in record:
                raise HostProbeError(f"{where}: missing field {name!r} (expected the JSON a "
                                     "host probe caches: memory_bw, peak_flops, threads, ...)")
        peaks = record["peak_flops"]
        if not isinstance(peaks, Mapping) or "bf16" not in peaks:
            raise HostProbeError(f"{where}: field 'peak_flops': expected an object with 'bf16' "
                                 f"(and 'fp32') FLOP/s, got {peaks!r}")
        threads = record["threads"]
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise HostProbeError(f"{where}: field 'threads': expected a positive integer, got "
                                 f"{threads!r}")
        load = record.get("load_avg_1m")
        cpu = record.get("cpu") or {}
        if not isinstance(cpu, Mapping):
            raise HostProbeError(f"{where}: field 'cpu': expected an object, got {cpu!r}")
        return cls(number("memory_bw", record["memory_bw"]),
                   {k: number(f"peak_flops.{k}", v) for k, v in peaks.items()}, threads,
                   str(record.get("key", "")), source, record.get("details") or {}, cpu,
                   None if load is None else number("load_avg_1m", load, positive=False),
                   int(number("cores", record.get("cores", 0), positive=False)),
                   number("spread", record.get("spread", 0.0), positive=False),
                   number("measured_at", record.get("measured_at", 0.0), positive=False),
                   bool(record.get("provisional", False)))


def _cpu_text(cpu: Mapping[str, Any]) -> str:
    name = cpu.get("model_name") or ""
    where = (f"family {cpu['family']} model {cpu['model']}"
             if cpu.get("family") not in (None, "") and cpu.get("model") not in (None, "") else "")
    return f"{name} ({where})" if name and where else name or where


def age_text(seconds: float) -> str:
    """``3 h``, ``2 d``, ``40 s``: an age for people."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def sample_times(fn: Callable[[], object], samples: int = SAMPLES) -> list[float]:
    """Wall seconds of ``samples`` calls of ``fn`` after one warm-up call (page faults, oneDNN
    primitive creation)."""
    fn()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_time_s(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up call."""
    return min(sample_times(fn, repeats))


def _bandwidth_samples(num_bytes: int, samples: int) -> dict[str, list[float]]:
    import torch

    out = {}
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            data = torch.ones(num_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
            out[str(dtype).removeprefix("torch.")] = [num_bytes / t for t in
                                                      sample_times(data.sum, samples)]
            del data
    return out


def _matmul_samples(rows: int, in_features: int, out_features: int,
                    samples: int) -> dict[str, list[float]]:
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
            out[str(dtype).removeprefix("torch.")] = [flops / t for t in sample_times(
                lambda xd=xd, wd=wd: F.linear(xd, wd), samples)]
    return out


def measure_bandwidth(num_bytes: int = BANDWIDTH_BYTES, repeats: int = REPEATS) -> dict[str, float]:
    """Bytes/s read by a ``sum`` over ``num_bytes``, per dtype, the best of ``repeats``:
    {"bfloat16": ..., "float32": ...}."""
    return {k: max(v) for k, v in _bandwidth_samples(num_bytes, repeats).items()}


def measure_matmul_peak(rows: int, in_features: int, out_features: int,
                        repeats: int = REPEATS) -> dict[str, float]:
    """FLOP/s of ``F.linear`` [rows, in] x [out, in]^T per dtype, the best of ``repeats``:
    {"bfloat16": ..., "float32": ...}."""
    return {k: max(v) for k, v in _matmul_samples(rows, in_features, out_features, repeats).items()}


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


def isa_class(flags: frozenset[str] | set[str], arch: str = "x86_64") -> str:
    """The vector ISA a CPU's matmuls run on: ``x86-amx``, ``x86-avx512-bf16``, ``x86-avx512``,
    ``x86-avx2``, or the architecture's name for anything else."""
    for flag, name in (("amx_tile", "x86-amx"), ("avx512_bf16", "x86-avx512-bf16"),
                       ("avx512f", "x86-avx512"), ("avx2", "x86-avx2")):
        if flag in flags:
            return name
    return arch or "unknown"


def cpu_label(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """{"model_name", "family", "model", "isa_class"} of this CPU (x86's family / model numbers
    tell a Zen 3 from a Zen 4 where a VM's model name is just "AMD EPYC"; "" where unknown)."""
    text = ""
    with contextlib.suppress(OSError), open(cpuinfo) as f:
        text = f.read()
    info = parse_cpuinfo(text)
    return {"model_name": str(info["model_name"]) or platform.processor(),
            "family": str(info["family"]), "model": str(info["model_number"]),
            "isa_class": isa_class(info["flags"], platform.machine())}  # type: ignore[arg-type]


def host_key(threads: int, torch_version: str, sizes: object) -> str:
    """The hex key of a host measurement: what would make another measurement differ."""
    parts = [cpu_identity(), torch_version, threads, sizes]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def load_host_probe(path: str | os.PathLike[str]) -> HostFigures:
    """A host probe recorded as JSON (`HostFigures.to_dict`'s form), as ``KTHENA_HOST_PROBE``
    names it.

    Raises:
        HostProbeError: the file is missing or unreadable, not JSON, or a field is missing or
            malformed (the message names the file and the field).
    """
    where = f"KTHENA_HOST_PROBE={path}"
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise HostProbeError(f"{where}: cannot read it: {e.strerror or e}") from None
    except ValueError as e:
        raise HostProbeError(f"{where}: not JSON: {e}") from None
    return HostFigures.from_dict(record, f"file {path}", where=where)


def _owned_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def measure_host(cache_dir: str | os.PathLike[str] | None = None, *,
                 probe_file: str | os.PathLike[str] | None = None,
                 bandwidth_bytes: int = BANDWIDTH_BYTES,
                 matmul_shape: tuple[int, int, int] = MATMUL_SHAPE,
                 samples: int = SAMPLES,
                 load: Callable[[], float | None] = _load_avg) -> HostFigures | None:
    """This host's memory bandwidth and matmul peak on torch's current threads.

    Args:
        cache_dir: where measurements are kept (``<cache_dir>/host/<key>.json``); None:
            measure every time. A folder that cannot be written is warned about, and the
            figures are used uncached.
        probe_file: a recorded probe (``KTHENA_HOST_PROBE``) used instead of measuring.
        bandwidth_bytes, matmul_shape, samples: probe sizes (tests pass tiny ones).
        load: the 1-minute load average now (tests inject one).

    Returns:
        The figures, or None when torch is not installed (nothing to measure with).

    Raises:
        HostProbeError: ``probe_file`` cannot be used (`load_host_probe`).
    """
    if probe_file is not None:
        return load_host_probe(probe_file)
    try:
        import torch
    except ImportError:
        return None
    threads = torch.get_num_threads()
    key = host_key(threads, torch.__version__, [bandwidth_bytes, list(matmul_shape), samples])
    path = None if cache_dir is None else Path(cache_dir) / "host" / f"{key}.json"
    cached = _read_cached(path, key)
    if cached is not None and not cached.provisional:
        return cached
    figures = _measure(key, threads, bandwidth_bytes, matmul_shape, samples, load())
    if path is not None:
        _write_cached(path, figures)
    return figures


def _read_cached(path: Path | None, key: str) -> HostFigures | None:
    if path is None:
        return None
    with contextlib.suppress(OSError, ValueError, HostProbeError):
        record = json.loads(path.read_text())
        if isinstance(record, dict) and record.get("key") == key:
            return HostFigures.from_dict(record, "cached", where=str(path))
    return None


def _write_cached(path: Path, figures: HostFigures) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(figures.to_dict(), indent=1))
        tmp.replace(path)
    except OSError as e:
        _log.warning("host probe: cannot cache the measurement in %s (%s); it is used "
                     "uncached and measured again next time", path.parent, e.strerror or e)


def _spread(values: list[float]) -> float:
    """The range of the samples less the fastest and the slowest one, over their median
    (a page fault or a timer tick in one sample is not noise)."""
    inner = sorted(values)[1:-1] if len(values) >= 4 else sorted(values)
    return (inner[-1] - inner[0]) / statistics.median(values)


def is_busy(load_avg: float | None, cores: int) -> bool:
    """Whether a measurement taken at this 1-minute load average on ``cores`` cores was taken
    under load: other work held more than half of them (then timings measure the neighbours as
    much as the machine). The one rule for the host probe and the kernel choice
    (``mooncake_ops.kernel_cache``); an unknown load is not busy."""
    return load_avg is not None and load_avg > cores / 2


def _measure(key: str, threads: int, bandwidth_bytes: int, matmul_shape: tuple[int, int, int],
             samples: int, load_avg: float | None) -> HostFigures:
    cores = _owned_cores()
    reads = _bandwidth_samples(bandwidth_bytes, samples)
    rows, in_features, out_features = matmul_shape
    peaks = _matmul_samples(rows, in_features, out_features, samples)
    read = {k: statistics.median(v) for k, v in reads.items()}
    peak = {k: statistics.median(v) for k, v in peaks.items()}
    spread = max(_spread(reads[max(read, key=read.__getitem__)]),
                 _spread(peaks[max(peak, key=peak.__getitem__)]))
    busy = is_busy(load_avg, cores)
    details = {**{f"sum_{k}_gb_s": round(v / 1e9, 2) for k, v in read.items()},
               **{f"matmul_{k}_gflop_s": round(v / 1e9, 1) for k, v in peak.items()},
               "bandwidth_probe": f"sum over {bandwidth_bytes / 2**20:g} MiB, median of {samples}",
               "matmul_probe": f"F.linear [{rows}, {in_features}] x [{out_features}, "
                               f"{in_features}]^T in bf16 and float32, median of {samples}",
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return HostFigures(max(read.values()), {"bf16": max(peak.values()), "fp32": peak["float32"]},
                       threads, key, "measured", details, cpu_label(), load_avg, cores,
                       round(spread, 4), _now_s(), busy or spread > SPREAD_LIMIT)
