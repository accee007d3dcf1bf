"""One model, one set of names: every tool takes the catalog name, the served name and the Hub
id; `kthena deploy k8s` serves the name `kthena serve` serves; a Hub id outside the catalog is
planned from its config.json in the Hugging Face cache; and the plan's text says when its
predictions are uncalibrated and never prints an empty runner-up table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kthena_core.cli import main
from kthena_core.deploy import load_deploy_spec
from kthena_core.deploy.spec import DeployError
from kthena_core.known_models import (
    DEFAULT_SERVED_NAME,
    HUB_IDS,
    KNOWN_CONFIGS,
    catalog_name,
    load_model_spec,
    serve_source,
    served_name,
)
from kthena_core.model_spec import ModelSpecError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_NAMES = ("default", "smollm2-135m-instruct", "SmolLM2-135M-Instruct",
                 "SMOLLM2-135M-INSTRUCT", "HuggingFaceTB/SmolLM2-135M-Instruct",
                 "huggingfacetb/smollm2-135m-instruct")
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}


def test_every_catalog_entry_has_a_hub_id_and_each_name_finds_it():
    assert set(HUB_IDS) == set(KNOWN_CONFIGS)
    for name, hub_id in HUB_IDS.items():
        assert catalog_name(name) == catalog_name(name.upper()) == catalog_name(hub_id) == name
    for name in DEFAULT_NAMES:
        assert catalog_name(name) == "smollm2-135m-instruct", name
    assert catalog_name("gpt2") is None and catalog_name("org/unknown") is None


@pytest.mark.parametrize("name", DEFAULT_NAMES)
def test_the_planner_reads_the_same_model_under_every_name(name):
    spec = load_model_spec(name)
    reference = load_model_spec("default")
    assert (spec.name, spec.num_params(), spec.shape) == (reference.name,
                                                          reference.num_params(), reference.shape)


def test_served_names_and_what_serve_loads():
    for name in ("default", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"):
        assert served_name(name) == DEFAULT_SERVED_NAME == "SmolLM2-135M-Instruct"
        assert serve_source(name) == "default"
    # the default model's Hub repo is its bf16 weights, loaded from the Hub as itself
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_name(hub) == serve_source(hub) == hub
    # another catalog name: served as the name given, loaded from its Hub id
    assert served_name("Llama-3-8B") == "llama-3-8b"
    assert serve_source("llama-3-8b") == "meta-llama/Meta-Llama-3-8B"
    assert served_name("org/model") == serve_source("org/model") == "org/model"
    assert served_name("/models/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"


def test_an_existing_folder_is_a_path_not_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama-3-8b").mkdir()
    assert serve_source("llama-3-8b") == "llama-3-8b" and served_name("llama-3-8b") == "llama-3-8b"


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_kthena_plan_takes_the_served_name_and_the_hub_id(capsys, name):
    args = ["plan", "--topology", "nvidia-rtx-4090", "--json"]
    assert main([*args, "--model", name]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main([*args, "--model", "default"]) == 0
    reference = json.loads(capsys.readouterr().out)
    assert planned["model"] == reference["model"] and planned["layout"] == reference["layout"]


def test_an_unknown_name_lists_every_form(capsys):
    assert main(["plan", "--model", "no-such-model", "--topology", "nvidia-rtx-4090"]) == 2
    err = capsys.readouterr().err
    for form in ("Hub repo id ORG/NAME", "SmolLM2-135M-Instruct", "llama-2-70b", ".gguf"):
        assert form in err


def hub_cache(cache: Path, repo_id: str, config: dict) -> Path:
    """huggingface_hub's own cache layout holding ``repo_id``'s config.json at ``main``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(config))
    return cache


def plan_in_subprocess(model: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE at import: a process of its own."""
    return subprocess.run([sys.executable, "-m", "kthena_core.cli", "plan", "--model", model,
                           "--topology", "nvidia-rtx-4090", "--json"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_a_hub_id_outside_the_catalog_is_planned_from_its_cached_config(tmp_path):
    pytest.importorskip("huggingface_hub")
    cache = hub_cache(tmp_path / "hub", "kthena-test/tiny-llama", TINY_CONFIG)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = plan_in_subprocess("kthena-test/tiny-llama", env)
    assert proc.returncode == 0, proc.stderr
    model = json.loads(proc.stdout)["model"]
    assert model["name"] == "kthena-test/tiny-llama" and model["num_layers"] == 2
    missing = plan_in_subprocess("kthena-test/not-cached", env)
    assert missing.returncode == 2
    for says in ("kthena-test/not-cached", "HF_HUB_OFFLINE is set", str(cache),
                 "hf download kthena-test/not-cached config.json"):
        assert says in missing.stderr, missing.stderr


def deploy(**extra) -> dict:
    return {"name": "smollm2", "image": "kthena-worker:test", "topology": "cpu-host", **extra}


@pytest.mark.parametrize("model", [None, "default", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"])
def test_deploy_serves_the_default_model_under_kthena_serves_name(model):
    spec = load_deploy_spec(deploy(**({} if model is None else {"model": model})))
    assert spec.served_model_name == served_name("default") == "SmolLM2-135M-Instruct"
    assert spec.checkpoint == "default"  # the model baked into the image


def test_deploy_of_a_hub_id_serves_the_hub_id_and_needs_its_checkpoint():
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(DeployError, match="checkpoint: missing"):
        load_deploy_spec(deploy(model=hub))
    spec = load_deploy_spec(deploy(model=hub, checkpoint="/models/smollm2"))
    assert spec.served_model_name == hub and spec.model.name == "smollm2-135m-instruct"
    named = load_deploy_spec(deploy(model=hub, checkpoint="/m", served_model_name="mine"))
    assert named.served_model_name == "mine"


def test_no_empty_runner_up_table(capsys):
    assert main(["plan", "--topology", "nvidia-rtx-4090"]) == 0
    out = capsys.readouterr().out
    assert "runner-up candidates" not in out
    assert "runner-ups none (1 layout(s) considered: the chosen layout is the only one)" in out
    assert main(["plan", "--model", "llama-2-70b", "--topology", "atlas-800t-a2",
                 "--candidates", "0"]) == 0
    out = capsys.readouterr().out
    assert "runner-up candidates" not in out and "hidden, --candidates 0)" in out


def test_uncalibrated_predictions_say_so_and_a_calibration_file_does_not(capsys, tmp_path):
    bench = str(ROOT / "docs" / "examples" / "bench_cpu_smollm2.json")
    topology = str(ROOT / "docs" / "examples" / "cpu_2core_measured.yaml")
    assert main(["plan", "--topology", topology, "--calibration", "none"]) == 0
    out = capsys.readouterr().out
    predicted = out.split("predicted ", 1)[1].splitlines()
    assert predicted[1].strip().startswith("uncalibrated: expected error unknown")
    assert "kthena bench serve --no-hf > bench.json && kthena plan --calibrate bench.json" in out
    assert "factors   uncalibrated: built-in default" in out
    assert main(["plan", "--topology", topology, "--calibration", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibrated"] is False

    calibration = str(tmp_path / "calibration.json")
    assert main(["plan", "--calibrate", bench, "--topology", topology,
                 "--calibration-out", calibration]) == 0
    assert "uncalibrated:" not in capsys.readouterr().out  # a fit shows its own table
    assert main(["plan", "--topology", topology, "--calibration", calibration]) == 0
    out = capsys.readouterr().out
    assert "uncalibrated:" not in out and f"factors   calibration file {calibration}" in out
    assert main(["plan", "--topology", topology, "--calibration", calibration, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibrated"] is True


def test_model_spec_errors_name_the_hub_when_huggingface_hub_is_missing(monkeypatch):
    import kthena_core.hub_config as hub_config

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails, as uninstalled
    with pytest.raises(ModelSpecError, match="pip install huggingface_hub"):
        hub_config.hub_config("org/model")
