"""`kthena plan` / `kthena topo` through the real entry point (subprocess) and in-process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kthena_core.cli import main
from kthena_core.known_models import load_model_spec
from kthena_core.model_spec import human_bytes

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


def test_plan_json_carries_the_model_figures_the_text_shows(capsys):
    args = ["plan", "--model", "llama-3-8b", "--topology", "atlas-800t-a2", "--workload", "kv_dtype=fp8"]
    assert main(args) == 0
    text = capsys.readouterr().out.splitlines()[0]
    assert main([*args, "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    spec = load_model_spec("llama-3-8b")
    assert model["name"] == spec.name == "llama-3-8b"
    assert model["num_params"] == spec.num_params()
    assert model["num_layers"] == spec.shape.num_layers == 32
    assert (model["num_attention_heads"], model["num_key_value_heads"]) == (32, 8)
    assert model["kv_dtype"] == "fp8" and model["kv_bytes_per_token"] == spec.kv_bytes_per_token("fp8")
    assert model["weight_bytes"] == spec.weight_bytes("bf16")
    # the same figures, as the text prints them
    assert f"{model['num_params'] / 1e9:.2f} B params, 32 layers, 32 heads / 8 KV heads" in text
    assert f"KV {human_bytes(model['kv_bytes_per_token'])}/token (fp8)" in text


def test_plan_pd_mode_on_one_device_says_why(capsys):
    assert main(["plan", "--topology", "nvidia-rtx-4090", "--mode", "pd"]) == 2
    err = capsys.readouterr().err
    assert "a PD plan needs at least 2 devices (1 prefill + 1 decode instance)" in err
    assert "this topology has 1 device" in err and "--mode colocated" in err
    assert "no candidate layouts" not in err


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


def test_plan_text_on_a_cpu_host_has_no_device_memory_limit(capsys):
    """A CPU host's capacity is unbounded: the text plan says so instead of overflowing."""
    assert main(["plan", "--model", "default", "--topology", "cpu-host:2", "--mode", "pd"]) == 0
    out = capsys.readouterr().out
    assert "(host memory: no device limit)" in out and "PD split: 1 prefill + 1 decode" in out


def test_plan_config_plans_the_config_with_a_topology_beside_it(tmp_path, capsys):
    (tmp_path / "topo.yaml").write_text((DATA / "topology-8x910b.yaml").read_text())
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("cluster: {topology: topo.yaml, world_size: 6}\n"
                   "parallelism: {strategy: tp_pp, tensor_parallel_size: 3, pipeline_parallel_size: 2}\n")
    assert main(["plan", "--config", str(cfg), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["layout"]["tp"], plan["layout"]["pp"], plan["world_size"]) == (3, 2, 6)
    assert main(["plan", "--config", str(cfg), "--model", "llama-2-70b"]) == 2
    assert "--config gives the model, topology and workload; drop --model" in capsys.readouterr().err


def _made_up_checkpoint(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MadeUpForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100}))
    return folder


def test_plan_refuses_an_architecture_the_engine_does_not_serve(tmp_path, capsys):
    from kthena_core.architectures import SERVED_ARCHITECTURES

    folder = _made_up_checkpoint(tmp_path / "made-up")
    args = ["plan", "--model", str(folder), "--topology", "atlas-800t-a2"]
    assert main(args) == 2
    assert capsys.readouterr().err == (
        f"kthena plan: made-up: architecture ['MadeUpForCausalLM'] is not supported by the "
        f"engine; allowed: {', '.join(sorted(SERVED_ARCHITECTURES))}. `kthena serve` would "
        "refuse it; plan it anyway to size hardware with --any-architecture\n")
    config = tmp_path / "kthena.yaml"
    config.write_text(f"cluster: {{topology: atlas-800t-a2}}\nmodel: {{checkpoint_path: {folder}}}\n")
    assert main(["plan", "--config", str(config)]) == 2
    assert "architecture ['MadeUpForCausalLM'] is not supported" in capsys.readouterr().err
    assert main([*args, "--any-architecture", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["architecture"] == "MadeUpForCausalLM"


def test_plan_wide_ep_weighs_expert_parallelism_over_instances_and_prints_it(capsys):
    args = ["plan", "--model", "mixtral-8x7b", "--topology", "atlas-800t-a2", "--any-architecture"]
    assert main([*args, "--wide-ep", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["ep"] > 1 and plan["experts"].startswith(f"EP{plan['layout']['ep']}: ")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "plan      TP8 x PP1 x DP1 on 8 device(s)" in out
    assert "experts   no EP: every instance holds all 8 routed experts" in out
    assert "46.70 B params (12.88 B active per token; 8 routed experts, top-2" in out
