"""An engine larger than a node, as `kthena deploy k8s` renders it: one Kthena serving group.

The entry and worker containers' commands (``kthena-run --serving-group ... serve ...``) run as
rendered, with the variables Kthena injects (ENTRY_ADDRESS, WORKER_INDEX, GROUP_SIZE) and the
rendered env, in two network namespaces joined by a veth pair: PP = 2 with stage 0 and the API
in the "entry pod", stage 1 in the "worker pod". The greedy completion must equal one local
engine's. Bad group variables are refused, naming the variable and what is allowed. (That
the same rendered objects validate against Kthena's CRDs is kthena_core's test_deploy_k8s.py,
``test_a_pipeline_over_two_cpu_nodes_renders_a_gloo_group``.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from _netns import two_host_network
from test_two_hosts import local_greedy_text, serve_across_and_ask

from kthena_core.cli import build_parser
from kthena_core.config_plan import _PinnedPlanner
from kthena_core.deploy import load_deploy_spec, plan_deployment, render_model_serving
from kthena_core.deploy.k8s import API_KEY_ENV
from kthena_core.launcher import build_parser as kthena_run_parser
from kthena_core.launcher import main as kthena_run
from kthena_core.layout import Layout
from kthena_serve.cli import _cmd_serve

API_KEY = "key-of-the-serving-group-test"
# PP = 2 over two CPU nodes of one core each (this test machine's share): a serving group of
# an entry pod and one worker pod.
DEPLOY = {"name": "smollm2-pp", "image": "kthena-worker:test", "topology": "cpu-host",
          "num_nodes": 2, "resources": {"cpu": 1},
          "workload": {"dtype": "float32", "kv_dtype": "float32", "concurrency": 4}}
CLIENT = """
import json, sys, httpx
reply = httpx.post("http://127.0.0.1:8000/v1/completions", timeout=120, json={
    "model": "SmolLM2-135M-Instruct", "prompt": sys.argv[1], "max_tokens": 12,
    "temperature": 0}, headers={"Authorization": "Bearer " + sys.argv[2]})
print(json.dumps({"status": reply.status_code, "body": reply.json()}))
"""


def group_containers() -> tuple[dict[str, Any], dict[str, Any]]:
    """(entry, worker) containers of the rendered serving group."""
    dep = plan_deployment(load_deploy_spec(DEPLOY), _PinnedPlanner(Layout(1, 2, 1)))
    (role,) = render_model_serving(dep)["spec"]["template"]["roles"]
    assert role["workerReplicas"] == 1
    return (role["entryTemplate"]["spec"]["containers"][0],
            role["workerTemplate"]["spec"]["containers"][0])


def pod_env(container: dict[str, Any], entry_address: str, worker_index: int) -> dict[str, str]:
    """This process's environment plus the container's, as the kubelet and Kthena set it: the
    rendered values, the API key Secret, and the serving-group variables."""
    env = dict(os.environ)
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["name"] == API_KEY_ENV, var  # the only Secret a colocated group reads
            env[var["name"]] = API_KEY
    env.update(ENTRY_ADDRESS=entry_address, WORKER_INDEX=str(worker_index), GROUP_SIZE="2")
    return env


def test_the_rendered_commands_parse_with_kthena_run_and_kthena_serve():
    for container in group_containers():
        assert container["command"] == ["kthena-run"]
        run = kthena_run_parser().parse_args(container["args"])
        assert (run.serving_group, run.nnodes, run.nproc_per_node, run.script) == (
            True, 2, 1, "serve")
        serve = build_parser().parse_args(["serve", *run.script_args])
        assert serve.func is _cmd_serve and (serve.tp, serve.pp) == (1, 2)


@pytest.mark.parametrize(("group", "message"), [
    ({"GROUP_SIZE": "3"}, "GROUP_SIZE=3, but this engine spans --nnodes 2 pods; allowed: 2"),
    ({"WORKER_INDEX": "2"}, "WORKER_INDEX=2: allowed: 0..1"),
    ({"WORKER_INDEX": "-1"}, "WORKER_INDEX=-1: allowed: 0..1"),
    ({"WORKER_INDEX": None}, "WORKER_INDEX missing: allowed: 0..1"),
    ({"ENTRY_ADDRESS": None}, "ENTRY_ADDRESS missing: allowed: the entry pod's address"),
    ({"GROUP_SIZE": "two"}, "GROUP_SIZE='two': allowed: an integer >= 1"),
], ids=["group-size", "index-too-big", "index-negative", "no-index", "no-entry", "size-text"])
def test_bad_group_variables_are_refused_by_name(group, message, monkeypatch, capsys):
    _, worker = group_containers()
    for name, value in {"ENTRY_ADDRESS": "10.0.0.1", "WORKER_INDEX": "1", "GROUP_SIZE": "2",
                        **group}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert kthena_run(["--dry-run", *worker["args"]]) == 2  # before torchrun starts
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_serving_group_runs_across_two_network_namespaces(tmp_path):
    entry, worker = group_containers()
    kthena_run_bin = str(Path(sys.executable).with_name("kthena-run"))
    with two_host_network("sg", 217) as (ns_a, ns_b, addr_a, _addr_b):
        launches = [([kthena_run_bin, *container["args"]], pod_env(container, addr_a, index))
                    for index, container in enumerate((entry, worker))]
        reply, moved = serve_across_and_ask(
            launches, (ns_a, ns_b), [tmp_path / "entry.log", tmp_path / "worker.log"], tmp_path,
            [API_KEY], CLIENT)
    assert reply["body"]["choices"][0]["text"] == local_greedy_text()
    # stage 0 -> stage 1 activations (12 steps of [tokens, 576] fp32) crossed the veth link
    assert moved > 12 * 576 * 4, moved
