"""scripts/gpu_check.py: its CPU-only parts run here (argument parsing, the plan, the report
schema, the ops-parity helper), so the GPU check cannot rot between lent GPUs."""

from __future__ import annotations

import importlib.util
import json
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
    assert steps["pd_device_pools"]["status"] == "unsupported"  # said, not faked
    assert "shared memory" in steps["pd_device_pools"]["detail"]["reason"]
    assert steps["bench_serve"]["status"] == "skipped"
    planned = [n for n, s in steps.items() if s["status"] == "planned"]
    assert planned == ["pytest_cuda", "ops_parity", "engine_vs_transformers",
                       "mooncake_cuda_memory"]
    assert steps["pytest_cuda"]["command"][-2:] == ["-k", "cuda"]


def test_schema_check_finds_problems():
    gpu_check = _module()
    assert "schema is not kthena.gpu_check/1" in gpu_check.validate_report({})
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
