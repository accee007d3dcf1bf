"""`kthena deploy k8s` and the engine's features: every one deploy.yaml asks for becomes its
``kthena serve`` flag (int8 weights, the int8 KV pool, TP overlap, KV offload, SP, EP), or is
refused by key where the engine would refuse it (an architecture it does not load, wide EP over
instances, a feature the plan's layout cannot run). Manifests are checked against Kthena's CRDs as in test_deploy_k8s.py."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml

from kthena_core.architectures import SERVED_ARCHITECTURES
from kthena_core.cli import main
from kthena_core.config_plan import _PinnedPlanner
from kthena_core.deploy import DeployError, load_deploy_spec, plan_deployment, render_manifests
from kthena_core.known_models import load_model_spec
from kthena_core.layout import ExpertLayout, Layout


def _helpers() -> Any:
    """test_deploy_k8s's CRD check, pod reader and deploy files (imported by path: the tests
    run in importlib mode)."""
    spec = importlib.util.spec_from_file_location(
        "_deploy_k8s_helpers", Path(__file__).with_name("test_deploy_k8s.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


K8S = _helpers()
GiB = 1024**3
LLAMA_ONE_NODE = {**K8S.LLAMA_ATLAS, "num_nodes": 1}
CPU_COLOCATED = {"name": "smollm2", "image": "kthena-worker:test", "topology": "cpu-host"}
STORE = "mooncake@mooncake-master.kthena-system:50051"


def serve_args(data: dict[str, Any], planner: Any = None) -> tuple[Any, list[str]]:
    """(deployment, the colocated worker's kthena serve args), every manifest CRD-checked."""
    dep = plan_deployment(load_deploy_spec(data), planner)
    manifests = render_manifests(dep)
    for manifest in manifests:
        K8S.check_against_crd(manifest)
    return dep, K8S.pods(manifests[1])["serve"]["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def refused(data: dict[str, Any], message: str) -> None:
    with pytest.raises(DeployError) as error:
        plan_deployment(load_deploy_spec(data))
    assert message in str(error.value)


# ---- architectures ------------------------------------------------------------------------------
def test_an_architecture_the_engine_does_not_load_is_refused_with_the_served_list(tmp_path,
                                                                                 capsys):
    folder = tmp_path / "made-up"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MadeUpForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100}))
    data = {**CPU_COLOCATED, "model": str(folder), "checkpoint": "/mnt/models/made-up"}
    message = (f"model: {str(folder)!r}: architecture ['MadeUpForCausalLM'] is not supported by "
               f"the engine; allowed: {', '.join(sorted(SERVED_ARCHITECTURES))} (kthena serve "
               "would refuse it)")
    with pytest.raises(DeployError) as error:
        load_deploy_spec(data)
    assert str(error.value) == message
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert main(["deploy", "k8s", "--config", str(config)]) == 2
    assert capsys.readouterr().err == f"kthena deploy: error: {message}\n"


# ---- dtypes -------------------------------------------------------------------------------------
def test_int8_weights_and_the_int8_kv_pool_become_their_flags():
    dep, args = serve_args({**LLAMA_ONE_NODE, "workload": {"dtype": "int8", "kv_dtype": "int8"}})
    assert (flag(args, "--dtype"), flag(args, "--quantization")) == ("bfloat16", "int8")
    assert flag(args, "--kv-cache-dtype") == "int8"
    # the pool is the plan's int8 KV: head_dim + a 4-byte scale per KV head, not bf16's 2 x 128
    mem = dep.plan.chosen.memory
    assert flag(args, "--kv-cache-memory") == f"{math.ceil(int(mem.kv_cache) / 2**20)}MiB"
    model = dep.plan.model
    assert model.kv_bytes_per_token("int8", dep.tp) / model.kv_bytes_per_token("bf16", dep.tp) \
        == (128 + 4) / 256
    _, bf16_args = serve_args(LLAMA_ONE_NODE)
    assert not {"--quantization", "--kv-cache-dtype"} & set(bf16_args)


def test_a_pd_workers_engine_config_carries_int8_weights_and_kv():
    dep = plan_deployment(load_deploy_spec({**K8S.PD_CPU,
                                            "workload": {"dtype": "int8", "kv_dtype": "int8"}}))
    serving = render_manifests(dep)[1]
    K8S.check_against_crd(serving)
    for container in K8S.pods(serving).values():
        args = container["args"]
        engine = json.loads(flag(args, "--spec"))["engine"]
        assert (engine["dtype"], engine["quantization"], engine["kv_cache_dtype"]) == (
            "bfloat16", "int8", "int8")


# ---- TP overlap ---------------------------------------------------------------------------------
def test_tp_overlap_is_rendered_where_the_plan_runs_tp():
    dep, args = serve_args({**LLAMA_ONE_NODE, "tp_overlap": True})
    assert dep.tp == 8 and "--tp-overlap" in args
    _, plain = serve_args(LLAMA_ONE_NODE)
    assert "--tp-overlap" not in plain


@pytest.mark.parametrize(("data", "message"), [
    ({**K8S.PD_CPU, "tp_overlap": True},
     "tp_overlap: got true, but the plan gives each worker TP1, and TP overlap fuses each "
     "row-parallel matmul with its all-reduce over the TP group; allowed: false here"),
    ({**LLAMA_ONE_NODE, "tp_overlap": True, "workload": {"dtype": "int8"}},
     "tp_overlap: got true, but workload.dtype is int8, and the fused matmul + collective ops "
     "take dense weights; allowed: false here"),
    ({**LLAMA_ONE_NODE, "tp_overlap": "yes"}, "tp_overlap: got 'yes'; allowed: true or false"),
])
def test_tp_overlap_is_refused_where_the_engine_refuses_it(data, message):
    refused(data, message)


# ---- KV offload ---------------------------------------------------------------------------------
def test_kv_offload_is_rendered_and_its_host_memory_added_to_the_pod():
    plain, plain_args = serve_args(CPU_COLOCATED)
    dep, args = serve_args({**CPU_COLOCATED, "kv_offload": "host=2GiB"})
    assert flag(args, "--kv-offload") == "host=2GiB" and "--kv-offload" not in plain_args
    total = dep.plan.chosen.memory.total  # a CPU pod holds its rank's whole plan
    assert (plain.memory, dep.memory) == (f"{math.ceil(total / GiB)}Gi",
                                          f"{math.ceil(total / GiB + 2)}Gi")
    policy = render_manifests(dep)[0]
    assert len(policy["spec"]["ingress"]) == 1  # no store: only the router reaches the pod


def test_a_store_below_the_offload_listens_on_the_pod_and_admits_its_peers():
    dep, args = serve_args({**CPU_COLOCATED, "kv_offload": f"host=1GiB,store={STORE}"})
    assert flag(args, "--kv-offload") == f"host=1GiB,store={STORE},listen=$(POD_IP)"
    total = dep.plan.chosen.memory.total + GiB + 64 * 2**20  # host tier + the store segment
    assert dep.memory == f"{math.ceil(total / GiB)}Gi"
    manifests = render_manifests(dep)
    env = K8S.env_of(K8S.pods(manifests[1])["serve"])
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    policy = manifests[0]
    assert {"from": [{"podSelector": policy["spec"]["podSelector"]}]} in policy["spec"]["ingress"]
    _, given = serve_args({**CPU_COLOCATED, "kv_offload": f"host=1GiB,store={STORE},listen=0.0.0.0"})
    assert flag(given, "--kv-offload") == f"host=1GiB,store={STORE},listen=0.0.0.0"


@pytest.mark.parametrize(("data", "message"), [
    ({**K8S.PD_CPU, "kv_offload": "host=2GiB"},
     "kv_offload: got 'host=2GiB'; allowed: only with mode: colocated"),
    ({**LLAMA_ONE_NODE, "kv_offload": "host=2GiB"},
     "kv_offload: got 'host=2GiB', but the plan gives each worker TP8 x PP1 on npu; allowed: "
     "pp=1, and tp > 1 only with a worker's ranks as CPU processes of one pod"),
    ({**CPU_COLOCATED, "kv_offload": "lots"},
     "kv_offload: got 'lots'; allowed: kthena serve's --kv-offload value, host=SIZE"),
    ({**CPU_COLOCATED, "kv_offload": "store=mooncake"}, "kv_offload: got 'store=mooncake'"),
    ({**CPU_COLOCATED, "kv_offload": "host=lots"},
     "(cannot read 'lots' as a size; write e.g. 1GiB, 512MiB or 2G)"),
])
def test_kv_offload_is_refused_where_the_engine_refuses_it(data, message):
    refused(data, message)


# ---- SP and EP ----------------------------------------------------------------------------------
def test_sequence_parallel_makes_the_planner_weigh_sp_where_the_engine_runs_it():
    """Llama-2-70B on 8 x 910B: TP8 with SP8 wins on a ring (test_planner.py); without the
    key no SP is weighed."""
    dep, args = serve_args({**LLAMA_ONE_NODE, "sequence_parallel": True})
    assert (flag(args, "--tp"), flag(args, "--sp")) == ("8", "8")
    assert all(e.layout.pp == 1 for e in dep.plan.evaluations if e.layout.sp > 1)
    _, plain = serve_args(LLAMA_ONE_NODE)
    assert "--sp" not in plain
    refused({**K8S.PD_CPU, "sequence_parallel": True},
            "sequence_parallel: got True; allowed: false with mode: pd")


def test_expert_parallel_renders_the_engines_ep_over_each_workers_tp_ranks():
    """The engine's --enable-expert-parallel: Mixtral's 8 experts whole over TP8 (1 each). The
    model is set on the checked spec, so the test holds whichever MoE architectures the
    engine serves."""
    spec = attrs.evolve(load_deploy_spec({**LLAMA_ONE_NODE, "expert_parallel": True}),
                        model=load_model_spec("mixtral-8x7b"))
    dep = plan_deployment(spec)
    serving = render_manifests(dep)[1]
    K8S.check_against_crd(serving)
    args = K8S.pods(serving)["serve"]["args"]
    assert dep.tp == 8 and "--enable-expert-parallel" in args
    _, plain = serve_args(LLAMA_ONE_NODE)
    assert "--enable-expert-parallel" not in plain


def test_expert_parallel_is_refused_where_the_engine_refuses_it():
    refused({**LLAMA_ONE_NODE, "expert_parallel": True},
            "expert_parallel: got true, but llama-2-70b has no routed experts; allowed: false here")
    on_cpu = attrs.evolve(load_deploy_spec({**CPU_COLOCATED, "expert_parallel": True}),
                          model=load_model_spec("mixtral-8x7b"))  # one CPU host: TP1
    with pytest.raises(DeployError, match=r"^expert_parallel: got true, but the plan gives each "
                                          r"worker TP1, and the engine splits the experts over "
                                          r"the TP ranks; allowed: false here$"):
        plan_deployment(on_cpu)
    # Mixtral's layers with 6 experts: TP4 would give its ranks 1.5 each
    spec = attrs.evolve(load_deploy_spec({**LLAMA_ONE_NODE, "expert_parallel": True}),
                        model=_moe_with(6))
    with pytest.raises(DeployError, match=r"^expert_parallel: got true, but the plan's TP4 does "
                                          r"not divide moe-6's 6 experts"):
        plan_deployment(spec, _PinnedPlanner(Layout(4, 1, 2)))


def _moe_with(num_experts: int):
    return attrs.evolve(load_model_spec("mixtral-8x7b"), num_experts=num_experts,
                        name=f"moe-{num_experts}")


def test_a_plan_with_wide_expert_parallelism_is_refused():
    """EP groups of instances (kthena plan --wide-ep) are not what the engine runs; only a
    pinned planner makes such a plan for a deploy file."""
    spec = attrs.evolve(load_deploy_spec(LLAMA_ONE_NODE), model=load_model_spec("mixtral-8x7b"))
    with pytest.raises(DeployError, match=r"^expert_parallel: the plan TP2 x PP1 x DP4 \(EP4\) "
                                          r"groups 4 instances for wide expert parallelism, which "
                                          r"the serving engine does not run"):
        plan_deployment(spec, _PinnedPlanner(ExpertLayout(2, 1, 4, ep=4)))
