"""What every package's tests share: a free port, waiting for a condition, a Prometheus value,
and gloo ranks as processes.

Importable as ``_support`` from any test module: the root conftest.py puts this folder on
``sys.path`` (in pytest and in each xdist worker). A helper script that a test runs as a
subprocess imports it when started with ``subprocess_env()`` (this folder on PYTHONPATH).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

__all__ = ["SUPPORT_DIR", "eventually", "free_port", "metric_value", "run_gloo_ranks",
           "subprocess_env", "wait_until"]

T = TypeVar("T")

SUPPORT_DIR = Path(__file__).resolve().parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (closed again at once: a rendezvous or a server binds it
    next; another process could take it first, which tests accept)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def eventually(predicate: Callable[[], T], timeout_s: float, *, interval_s: float = 0.05) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns a true value or ``timeout_s``
    has passed. Returns its last value (false on a timeout): for a test that asserts on it
    with a message of its own."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, what: str = "the condition",
               *, interval_s: float = 0.05) -> T:
    """``eventually``, failing the test (``AssertionError`` naming ``what``) on a timeout.

    Returns:
        The predicate's first true value.
    """
    value = eventually(predicate, timeout_s, interval_s=interval_s)
    if not value:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
    return value


def metric_value(text: str, prefix: str, **labels: str) -> float:
    """The sum of the samples in Prometheus text ``text`` whose line starts with ``prefix`` and
    holds ``name="value"`` for each of ``labels``; 0.0 if none does.

    ``prefix`` is a metric name (``kthena_pd_requests_total``: every series of it), or a name
    and the start of its labels (``'kthena_pd_requests_total{path="pulled"'``). It matches
    as a prefix: ``name + "{"`` leaves out a sample without labels and other names that start
    with ``name``.
    """
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def subprocess_env(*folders: str | os.PathLike, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``extra`` set and ``folders``, then this module's folder, first on
    PYTHONPATH: the environment of a helper script that imports ``_support`` (or, run with
    ``-c``, its own folder's helpers)."""
    path = [str(f) for f in folders] + [str(SUPPORT_DIR)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(path)}


def run_gloo_ranks(argv: Callable[[int, str], list[str]], world_size: int = 2, *,
                   timeout: float = 300, pythonpath: Iterable[str | os.PathLike] = ()) -> list[str]:
    """Run ``python argv(rank, port)`` for each rank (``port``: a free rendezvous port), with
    one thread each, passive OpenMP waits and gloo on loopback (``pythonpath`` and this
    folder importable); every rank must exit 0. Returns their logs (stdout and stderr);
    whatever is still running when one fails or times out is killed."""
    env = subprocess_env(*pythonpath, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
                         GLOO_SOCKET_IFNAME="lo")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, *argv(rank, port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(world_size)]
    try:
        logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * world_size, logs
    return logs
