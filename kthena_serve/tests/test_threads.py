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
