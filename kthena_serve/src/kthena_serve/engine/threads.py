"""Threads vs cores: one torch thread per core this process owns; no spin-waiting on shared cores.

A worker is given cores by its affinity mask (``taskset``, a container, or the launcher that
pins one rank per core). Using more threads than that, or OpenMP pools that spin while idle,
makes two workers on two cores steal each other's time and collapses throughput. OpenMP reads
``OMP_WAIT_POLICY`` once, when torch loads, so each entry point decides it before that; a
library import changes nothing (``import kthena_serve`` leaves ``os.environ`` alone):

* processes we start beside others (PD workers, DP replicas, cluster workers, TP ranks) get
  ``OMP_WAIT_POLICY=PASSIVE`` (`prepare_worker_env`, or their ``main`` before torch loads);
* the ``kthena`` command (`entry_point_wait_policy`): a launcher rank (``WORLD_SIZE`` > 1)
  shares its cores and gets PASSIVE; a lone server or benchmark owns its cores and keeps
  OpenMP's default, a short spin before sleeping: PASSIVE wakes the pool through the kernel at
  every parallel region, ~12 ms of a 50 ms batch-32 decode step (docs/kthena_serve.md,
  "Threads vs cores");
* ``LLM(...)`` in a user's own process (`in_process_wait_policy`) cannot know whether the
  machine is busy, and spinning pools on a busy machine made a generate up to 30x slower: the
  first ``LLM`` sets PASSIVE when the variable is unset and torch is not loaded yet. Where
  torch was loaded first, its OpenMP already chose to spin, and ``LLM`` runs one thread instead
  (`in_process_threads`), which never waits on a barrier. An entry point that decided earlier
  in the process (the CLI, ``python -m kthena_serve...``) is left to its decision.

A value the user exported is always kept. `user_environ` gives children the environment
without a PASSIVE that this process set for itself. ``configure_threads`` sets torch's
intra-op threads to the cores in the affinity mask.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

__all__ = ["configure_threads", "entry_point_wait_policy", "in_process_threads",
           "in_process_wait_policy", "owned_cores", "prepare_worker_env", "user_environ"]

log = logging.getLogger(__name__)
WAIT_POLICY = "OMP_WAIT_POLICY"
# What this process decided (module state: OpenMP reads the variable once per process).
_decided = False  # an entry point chose the policy; later ones keep it
_defaulted = False  # we set OMP_WAIT_POLICY=PASSIVE (the environment had no value)
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


def _default_to_passive() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set a value; remember that we set it."""
    global _defaulted
    if WAIT_POLICY not in os.environ:
        os.environ[WAIT_POLICY] = "PASSIVE"
        _defaulted = True


def entry_point_wait_policy(shares_cores: bool) -> None:
    """Decide OpenMP's wait policy for a ``kthena`` command, before torch loads.

    An ``LLM`` built later in this process keeps this decision (`in_process_wait_policy`).

    Args:
        shares_cores: other processes run on this one's cores (a launcher rank): set
            ``OMP_WAIT_POLICY=PASSIVE`` unless the user set a value. False: change nothing, so
            a process alone on its cores keeps OpenMP's default (a short spin, then sleep).
    """
    global _decided
    _decided = True
    if shares_cores:
        _default_to_passive()


def in_process_wait_policy() -> None:
    """Decide OpenMP's wait policy for an engine in the user's own process (``LLM``).

    The first call, unless an entry point decided already or the program is
    ``python -m kthena_serve...``: ``OMP_WAIT_POLICY=PASSIVE`` if it is unset and torch is not
    loaded yet (call this before anything loads torch). If torch is loaded with the variable
    unset, its OpenMP spins: nothing is set, and `in_process_threads` then gives one thread.
    """
    global _decided, _spinning
    if _decided or _run_as_our_module():
        return
    _decided = True
    if "torch" in sys.modules:
        _spinning = WAIT_POLICY not in os.environ
    else:
        _default_to_passive()


def user_environ() -> dict[str, str]:
    """``os.environ`` as the user set it, for a child that should decide its own policy as it
    would when started from a shell (a server a benchmark starts).

    Returns:
        a copy of ``os.environ`` without the ``OMP_WAIT_POLICY=PASSIVE`` that this process set
        for itself (`entry_point_wait_policy`, `in_process_wait_policy`); a value the user
        exported is kept.
    """
    env = dict(os.environ)
    if _defaulted and env.get(WAIT_POLICY) == "PASSIVE":
        del env[WAIT_POLICY]
    return env


def in_process_threads(num_threads: int | None) -> int | None:
    """The thread count for an engine in the user's process (``LLM``); logs once what it chose
    and how to change it.

    Args:
        num_threads: the count the user asked for, or None.

    Returns:
        ``num_threads`` if given; 1 if torch was loaded before `in_process_wait_policy` decided,
        with ``OMP_WAIT_POLICY`` unset (its OpenMP spins, and two spinning threads on a busy
        machine made a generate up to 30x slower); else None (one per owned core).
    """
    global _told
    if num_threads is not None:
        return num_threads
    if _spinning:
        if not _told:
            log.warning("torch was imported before the first LLM was built, so its OpenMP "
                        "threads spin while idle (%s unset), which stalls them on a busy "
                        "machine; LLM runs 1 thread. To use every core, build the LLM before "
                        "importing torch or export %s=PASSIVE before starting Python; or pass "
                        "num_threads=N.", WAIT_POLICY, WAIT_POLICY)
        _told = True
        return 1
    if not _told and _defaulted:
        log.info("%s=PASSIVE (set by kthena_serve, as none was exported, so that OpenMP "
                 "threads sleep while idle and a busy machine does not stall them); export %s "
                 "before starting Python to choose otherwise.", WAIT_POLICY, WAIT_POLICY)
    _told = True
    return None
