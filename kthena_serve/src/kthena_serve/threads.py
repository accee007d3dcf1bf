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
* An engine inside a user's own Python process (``LLM``, ``AsyncLLM``) cannot know whether the
  machine is busy, and spinning pools on a busy machine made a generate up to 30x slower
  (docs/kthena_serve.md, "Threads vs cores"): ``import kthena_serve`` sets
  ``OMP_WAIT_POLICY=PASSIVE`` when torch is not loaded yet and the variable is unset
  (`default_wait_policy`; not in ``python -m kthena_serve...``, whose benchmarks and workers
  decide for themselves). The CLI, whose lone server and benchmarks own their cores, takes
  that default back before torch loads (`keep_openmp_default`). Where torch was imported
  first, its OpenMP already chose to spin, and ``LLM`` runs one thread instead
  (`in_process_threads`), which never waits on a barrier.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

__all__ = ["configure_threads", "default_wait_policy", "in_process_threads",
           "keep_openmp_default", "owned_cores", "prepare_worker_env", "user_environ"]

log = logging.getLogger(__name__)
WAIT_POLICY = "OMP_WAIT_POLICY"
# What ``import kthena_serve`` found and did (set once, by `default_wait_policy`).
_defaulted = False  # it set OMP_WAIT_POLICY=PASSIVE (the environment had no value)
_spinning = False  # torch's OpenMP had already started with the default (spinning) policy
_told = False  # `in_process_threads` has logged what it does


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


def _run_as_our_module() -> bool:
    """Whether this program is ``python -m kthena_serve...`` (a benchmark, worker or replica,
    each deciding its own policy as the CLI does), not a user's script."""
    argv = getattr(sys, "orig_argv", [])
    return "-m" in argv[:-1] and argv[argv.index("-m") + 1].split(".")[0] == "kthena_serve"


def default_wait_policy() -> None:
    """At ``import kthena_serve``: ``OMP_WAIT_POLICY=PASSIVE`` unless it is set or torch (whose
    OpenMP reads it once, when torch loads) is already imported. A value the user set is kept."""
    global _defaulted, _spinning
    if "torch" in sys.modules:
        _spinning = WAIT_POLICY not in os.environ
    elif WAIT_POLICY not in os.environ and not _run_as_our_module():
        os.environ[WAIT_POLICY] = "PASSIVE"
        _defaulted = True


def user_environ() -> dict[str, str]:
    """``os.environ`` as the user set it: without the ``OMP_WAIT_POLICY=PASSIVE`` that
    ``import kthena_serve`` added (`default_wait_policy`), for a child that should decide its
    own policy as it would when started from a shell (a server a benchmark starts)."""
    env = dict(os.environ)
    if _defaulted and env.get(WAIT_POLICY) == "PASSIVE":
        del env[WAIT_POLICY]
    return env


def keep_openmp_default() -> None:
    """Undo `default_wait_policy` for a process that owns its cores alone (the CLI's lone
    server and benchmarks), while torch is not loaded: OpenMP's default spin is faster there."""
    global _defaulted
    if _defaulted and "torch" not in sys.modules and os.environ.get(WAIT_POLICY) == "PASSIVE":
        del os.environ[WAIT_POLICY]
        _defaulted = False


def in_process_threads(num_threads: int | None) -> int | None:
    """The thread count for an engine in the user's process (``LLM``): ``num_threads`` if
    given; 1 if torch was imported before ``kthena_serve`` with ``OMP_WAIT_POLICY`` unset (its
    OpenMP spins, and two spinning threads on a busy machine made a generate up to 30x slower);
    else None (one per owned core). Logs once what it chose and how to change it."""
    global _told
    if num_threads is not None:
        return num_threads
    if _spinning:
        if not _told:
            log.warning("torch was imported before kthena_serve, so its OpenMP threads spin "
                        "while idle (%s unset), which stalls them on a busy machine; LLM runs "
                        "1 thread. To use every core, import kthena_serve before torch or "
                        "export %s=PASSIVE before starting Python; or pass num_threads=N.",
                        WAIT_POLICY, WAIT_POLICY)
        _told = True
        return 1
    if not _told and _defaulted:
        log.info("%s=PASSIVE (set by import kthena_serve, so that OpenMP threads sleep while "
                 "idle and a busy machine does not stall them); set %s before importing to "
                 "choose otherwise.", WAIT_POLICY, WAIT_POLICY)
    _told = True
    return None
