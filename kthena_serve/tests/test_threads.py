"""Threads follow the cores a process owns; workers get PASSIVE OpenMP before torch loads, and
so does an engine in the user's own process (the first ``LLM``, or one thread); the CLI decides
for its own process, and ``import kthena_serve`` changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # as a launcher pinning one rank
from kthena_serve.engine.threads import configure_threads
import torch
print(configure_threads(), torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY"))
"""


def test_worker_uses_one_thread_per_owned_core():
    from kthena_serve.engine.threads import prepare_worker_env

    env = prepare_worker_env(dict(os.environ), 1)
    env.pop("OMP_NUM_THREADS")  # the affinity mask alone must decide
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.split()
    assert out == ["1", "1", env["OMP_WAIT_POLICY"]]
    assert env["OMP_WAIT_POLICY"] in ("PASSIVE", os.environ.get("OMP_WAIT_POLICY"))


def test_prepare_worker_env_sets_openmp_before_torch():
    from kthena_serve.engine.threads import prepare_worker_env

    env = prepare_worker_env({}, 3)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "3"}


# ---- who decides the wait policy: fresh interpreters, as pytest has loaded torch -------------
def _python(code: str, policy: str | None, args: tuple[str, ...] | list[str] = (),
            **env_vars: str) -> subprocess.CompletedProcess:
    """Run ``code`` (with ``args``) in a fresh interpreter with ``OMP_WAIT_POLICY`` =
    ``policy`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "WORLD_SIZE")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**env, **env_vars}, timeout=300, check=True)


_IMPORT = """
import os, sys
before = dict(os.environ)
import kthena_serve
from kthena_serve import LLM, SamplingParams  # what a user's script imports first
from kthena_serve.engine import threads  # the module that decides the wait policy
print(dict(os.environ) == before, "torch" in sys.modules)
"""


def test_import_leaves_the_environment_alone():
    """``import kthena_serve`` (and ``LLM``'s module) writes nothing into ``os.environ`` and
    loads no torch, so ``LLM(...)`` can still decide the policy before OpenMP reads it."""
    assert _python(_IMPORT, None).stdout.split() == ["True", "False"]
    assert _python(_IMPORT, "ACTIVE").stdout.split() == ["True", "False"]


_DECIDE = """
import os, sys
{first}
from kthena_serve.engine import threads
threads.in_process_wait_policy()  # what LLM(...) calls first
threads.in_process_wait_policy()  # a second LLM keeps the first one's choice
print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules,
      threads.in_process_threads(None), threads.in_process_threads(3),
      threads.user_environ().get("OMP_WAIT_POLICY"))
"""


def test_llm_sets_passive_before_torch_and_keeps_a_users_value():
    """Torch not loaded, nothing exported: PASSIVE, every owned core (None), and children of
    this process get the environment without it; a value the user exported stays, and is
    passed on."""
    code = _DECIDE.format(first="")
    assert _python(code, None).stdout.split() == ["PASSIVE", "False", "None", "3", "None"]
    for value in ("ACTIVE", "PASSIVE"):
        assert _python(code, value).stdout.split() == [value, "False", "None", "3", value]


def test_llm_after_torch_sets_nothing_and_runs_one_thread():
    """Torch loaded first with nothing exported: too late for OpenMP to read the variable, so
    it is not set, and the engine runs one thread unless the caller gives a count."""
    out = _python(_DECIDE.format(first="import torch"), None)
    assert out.stdout.split() == ["None", "True", "1", "3", "None"]
    assert out.stderr.count("torch was imported before the first LLM") == 1, out.stderr


_SPY = """
import os, sys
class Spy:  # prints the policy at the moment something first imports torch
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("torch", os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Spy())
from kthena_serve import LLM
try:
    LLM(max_num_seqs=0)  # refused by EngineConfig: no model is loaded
except ValueError:
    print("refused", os.environ.get("OMP_WAIT_POLICY"))
"""


def test_llm_decides_before_it_loads_torch():
    assert _python(_SPY, None).stdout.split() == ["torch", "PASSIVE", "refused", "PASSIVE"]
    assert _python(_SPY, "ACTIVE").stdout.split() == ["torch", "ACTIVE", "refused", "ACTIVE"]


_CLI = """
import os, sys
from kthena_serve.engine import threads
from kthena_serve.deployment import prepare_process
prepare_process()  # what `kthena serve` and `kthena bench serve` do first
threads.in_process_wait_policy()  # an LLM built later in the process keeps the CLI's choice
print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


def test_cli_sets_passive_only_for_a_launcher_rank():
    """A process alone on its cores keeps OpenMP's default wait policy (PASSIVE would wake the
    pool through the kernel at every parallel region), also when it builds an ``LLM``; a
    launcher rank, which shares the cores with its siblings, gets PASSIVE; a value the user
    set stays."""
    for world in ({}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": " "}):
        assert _python(_CLI, None, **world).stdout.split() == ["None", "False"], world
    assert _python(_CLI, None, WORLD_SIZE="2").stdout.split() == ["PASSIVE", "False"]
    assert _python(_CLI, "ACTIVE", WORLD_SIZE="2").stdout.split() == ["ACTIVE", "False"]


# ---- an engine in the user's own process (LLM) with a model ----------------------------------
# A tiny checkpoint (``_tiny.tiny_checkpoint``), not the default model: the thread decisions
# do not depend on the model, and with OMP_WAIT_POLICY unset OpenMP spins, so loading SmolLM2
# three times beside another pytest worker took minutes.
_TORCH_FIRST = """
import os, sys
import torch
import kthena_serve
from kthena_serve import LLM
counts = []
for _ in range(2):  # the warning comes once
    LLM(model=sys.argv[1], kv_cache_memory="16MiB")
    counts.append(torch.get_num_threads())
LLM(model=sys.argv[1], kv_cache_memory="16MiB", num_threads=2)
print(os.environ.get("OMP_WAIT_POLICY"), *counts, torch.get_num_threads(),
      len(os.sched_getaffinity(0)))
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):  # noqa: ANN001, ANN201
    from _tiny import tiny_checkpoint

    return str(tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_llm_after_torch_runs_one_thread_and_says_so_once(tiny_model):
    """torch imported before the first LLM with OMP_WAIT_POLICY unset: its OpenMP spins, so LLM
    runs one thread (a warning, once, names the fixes), unless num_threads is given; the
    environment is not touched (it is too late for OpenMP to read it)."""
    out = _python(_TORCH_FIRST, None, args=[tiny_model])
    assert out.stdout.split() == ["None", "1", "1", "2", out.stdout.split()[-1]]
    assert out.stderr.count("torch was imported before the first LLM") == 1, out.stderr
    assert "num_threads=N" in out.stderr and "OMP_WAIT_POLICY=PASSIVE" in out.stderr


def test_llm_after_torch_with_passive_set_uses_every_owned_core(tiny_model):
    out = _python(_TORCH_FIRST, "PASSIVE", args=[tiny_model])
    policy, first, second, explicit, cores = out.stdout.split()
    assert (policy, first, second, explicit) == ("PASSIVE", cores, cores, "2")
    assert "torch was imported before the first LLM" not in out.stderr


def test_our_own_modules_decide_their_policy_themselves(monkeypatch):
    """``python -m kthena_serve.bench.model`` (a benchmark) or ``... .pd.worker`` sets its own
    policy, as the CLI does: the import's default is for users' programs only."""
    from kthena_serve.engine.threads import _run_as_our_module

    for argv, ours in ((["python", "-m", "kthena_serve.bench.model", "--steps", "4"], True),
                       (["python", "-m", "kthena_serve"], True),
                       (["python", "-m", "pytest", "-m", "slow"], False),
                       (["python", "-m", "kthena_serve_tools"], False),
                       (["python", "script.py", "-m"], False), (["python", "-c", "..."], False)):
        monkeypatch.setattr(sys, "orig_argv", argv)
        assert _run_as_our_module() is ours, argv
