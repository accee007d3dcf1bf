"""Threads follow the cores a process owns; workers get PASSIVE OpenMP before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # as a launcher pinning one rank
from kthena_serve.threads import configure_threads
import torch
print(configure_threads(), torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY"))
"""


def test_worker_uses_one_thread_per_owned_core():
    from kthena_serve.threads import prepare_worker_env

    env = prepare_worker_env(dict(os.environ), 1)
    env.pop("OMP_NUM_THREADS")  # the affinity mask alone must decide
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.split()
    assert out == ["1", "1", env["OMP_WAIT_POLICY"]]
    assert env["OMP_WAIT_POLICY"] in ("PASSIVE", os.environ.get("OMP_WAIT_POLICY"))


def test_prepare_worker_env_sets_openmp_before_torch():
    from kthena_serve.threads import prepare_worker_env

    env = prepare_worker_env({}, 3)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "3"}


def test_cli_sets_passive_only_for_a_launcher_rank(monkeypatch):
    """A process alone on its cores keeps OpenMP's default wait policy (PASSIVE would wake the
    pool through the kernel at every parallel region); a launcher rank, which shares the cores
    with its siblings, gets PASSIVE; a value the user set stays."""
    from kthena_serve.cli import _prepare_process

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    for world in (None, "1", " "):
        if world is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
        _prepare_process()
        assert "OMP_WAIT_POLICY" not in os.environ, world
    monkeypatch.setenv("WORLD_SIZE", "2")
    _prepare_process()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    _prepare_process()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
