"""The cuda MC2 path (torch symmetric-memory async-TP ops) over two gloo ranks, through torch's
own CPU fallbacks of the same ops (see _symm_mem_worker.py): a check of how the backend calls
them, not of the fused CUDA kernels, which have not run on a GPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from mooncake_ops.backends import mc2_symm_mem

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_symm_mem_calls_match_the_unfused_ops_over_two_gloo_ranks():
    assert mc2_symm_mem.available()  # this torch has the ops (the cuda backend then uses them)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "GLOO_SOCKET_IFNAME": "lo"}
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_symm_mem_worker.py"),
                               str(rank), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], logs
    reports = [json.loads(log.strip().splitlines()[-1]) for log in logs]
    for report in reports:
        assert len(report["diffs"]) == 6
        # the same products summed in the same order: equal, not merely close
        assert all(d == 0.0 for diffs in report["diffs"].values() for d in diffs), report
