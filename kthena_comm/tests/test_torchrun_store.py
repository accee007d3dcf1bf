"""Ranks started by ``kthena-run`` (torchrun) join torchrun's store instead of opening a second.

torchrun's agent already listens on MASTER_PORT; a rank 0 that also tried to host a store there
failed to bind. A real 2-rank launch must run the collectives and say nothing about binding.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from _support import free_port

RANK_SCRIPT = Path(__file__).parent / "_rank_worker.py"


def test_two_rank_kthena_run_reuses_torchruns_store():
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "kthena_core.launcher", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--backend", "gloo",
         str(RANK_SCRIPT), "collectives"],
        capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "failed to bind" not in proc.stderr and "Address already in use" not in proc.stderr
    # both ranks write to one pipe, so their lines may run together: take every flat object
    results = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", proc.stdout)]
    assert sorted(r["rank"] for r in results) == [0, 1]  # both ran every collective check
    assert {r["backend"] for r in results} == {"gloo"}
