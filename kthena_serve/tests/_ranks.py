"""Two gloo ranks as two Python processes, for the tests that run a model over TP=2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    """A loopback port free now (for the rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(argv: Callable[[int, str], list[str]], *, timeout: float = 300) -> list[str]:
    """Run ``python argv(rank, port)`` for ranks 0 and 1 (one thread each, passive OpenMP
    waits, gloo on loopback, this folder importable); both must exit 0. Returns their logs;
    whatever is still running when either fails or times out is killed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(filter(None, (HERE, os.environ.get("PYTHONPATH"))))}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, *argv(rank, port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(2)]
    try:
        logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], logs
    return logs
