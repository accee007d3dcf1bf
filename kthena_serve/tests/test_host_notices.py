"""What is true of the whole host is said once per deployment (issue 53: the native-kernels
warning was printed by every PD worker): a launcher's first worker says it, the others are
started with ``QUIET_NOTICES_ENV`` and keep it to themselves.

The workers here are small Python processes started by a real ``ProcessLauncher``; each
pins itself as a PD worker does (``pin_to_cores``), then loads the native kernels with their
build names pointed at modules that do not exist (a stand-in for a host where the extension
is not built: this one has it built).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from kthena_serve.cluster.launcher import ProcessLauncher, WorkerProcess, WorkerSpec
from kthena_serve.cluster.worker import QUIET_NOTICES_ENV

WARNING = "mooncake_ops: native CPU kernels unavailable"

_WORKER = textwrap.dedent("""
    import sys, time
    from kthena_serve.cluster.worker import exit_on_sigterm, pin_to_cores, write_ready_file
    pin_to_cores("")
    from mooncake_ops.backends import native
    native._BUILDS = {"AVX512": "kthena_test_no_such_build", "AVX2": "kthena_test_no_such_build"}
    assert not native.is_available()
    exit_on_sigterm()
    write_ready_file(sys.argv[1], 1)
    while True:
        time.sleep(1)
""")


class _Workers(ProcessLauncher):
    def _command(self, worker: WorkerProcess, ready: Path) -> list[str]:
        return [sys.executable, "-c", _WORKER, str(ready)]


def _specs(count: int) -> list[WorkerSpec]:
    return [WorkerSpec(f"w-{i}", "prefill", ()) for i in range(count)]


def test_only_the_first_worker_is_started_without_the_quiet_mark(monkeypatch):
    monkeypatch.setenv(QUIET_NOTICES_ENV, "1")  # inherited from a parent: not for the first
    launcher = _Workers(_specs(3), restart=False)
    try:
        marks = [launcher._environment(w).get(QUIET_NOTICES_ENV)
                 for w in launcher.workers.values()]
    finally:
        launcher.stop()
    assert marks == [None, "1", "1"]


def test_a_deployment_of_three_workers_prints_the_native_warning_once(capfd):
    with _Workers(_specs(3), restart=False):  # starts them, waits until each is ready
        pass
    err = capfd.readouterr().err
    assert err.count(WARNING) == 1, err
