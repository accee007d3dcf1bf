"""`kthena plan` / `kthena topo` through the real entry point (subprocess) and in-process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kthena_core.cli import main

DATA = Path(__file__).parent / "data"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kthena_core.cli", *args], capture_output=True, text=True, timeout=120)


def test_plan_default_model_on_this_machine():
    proc = run_cli("plan", "--model", "default", "--topology", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "TP1 x PP1 x DP1" in proc.stdout and "smollm2-135m-instruct" in proc.stdout


def test_plan_llama70b_on_hand_written_8x910b_json(capsys):
    topo = DATA / "topology-8x910b.yaml"
    assert main(["plan", "--model", "llama-2-70b", "--topology", str(topo), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layout = plan["layout"]
    assert layout["tp"] * layout["pp"] * layout["dp"] == plan["world_size"] <= 8
    assert layout["tp"] * layout["pp"] >= 3  # 70B never fits fewer than 3 x 64 GB devices
    assert plan["memory_per_device"]["total"] <= plan["memory_per_device"]["capacity"]
    assert plan["candidates"] and all("why_lost" in c for c in plan["candidates"])


def test_plan_pd_mode_on_catalog_nodes(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--topology", "atlas-800t-a2:2", "--mode", "pd"]) == 0
    out = capsys.readouterr().out
    assert "PD split:" in out and "runner-up candidates" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--model", "no-such-model"], "unknown model"),
        (["plan", "--topology", "no-such-node"], "no-such-node"),
        (["plan", "--topology", "atlas-800t-a2:x"], "not an integer"),
        (["plan", "--workload", "prompt=abc"], "not a number"),
        (["plan", "--workload", "colour=blue"], "bad workload item"),
        (["plan", "--model", "llama-2-70b", "--topology", "nvidia-rtx-4090"], "no layout"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_topo_auto_runs():
    proc = run_cli("topo")
    assert proc.returncode == 0, proc.stderr
    assert "cpu" in proc.stdout.lower()
    proc = run_cli("topo", "--json")
    assert proc.returncode == 0
    json.loads(proc.stdout)
