"""The cuda MC2 path (torch symmetric-memory async-TP ops) over two gloo ranks, through torch's
own CPU fallbacks of the same ops (see _symm_mem_worker.py): a check of how the backend calls
them, not of the fused CUDA kernels, which have not run on a GPU."""

from __future__ import annotations

import json
import os

from _support import run_gloo_ranks

from mooncake_ops.backends import mc2_symm_mem

HERE = os.path.dirname(os.path.abspath(__file__))


def test_symm_mem_calls_match_the_unfused_ops_over_two_gloo_ranks():
    assert mc2_symm_mem.available()  # this torch has the ops (the cuda backend then uses them)
    logs = run_gloo_ranks(lambda rank, port: [os.path.join(HERE, "_symm_mem_worker.py"),
                                              str(rank), port], timeout=120)
    reports = [json.loads(log.strip().splitlines()[-1]) for log in logs]
    for report in reports:
        assert len(report["diffs"]) == 6
        # the same products summed in the same order: equal, not merely close
        assert all(d == 0.0 for diffs in report["diffs"].values() for d in diffs), report
