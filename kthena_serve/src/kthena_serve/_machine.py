"""What every benchmark records about the machine it ran on (figures mean nothing without it)."""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_model", "host_info"]


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


def host_info() -> dict:
    """CPU model, the cores this process may use, and the load averages now."""
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
