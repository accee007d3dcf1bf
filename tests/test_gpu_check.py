"""scripts/gpu_check.py: its CPU-only parts run here (argument parsing, the plan, the report
schema, the ops-parity helper), and its PD hand-off and MC2 steps run here on cpu (the decode
pool in /dev/shm instead of CUDA IPC, gloo instead of NCCL: the same code otherwise), so the
GPU check cannot rot between lent GPUs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _module():
    """The script as a module (registered first: its dataclasses resolve names through it)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def test_dry_run_writes_the_plan_in_the_report_schema(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out),
                           "--skip", "bench_serve"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    gpu_check = _module()
    assert gpu_check.validate_report(report) == []
    assert report["dry_run"] is True and report["ok"] is True
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == [s.name for s in gpu_check.STEPS]
    assert steps["environment"]["status"] == "passed"
    assert steps["environment"]["detail"]["torch"]
    assert "mooncake-transfer-engine-non-cuda" in steps["environment"]["detail"]["mooncake"]
    assert steps["bench_serve"]["status"] == "skipped"
    planned = [n for n, s in steps.items() if s["status"] == "planned"]
    assert planned == ["pytest_cuda", "ops_parity", "engine_vs_transformers",
                       "mooncake_cuda_memory", "pd_device_pools", "pd_mooncake_device_pools",
                       "mc2_parity"]
    assert steps["pytest_cuda"]["command"][-2:] == ["-k", "cuda"]
    assert steps["pd_device_pools"]["reports"] == list(gpu_check.PD_REPORTS)
    assert {"kv_bytes_written", "bytes_copied", "handoff_s"} <= set(gpu_check.PD_REPORTS)
    assert steps["pd_mooncake_device_pools"]["reports"] == list(gpu_check.PD_MOONCAKE_REPORTS)
    assert steps["mc2_parity"]["reports"] == [*gpu_check.MC2_REPORTS, "fused"]


def test_schema_check_finds_problems():
    gpu_check = _module()
    assert "schema is not kthena.gpu_check/2" in gpu_check.validate_report({})
    bad = {"schema": gpu_check.SCHEMA, "dry_run": True, "started": "", "machine": {}, "ok": True,
           "steps": [{"name": "x", "status": "great"}]}
    problems = gpu_check.validate_report(bad)
    assert any("status 'great'" in p for p in problems) and any("keys" in p for p in problems)


def test_unknown_step_names_are_refused():
    with pytest.raises(SystemExit):
        _module().parse_args(["--skip", "nonsense"])


def test_the_ops_parity_cases_run_and_agree_on_cpu():
    import torch

    gpu_check = _module()
    torch.manual_seed(0)
    errors = {name: gpu_check._max_error(case, "cpu")
              for name, case in gpu_check._parity_cases(torch).items()}
    assert set(errors) == {"paged_decode_attention", "rms_norm", "silu_and_mul"}
    assert max(errors.values()) < 1e-4, errors


def test_the_pd_handoff_step_runs_on_cpu_over_a_shm_pool():
    """The step's code end to end with the cpu route: a prefill child process fills the
    decode pool's scattered blocks; this process sees that KV in its own pool, and it equals
    what the child computed into its own pool."""
    from mooncake_kv import shared_pool_paths

    # this process's pools only: the other pytest worker makes and drops pools of its own
    before = set(shared_pool_paths(os.getpid()))
    status, detail = _module().pd_handoff("cpu", timeout_s=300)
    assert status == "passed", detail
    assert set(detail) == set(_module().PD_REPORTS)
    assert detail["route"] == "shm" and detail["bytes_copied"] == 0  # written in place
    assert detail["kv_bytes_written"] > 0 and detail["prefill_s"] > 0
    assert all(detail["checks"].values()) and len(detail["checks"]) == 4
    assert set(shared_pool_paths(os.getpid())) == before  # the pool's /dev/shm file is gone


def test_the_mooncake_push_step_runs_on_cpu_over_tcp():
    """The cross-host step's code with host pools (the installed wheel has no CUDA): the
    layer-wise push lands the prefill's blocks in the decode pool's scattered block table."""
    status, detail = _module().pd_mooncake("cpu", timeout_s=60)
    assert status == "passed", detail
    assert set(detail) == set(_module().PD_MOONCAKE_REPORTS)
    assert detail["location"] == "host" and detail["bytes_moved"] > 0
    assert detail["num_puts"] > 1 and len(detail["checks"]) == 5


def test_the_mc2_step_runs_on_cpu_over_two_gloo_ranks():
    status, detail = _module().mc2_check("cpu", 2, timeout_s=120)
    assert status == "passed", detail
    assert set(detail) == set(_module().MC2_REPORTS)
    assert set(detail["max_abs_error"]) == {"matmul_all_reduce", "all_gather_matmul",
                                            "matmul_reduce_scatter"}
    assert max(detail["max_abs_error"].values()) < detail["tolerance"]
