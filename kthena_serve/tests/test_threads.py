"""Threads follow the cores a process owns; workers get PASSIVE OpenMP before torch loads, and
so does an engine in the user's own process (``import kthena_serve`` first, or one thread)."""

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


# ---- an engine in the user's own process (LLM); fresh interpreters, as pytest loaded torch ------
_IMPORT_FIRST = """
import os, sys
import kthena_serve
from kthena_serve.cli import _prepare_process
print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
_prepare_process()  # what `kthena serve` and `kthena bench` do next, before torch loads
print(os.environ.get("OMP_WAIT_POLICY"))
"""

_TORCH_FIRST = """
import os
import torch
import kthena_serve
from kthena_serve import LLM
counts = []
for _ in range(2):  # the warning comes once
    LLM(kv_cache_memory="16MiB")
    counts.append(torch.get_num_threads())
LLM(kv_cache_memory="16MiB", num_threads=2)
print(os.environ.get("OMP_WAIT_POLICY"), *counts, torch.get_num_threads(),
      len(os.sched_getaffinity(0)))
"""


def _python(code: str, policy: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, check=True)


def test_import_sets_passive_before_torch_and_keeps_a_users_value():
    """``import kthena_serve`` (torch not loaded yet, nothing set): PASSIVE, which the CLI's
    lone process takes back; a value the user set stays through both."""
    assert _python(_IMPORT_FIRST, None).stdout.split() == ["PASSIVE", "False", "None"]
    for value in ("ACTIVE", "PASSIVE"):
        assert _python(_IMPORT_FIRST, value).stdout.split() == [value, "False", value]


def test_llm_after_torch_runs_one_thread_and_says_so_once():
    """torch imported before kthena_serve with OMP_WAIT_POLICY unset: its OpenMP spins, so LLM
    runs one thread (a warning, once, names the fixes), unless num_threads is given; the
    environment is not touched (it is too late for OpenMP to read it)."""
    out = _python(_TORCH_FIRST, None)
    assert out.stdout.split() == ["None", "1", "1", "2", out.stdout.split()[-1]]
    assert out.stderr.count("torch was imported before kthena_serve") == 1, out.stderr
    assert "num_threads=N" in out.stderr and "OMP_WAIT_POLICY=PASSIVE" in out.stderr


def test_llm_after_torch_with_passive_set_uses_every_owned_core():
    out = _python(_TORCH_FIRST, "PASSIVE")
    policy, first, second, explicit, cores = out.stdout.split()
    assert (policy, first, second, explicit) == ("PASSIVE", cores, cores, "2")
    assert "torch was imported before kthena_serve" not in out.stderr


def test_our_own_modules_decide_their_policy_themselves(monkeypatch):
    """``python -m kthena_serve.bench.model`` (a benchmark) or ``... .pd.worker`` sets its own
    policy, as the CLI does: the import's default is for users' programs only."""
    from kthena_serve.threads import _run_as_our_module

    for argv, ours in ((["python", "-m", "kthena_serve.bench.model", "--steps", "4"], True),
                       (["python", "-m", "kthena_serve"], True),
                       (["python", "-m", "pytest", "-m", "slow"], False),
                       (["python", "-m", "kthena_serve_tools"], False),
                       (["python", "script.py", "-m"], False), (["python", "-c", "..."], False)):
        monkeypatch.setattr(sys, "orig_argv", argv)
        assert _run_as_our_module() is ours, argv
