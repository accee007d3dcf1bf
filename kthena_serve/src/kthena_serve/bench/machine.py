"""What every benchmark records about the machine it ran on (figures mean nothing without it)."""

from __future__ import annotations

import os
import platform
import time

from kthena_core.discovery.cpu import parse_cpuinfo

__all__ = ["cpu_isa", "cpu_model", "host_info", "wait_until_idle"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa(path: str = "/proc/cpuinfo") -> str:
    """The CPU's family / model and the vector ISA the kernels choose by, from ``/proc/cpuinfo``
    (a VM's model name can be just "AMD EPYC", Zen 3 and Zen 4 alike), e.g. ``family 25 model
    17: avx512, avx512_bf16`` or ``family 25 model 1: avx2, no avx512``; "" where unknown."""
    try:
        with open(path, encoding="utf-8") as f:
            info = parse_cpuinfo(f.read())
    except OSError:
        return ""
    flags = info["flags"]
    if "avx512f" in flags:
        isa = ["avx512"] + [name for flag, name in (("avx512_bf16", "avx512_bf16"),
                                                    ("amx_tile", "amx")) if flag in flags]
    else:
        isa = ["avx2" if "avx2" in flags else "no avx2", "no avx512"]
    where = (f"family {info['family']} model {info['model_number']}"
             if info["family"] and info["model_number"] else "")
    return ": ".join(part for part in (where, ", ".join(isa) if flags else "") if part)


def host_info() -> dict:
    """CPU model and ISA, the cores this process may use, and the load averages now."""
    return {"cpu": cpu_model(), "cpu_isa": cpu_isa(), "cores": len(os.sched_getaffinity(0)),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()]}


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of the CPUs this process may run on, from /proc/stat: busy is
    user, nice, system, irq and softirq; total adds idle, iowait and steal. None without it."""
    cores = {f"cpu{core}" for core in os.sched_getaffinity(0)}
    busy = total = 0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *fields = line.split()
                if name in cores:
                    user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
                    busy += user + nice + system + irq + softirq
                    total += user + nice + system + irq + softirq + idle + iowait + steal
    except (OSError, ValueError):
        return None
    return (busy, total) if total else None


def wait_until_idle(busy_below: float = 0.1, window_s: float = 0.25, max_s: float = 10.0) -> float:
    """Block until a ``window_s`` window in which this process's CPUs (its affinity mask) were
    busy less than ``busy_below`` of the time, all processes counted, or ``max_s`` passed;
    returns the seconds waited.

    Benchmarks call it before each timed run: a system that just ran may keep a core busy for a
    while after its last answer (vLLM's workers poll their message queue for a second before
    they sleep), which would land on the next system's run. Without /proc/stat it waits one
    window.
    """
    start = time.perf_counter()
    before = _cpu_times()
    while True:
        time.sleep(window_s)
        now = _cpu_times()
        waited = time.perf_counter() - start
        if before is None or now is None:
            return waited
        busy, total = now[0] - before[0], now[1] - before[1]
        if (total > 0 and busy < busy_below * total) or waited >= max_s:
            return waited
        before = now
