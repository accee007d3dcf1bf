"""`kthena deploy k8s` in PD mode with multi-rank roles: each role's engine in its worker spec,
a role larger than a node as a serving group, every object valid under Kthena's CRDs, deploy.yaml's
``pd`` section, and the refusals by name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kthena_core.config import load_config
from kthena_core.deploy import DeployError, load_deploy_spec, plan_deployment, render_manifests
from kthena_core.deploy.cli import header
from kthena_core.deploy.k8s import to_yaml
from kthena_core.launcher import build_parser, torchrun_argv
from kthena_core.layout import Layout, PDLayout


def _helpers() -> Any:
    """test_deploy_k8s's CRD check, pod reader and deploy files (imported by path: the tests
    run in importlib mode)."""
    spec = importlib.util.spec_from_file_location(
        "_deploy_k8s_helpers_pd", Path(__file__).with_name("test_deploy_k8s.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


K8S = _helpers()
DOCS, POD_NETWORK = K8S.DOCS, K8S.POD_NETWORK
check_against_crd, env_of, pods, render = K8S.check_against_crd, K8S.env_of, K8S.pods, K8S.render

LLAMA_PD = {"name": "llama-2-70b-pd", "image": "kthena-worker:test", "model": "llama-2-70b",
            "checkpoint": "/mnt/models/Llama-2-70b-hf", "topology": "atlas-800t-a2",
            "mode": "pd", "pod_network": POD_NETWORK}
# nodes of 2 x 910B3: a 70B instance needs 4 devices (TP2 x PP2), so every role spans 2 nodes
LLAMA_PD_GROUPS = {**{k: v for k, v in LLAMA_PD.items() if k != "topology"},
                   "name": "llama-2-70b-pd-groups", "device": "ascend-910b3", "devices": 2,
                   "num_nodes": 8}


def spec_of(container: dict[str, Any]) -> dict[str, Any]:
    """A PD worker's ServeSpec JSON, from its args (after kthena-run's, in a serving group)."""
    args = container["args"]
    return json.loads(args[args.index("--spec") + 1])


def roles_of(serving: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in serving["spec"]["template"]["roles"]}


@pytest.mark.parametrize("data", [LLAMA_PD, LLAMA_PD_GROUPS, {**LLAMA_PD, "tp_overlap": True},
                                  {**LLAMA_PD, "pd": {"prefill": {"tp": 2, "pp": 2}}}],
                         ids=["one-node", "serving-groups", "tp-overlap", "pinned-prefill"])
def test_pd_with_multi_rank_roles_validates_against_the_crds(data):
    for kv_events in (None, "redis://redis.kthena-system:6379"):
        extra = {"kv_events": kv_events} if kv_events else {}
        manifests = render_manifests(plan_deployment(load_deploy_spec({**data, **extra})))
        assert [m["kind"] for m in manifests] == ["NetworkPolicy", "ModelServing",
                                                  "ModelServer", "ModelRoute"]
        for manifest in manifests:
            check_against_crd(manifest)


def test_llama_2_70b_pd_on_one_atlas_node_runs_a_tp4_prefill_and_a_tp4_decode_worker():
    dep, (serving, server, _) = render(LLAMA_PD)
    assert dep.plan.pd_layout == PDLayout(Layout(4, 1, 1), Layout(4, 1, 1))
    roles = roles_of(serving)
    assert {name: (r["replicas"], r["workerReplicas"]) for name, r in roles.items()} == {
        "prefill": (1, 0), "decode": (1, 0)}
    assert serving["spec"]["replicas"] == 1 and "gangPolicy" not in serving["spec"]["template"]
    prefill_role, decode_role = dep.plan.roles
    for name, container in pods(serving).items():
        assert container["command"] == ["python3", "-m", "kthena_serve.pd.worker"]
        engine = spec_of(container)["engine"]
        assert (engine["tp"], engine["device"], engine["dtype"]) == (4, "npu", "bfloat16")
        assert "pp" not in engine and "ranks_from" not in engine  # one pod spawns its 4 ranks
        assert container["resources"]["limits"]["huawei.com/Ascend910"] == "4"
        planned = prefill_role if name == "prefill" else decode_role
        assert engine["kv_cache_memory"] == f"{-(-int(planned.memory.kv_cache) // 2**20)}MiB"
        assert engine["max_num_seqs"] == planned.max_num_seqs == 32
        weights = planned.memory.weights * 4 + planned.memory.reserve  # through host memory
        assert container["resources"]["limits"]["memory"] == f"{-(-int(weights) // 2**30)}Gi"
        assert container["resources"]["limits"]["cpu"] == "16"  # 4 per rank
    assert server["spec"]["workloadSelector"]["pdGroup"]["decodeLabels"] == {
        "modelserving.volcano.sh/role": "decode"}
    assert dep.summary() == ("llama-2-70b on atlas-800t-a2, mode pd: prefill 1 x TP4 + decode "
                             "1 x TP4 on 8 ascend-910b2 device(s); pods: 1 prefill + 1 decode")


def test_a_pd_role_larger_than_a_node_becomes_a_serving_group():
    dep, (serving, server, _) = render(LLAMA_PD_GROUPS)
    prefill, decode = dep.plan.pd_layout.prefill, dep.plan.pd_layout.decode
    assert (prefill.tp, prefill.pp, decode.tp, decode.pp) == (2, 2, 2, 2)
    spec = serving["spec"]
    assert spec["template"]["gangPolicy"] == {"minRoleReplicas": {"prefill": prefill.dp,
                                                                  "decode": decode.dp}}
    assert spec["recoveryPolicy"] == "ServingGroupRecreate"
    for name, role in roles_of(serving).items():
        assert role["workerReplicas"] == 1  # 4 ranks over nodes of 2 devices: entry + 1
        entry = role["entryTemplate"]["spec"]["containers"][0]
        worker = role["workerTemplate"]["spec"]["containers"][0]
        assert entry["command"] == worker["command"] == ["kthena-run"]
        assert entry["args"] == worker["args"]
        args = entry["args"]
        assert args[:args.index("pd-worker")] == [
            "--serving-group", "--nnodes", "2", "--nproc_per_node", "2", "--tp", "2", "--pp",
            "2", "--master_port", "29500", "--backend", "hccl", "--cpus", "8"]
        worker_args = args[args.index("pd-worker") + 1:]
        assert worker_args[:2] == ["--role", name]
        engine = spec_of(entry)["engine"]
        assert (engine["tp"], engine["pp"], engine["ranks_from"]) == (2, 2, "env")
        for container in (entry, worker):
            assert container["resources"]["limits"]["huawei.com/Ascend910"] == "2"
            assert env_of(container)["HCCL_IF_IP"]["value"] == "$(POD_IP)"
        assert {"ports", "readinessProbe"} <= set(entry)
        assert not {"ports", "readinessProbe"} & set(worker)
    assert server["spec"]["workloadSelector"]["matchLabels"][
        "modelserving.volcano.sh/entry"] == "true"


def test_kthena_run_starts_a_pd_worker_on_every_rank():
    args = build_parser().parse_args(["--nnodes", "1", "--nproc_per_node", "2", "pd-worker",
                                      "--role", "decode"])
    cfg = load_config({"cluster": {"world_size": 2}, "parallelism": {"tensor_parallel_size": 2}})
    argv = torchrun_argv(cfg, args)
    assert argv[-4:] == ["--module", "kthena_serve.pd.worker", "--role", "decode"]


def test_deploy_yaml_pins_what_its_pd_section_names():
    dep, (serving, _, _) = render({**LLAMA_PD, "pd": {"prefill": {"tp": 2, "pp": 2}}})
    assert dep.plan.pd_layout == PDLayout(Layout(2, 2, 1), Layout(4, 1, 1))
    engine = spec_of(pods(serving)["prefill"])["engine"]
    assert (engine["tp"], engine["pp"]) == (2, 2)
    assert "pipeline_split_points" not in engine  # 80 layers: equal stages
    # num_prefill is pd.prefill.count
    same = plan_deployment(load_deploy_spec({**LLAMA_PD, "num_prefill": 1}))
    assert same.plan.pd_layout == PDLayout(Layout(4, 1, 1), Layout(4, 1, 1))


def test_tp_overlap_reaches_each_tp_roles_engine():
    _, (serving, _, _) = render({**LLAMA_PD, "tp_overlap": True})
    assert all(spec_of(c)["engine"]["tp_overlap"] is True for c in pods(serving).values())


@pytest.mark.parametrize(("change", "message"), [
    ({"pd": {"prefill": {"tp": 9}}},
     "pd.prefill.tp: got 9; allowed: one of 1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64 "
     "(llama-2-70b has 64 attention heads, 8 KV heads: each rank holds whole heads)"),
    ({"pd": {"decode": {"pp": 81}}},
     "pd.decode.pp: got 81; allowed: at most llama-2-70b's 80 layers"),
    ({"pd": {"decode": {"dtype": "fp16"}}},
     "pd.decode.dtype: got 'fp16'; allowed: nothing: both roles compute in model.dtype"),
    ({"pd": {"prefill": {"tp": 4}}, "mode": "colocated", "pod_network": None},
     "pd: got {'prefill': {'tp': 4}}; allowed: only with mode: pd"),
    ({"pd": {"prefill": {"count": 2}}, "num_prefill": 1},
     "num_prefill: got 1; allowed: pd.prefill.count's 2, or one of the two keys"),
    ({"pd": {"decode": {"tp": 8}}},
     "pd.decode.tp: got decode tp 8, but no PD layout with these sizes fits 8 device(s) of "
     "atlas-800t-a2"),
    ({"num_nodes": 3, "pd": {"decode": {"tp": 16}}},
     "pd.decode.tp: got 16, but a node of 3xatlas-800t-a2 has 8 devices and a plan whose TP "
     "groups each stay on one node fits"),
    ({"tp_overlap": True, "pd": {"prefill": {"tp": 1, "pp": 4}}},
     "tp_overlap: got true, but the plan gives the prefill workers TP1, and TP overlap fuses"),
], ids=["heads", "layers", "dtype", "colocated", "two-counts", "fits-nowhere", "over-a-node",
        "tp-overlap"])
def test_a_bad_pd_role_is_refused_by_name(change, message):
    data = {k: v for k, v in {**LLAMA_PD, **change}.items() if v is not None}
    with pytest.raises(DeployError) as error:
        plan_deployment(load_deploy_spec(data))
    assert str(error.value).startswith(message)


def test_docs_show_what_the_command_renders_for_70b_pd():
    dep = plan_deployment(load_deploy_spec(DOCS / "llama-2-70b-pd.yaml"))
    rendered = (DOCS / "llama-2-70b-pd.rendered.yaml").read_text(encoding="utf-8")
    assert rendered == to_yaml(render_manifests(dep), header(dep)), (
        "regenerate: kthena deploy k8s --config docs/deploy/llama-2-70b-pd.yaml > "
        "docs/deploy/llama-2-70b-pd.rendered.yaml")
    for manifest in yaml.safe_load_all(rendered):
        check_against_crd(manifest)
