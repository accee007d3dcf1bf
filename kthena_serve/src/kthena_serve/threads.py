"""Threads vs cores: one torch thread per core this process owns; no spin-waiting on shared cores.

A worker is given cores by its affinity mask (``taskset``, a container, or the launcher that
pins one rank per core). Using more threads than that, or OpenMP pools that spin while idle,
makes two workers on two cores steal each other's time and collapses throughput. So:

* ``OMP_WAIT_POLICY=PASSIVE`` must be in the environment *before* torch is imported (OpenMP
  reads it once) wherever processes share cores; ``prepare_worker_env`` sets it for processes
  we start, and the CLI for a launcher rank. A process alone on its cores (one engine, or
  ``kthena bench serve``) keeps OpenMP's default, a short spin before sleeping: PASSIVE wakes
  the pool through the kernel at every parallel region, ~12 ms of a 50 ms batch-32 decode step
  (docs/kthena_serve.md, "Threads vs cores").
* ``configure_threads`` sets torch's intra-op threads to the cores in the affinity mask.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["configure_threads", "owned_cores", "prepare_worker_env"]


def owned_cores() -> list[int]:
    """CPU ids this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def prepare_worker_env(env: MutableMapping[str, str], num_threads: int) -> MutableMapping[str, str]:
    """Set the OpenMP variables a worker needs before it imports torch (returns ``env``)."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["OMP_NUM_THREADS"] = str(num_threads)
    return env


def configure_threads(num_threads: int | None = None) -> int:
    """Give torch one intra-op thread per owned core (or ``num_threads``); returns the count."""
    import torch

    count = num_threads or len(owned_cores())
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count
