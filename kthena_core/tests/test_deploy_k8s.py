"""`kthena deploy k8s`: manifests valid under Kthena's CRDs, laid out as the plan says.

Every rendered object is validated against the ``openAPIV3Schema`` of its CRD (copied from
volcano-sh/kthena into data/kthena_crds/) with `jsonschema`, and walked for keys the schema
does not define (the API server's strict field validation would reject those; plain JSON Schema
lets them through). The NetworkPolicy has no CRD: it is validated against a schema written
from the Kubernetes API reference (data/k8s/networkpolicy-v1.schema.json). The documented deployments are pinned byte for byte to the files
docs/kthena.md shows.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kthena_core.cli import main
from kthena_core.deploy import (
    DeployError,
    load_deploy_spec,
    plan_deployment,
    render_manifests,
    to_yaml,
)
from kthena_core.deploy.cli import header
from kthena_core.planner import Planner

ROOT = Path(__file__).resolve().parents[2]
CRDS = Path(__file__).parent / "data" / "kthena_crds"
DOCS = ROOT / "docs" / "deploy"
ATLAS = str(ROOT / "docs" / "examples" / "atlas-800t-a2.yaml")
CRD_FILES = {
    "ModelServing": "workload.serving.volcano.sh_modelservings.yaml",
    "ModelServer": "networking.serving.volcano.sh_modelservers.yaml",
    "ModelRoute": "networking.serving.volcano.sh_modelroutes.yaml",
}
POD_NETWORK = "10.244.0.0/16"
PD_CPU = {"name": "smollm2-pd", "image": "kthena-worker:test", "topology": "cpu-host",
          "num_nodes": 2, "mode": "pd", "pod_network": POD_NETWORK}
LLAMA_ATLAS = {"name": "llama-2-70b", "image": "kthena-worker:test", "model": "llama-2-70b",
               "checkpoint": "/mnt/models/Llama-2-70b-hf", "topology": ATLAS, "num_nodes": 2}


@functools.cache
def crd(kind: str) -> tuple[str, dict[str, Any]]:
    """(apiVersion, openAPIV3Schema) of the CRD's one served version."""
    with open(CRDS / CRD_FILES[kind], encoding="utf-8") as f:
        doc = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = doc["spec"]["versions"]
    return f"{doc['spec']['group']}/{version['name']}", version["schema"]["openAPIV3Schema"]


def unknown_keys(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Keys in ``value`` that ``schema`` does not declare (where it declares its keys)."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += unknown_keys(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            found += unknown_keys(item, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_keys(item, schema["items"], f"{path}[{i}]")
    return found


@functools.cache
def network_policy_schema() -> dict[str, Any]:
    with open(Path(__file__).parent / "data" / "k8s" / "networkpolicy-v1.schema.json",
              encoding="utf-8") as f:
        return json.load(f)


def check_against_crd(manifest: dict[str, Any]) -> None:
    """Valid under its CRD's schema (a NetworkPolicy: under the Kubernetes API's shape)."""
    if manifest["kind"] == "NetworkPolicy":
        schema = network_policy_schema()
        jsonschema.Draft7Validator(schema).validate(manifest)
        assert unknown_keys(manifest, schema) == []
        return
    api_version, schema = crd(manifest["kind"])
    assert manifest["apiVersion"] == api_version
    jsonschema.Draft7Validator(schema).validate(manifest)
    assert unknown_keys(manifest, schema) == []


def render(data: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """(deployment, its Kthena objects: ModelServing, ModelServer, ModelRoute)."""
    dep = plan_deployment(load_deploy_spec(data))
    policy, *kthena = render_manifests(dep)
    assert policy["kind"] == "NetworkPolicy"
    return dep, kthena


def pods(serving: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """role name -> its pod's one container."""
    return {r["name"]: r["entryTemplate"]["spec"]["containers"][0]
            for r in serving["spec"]["template"]["roles"]}


# ---- schema ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    PD_CPU,
    LLAMA_ATLAS,
    {**{k: v for k, v in PD_CPU.items() if k != "pod_network"}, "mode": "colocated",
     "name": "smollm2"},
    {**PD_CPU, "num_nodes": 3, "num_decode": 2, "port": 9000, "namespace": "serving"},
    {"name": "llama-3-8b-h100", "image": "kthena-worker:cuda", "model": "llama-3-8b",
     "checkpoint": "/models/llama-3-8b", "topology": "dgx-h100",
     "resources": {"cpu": 16, "memory": "96Gi"}},
    {**LLAMA_ATLAS, "device_resource": "huawei.com/ascend-1980"},
    {**{k: v for k, v in LLAMA_ATLAS.items() if k != "topology"}, "device": "ascend-910b3",
     "devices": 2, "num_nodes": 8},
], ids=["pd-cpu", "llama-2-70b-2x8-910b", "colocated-cpu", "pd-1p2d-port", "h100", "ascend-1980",
        "llama-2-70b-serving-groups"])
def test_every_manifest_validates_against_its_crd(data):
    for kv_events in (None, "redis://redis.kthena-system:6379"):
        extra = {"kv_events": kv_events} if kv_events else {}
        manifests = render_manifests(plan_deployment(load_deploy_spec({**data, **extra})))
        assert [m["kind"] for m in manifests] == ["NetworkPolicy", "ModelServing",
                                                  "ModelServer", "ModelRoute"]
        for manifest in manifests:
            check_against_crd(manifest)


def test_the_strict_walk_catches_a_misspelt_key():
    _, (serving, _, _) = render(PD_CPU)
    container = serving["spec"]["template"]["roles"][0]["entryTemplate"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    jsonschema.Draft7Validator(crd("ModelServing")[1]).validate(serving)  # lets it through
    assert unknown_keys(serving, crd("ModelServing")[1]) == [
        ".spec.template.roles[0].entryTemplate.spec.containers[0].readinesProbe"]


# ---- the plan's layout ----------------------------------------------------------------------------
def test_pd_on_cpu_runs_the_plan_split_as_prefill_and_decode_workers():
    dep, (serving, server, route) = render(PD_CPU)
    plan = dep.plan
    assert (plan.layout.tp, plan.layout.dp) == (1, 2)
    est = plan.chosen.estimate
    roles = {r["name"]: r["replicas"] for r in serving["spec"]["template"]["roles"]}
    assert roles == {"prefill": est.prefill_replicas, "decode": est.decode_replicas}
    assert serving["spec"]["replicas"] == 1 and sum(roles.values()) == plan.layout.dp
    for role, container in pods(serving).items():
        assert container["command"] == ["python3", "-m", "kthena_serve.pd.worker"]
        args = container["args"]
        assert args[args.index("--role") + 1] == role
        spec = json.loads(args[args.index("--spec") + 1])  # kthena_serve's ServeSpec JSON
        assert spec["engine"]["tp"] == 1 and spec["mode"] == "pd"
        assert "0.0.0.0" in args and "$(POD_IP)" in args
        assert not any(name.startswith(("nvidia.com", "huawei.com"))
                       for name in container["resources"]["limits"])
        secret = next(e for e in container["env"] if e["name"] == "KTHENA_PD_SECRET")
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "smollm2-pd-pd-secret",
                                                       "key": "secret"}
        assert {"name": "OMP_WAIT_POLICY", "value": "PASSIVE"} in container["env"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert spec["public_metrics"] is True  # kthena-router scrapes every pod
    group = server["spec"]["workloadSelector"]["pdGroup"]
    assert group["prefillLabels"] == {"modelserving.volcano.sh/role": "prefill"}
    assert group["decodeLabels"] == {"modelserving.volcano.sh/role": "decode"}
    assert server["spec"]["kvConnector"] == {"type": "mooncake"}
    assert route["spec"]["rules"][0]["targetModels"] == [{"modelServerName": "smollm2-pd"}]


def test_llama_70b_on_two_atlas_nodes_runs_the_plans_tp_and_replicas():
    dep, (serving, server, route) = render(LLAMA_ATLAS)
    plan = Planner().plan(dep.spec.model, dep.spec.topology, dep.spec.workload)
    assert dep.spec.topology.num_devices == 16 and dep.spec.topology.num_nodes == 2
    assert (dep.tp, dep.plan.layout.dp) == (plan.layout.tp, plan.layout.dp) == (8, 2)
    assert serving["spec"]["replicas"] == plan.layout.dp
    (container,) = pods(serving).values()
    args = container["args"]
    assert container["command"] == ["kthena"] and args[0] == "serve"
    assert args[args.index("--tp") + 1] == str(plan.layout.tp)
    assert args[args.index("--device") + 1] == "npu"
    assert container["resources"]["limits"]["huawei.com/Ascend910"] == "8"
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert {"name": "HCCL_CONNECT_TIMEOUT", "value": "600"} in container["env"]
    assert "--public-metrics" in args and "--prefill-hosts" not in args
    assert "pdGroup" not in server["spec"]["workloadSelector"]
    assert "kvConnector" not in server["spec"]
    assert route["spec"]["modelName"] == server["spec"]["model"] == "llama-2-70b"


def test_kv_pool_and_sequence_cap_are_what_the_plan_sized():
    dep, (serving, _, _) = render(LLAMA_ATLAS)
    args = pods(serving)["serve"]["args"]
    mem = dep.plan.chosen.memory
    assert args[args.index("--kv-cache-memory") + 1] == f"{-(-int(mem.kv_cache) // 2**20)}MiB"
    assert args[args.index("--max-num-seqs") + 1] == str(32 // dep.plan.layout.dp)


def test_decode_workers_take_kv_only_from_the_pod_network():
    _, (serving, _, _) = render(PD_CPU)
    args = {role: container["args"] for role, container in pods(serving).items()}
    decode = args["decode"]
    assert decode[decode.index("--prefill-hosts") + 1] == POD_NETWORK
    assert "--prefill-hosts" not in args["prefill"]  # only a decode worker pulls KV


def test_a_dual_stack_pod_network_is_a_list_and_is_normalised():
    _, (serving, _, _) = render({**PD_CPU, "pod_network": ["10.244.0.0/16", "FD00:10:244::/56"]})
    decode = pods(serving)["decode"]["args"]
    assert decode[decode.index("--prefill-hosts") + 1] == "10.244.0.0/16,fd00:10:244::/56"


def test_an_explicit_pd_split_must_cover_the_plans_instances():
    dep, (serving, _, _) = render({**PD_CPU, "num_nodes": 3, "num_prefill": 1})
    assert dep.plan.layout.dp == 3
    assert {r["name"]: r["replicas"] for r in serving["spec"]["template"]["roles"]} == {
        "prefill": 1, "decode": 2}


# ---- KV events, the API key, the NetworkPolicy ----------------------------------------------------
REDIS = "redis://redis.kthena-system:6379"
COLOCATED_CPU = {**{k: v for k, v in PD_CPU.items() if k != "pod_network"}, "mode": "colocated",
                 "name": "smollm2"}


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("data", [PD_CPU, COLOCATED_CPU], ids=["pd", "colocated"])
def test_kv_events_make_every_worker_publish_as_its_own_pod(data):
    _, (serving, _, _) = render({**data, "kv_events": REDIS})
    for container in pods(serving).values():
        args = container["args"]
        if "--spec" in args:  # a PD worker: its ServeSpec JSON
            events = json.loads(args[args.index("--spec") + 1])["kv_events"]
            got = (events["redis_url"], events["pod"])
        else:
            got = (args[args.index("--kv-events") + 1], args[args.index("--pod-name") + 1])
        # the owner name kthena-router's plugin compares: {pod name}.{namespace}
        assert got == (REDIS, "$(POD_NAME).$(POD_NAMESPACE)")
        env = env_of(container)
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["POD_NAMESPACE"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "metadata.namespace"}}
    _, (serving, _, _) = render(data)  # without the key, nothing of it
    for container in pods(serving).values():
        assert not {"--kv-events", "--pod-name"} & set(container["args"])
        assert "redis" not in " ".join(container["args"])
        assert "POD_NAMESPACE" not in env_of(container)


@pytest.mark.parametrize("data", [PD_CPU, COLOCATED_CPU, LLAMA_ATLAS],
                         ids=["pd", "colocated", "llama"])
def test_every_worker_takes_the_api_key_from_a_secret(data):
    dep, (serving, _, _) = render(data)
    for container in pods(serving).values():
        assert env_of(container)["KTHENA_API_KEY"]["valueFrom"] == {
            "secretKeyRef": {"name": f"{dep.spec.name}-api-key", "key": "api-key"}}
        assert not [a for a in container["args"] if "api-key" in a or "api_key" in a]
    assert (f"needs the Secret {dep.spec.name}-api-key (key: api-key) in namespace "
            f"{dep.spec.namespace}") in header(dep)


@pytest.mark.parametrize(("data", "has_siblings"), [
    (PD_CPU, True), (COLOCATED_CPU, False),
    ({**PD_CPU, "router_namespace": "gateway", "port": 9000, "namespace": "serving"}, True),
], ids=["pd", "colocated", "pd-elsewhere"])
def test_the_network_policy_admits_only_the_router_and_in_pd_the_sibling_pods(data,
                                                                             has_siblings):
    dep = plan_deployment(load_deploy_spec(data))
    policy, _, server, _ = render_manifests(dep)
    spec = policy["spec"]
    assert policy["metadata"] == {"name": dep.spec.name, "namespace": dep.spec.namespace}
    # the pods it guards are the pods kthena-router sends to
    assert spec["podSelector"] == {"matchLabels": server["spec"]["workloadSelector"][
        "matchLabels"]}
    assert spec["policyTypes"] == ["Ingress"]  # egress (Redis, the registry) is left open
    router, *rest = spec["ingress"]
    assert router == {"from": [{
        "namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": data.get("router_namespace", "kthena-system")}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kthena-router"}}}],
        "ports": [{"protocol": "TCP", "port": dep.spec.port}]}
    assert rest == ([{"from": [{"podSelector": spec["podSelector"]}]}] if has_siblings else [])
    check_against_crd(policy)


def test_the_network_policy_schema_catches_what_the_api_server_refuses():
    import copy

    policy = render_manifests(plan_deployment(load_deploy_spec(PD_CPU)))[0]
    check_against_crd(policy)
    breaks = [
        lambda p: p["spec"].pop("podSelector"),
        lambda p: p["spec"].update(policyType=p["spec"].pop("policyTypes")),
        lambda p: p["spec"]["ingress"][0]["from"][0].update(ipBlock={"cidr": "10.0.0.0/8"}),
        lambda p: p["spec"]["ingress"][0]["ports"][0].update(protocol="HTTP"),
        lambda p: p["spec"]["ingress"][1]["from"][0].pop("podSelector"),
    ]
    for change in breaks:
        broken = copy.deepcopy(policy)
        change(broken)
        with pytest.raises(jsonschema.ValidationError):
            check_against_crd(broken)


# ---- bad deploy.yaml ------------------------------------------------------------------------------
BAD = [
    ({"num_node": 2}, "num_node: unknown key (did you mean 'num_nodes'?)"),
    ({"mode": "disagg"}, "mode: got 'disagg'; allowed: colocated or pd"),
    ({"name": "SmolLM2"}, "name: got 'SmolLM2'; allowed: a DNS label"),
    ({"port": 70000}, "port: got 70000; allowed: a TCP port in 1..65535"),
    ({"num_nodes": 0}, "num_nodes: got 0; allowed: an integer >= 1"),
    ({"mode": "colocated", "num_prefill": 1}, "num_prefill: got 1; allowed: only with mode: pd"),
    ({"num_prefill": 1, "num_decode": 2},
     "num_prefill, num_decode: got prefill count 1; decode count 2, but no PD layout with these "
     "sizes fits 2 device(s) of 2xcpu-host (3 instances need at least 3 devices); allowed: "
     "sizes whose instances fit, or unset (the planner's choice)"),
    ({"num_decode": "two"}, "num_decode: got 'two'; allowed: an integer >= 1"),
    ({"device": "cpu-generic"}, "topology, device: give exactly one"),
    ({"topology": "auto"}, "topology: got 'auto'; allowed: a catalog node name or a topology file"),
    ({"topology": "atlas-800t-a9"}, "topology: unknown node or device 'atlas-800t-a9'"),
    ({"image": None}, "image: missing; give image: in the deploy config or --image"),
    ({"model": "llama-2-70b"}, "checkpoint: missing; model 'llama-2-70b' has no weights"),
    ({"checkpoint": "models/smollm2"}, "checkpoint: got 'models/smollm2'; allowed: 'default' or an absolute path"),
    ({"model": "gpt-5"}, "model: unknown model 'gpt-5'"),
    ({"workload": {"mode": "pd"}}, "workload.mode: got 'pd'; allowed: nothing: set mode at the top level"),
    ({"workload": {"concurency": 8}}, "workload.concurency: unknown key (did you mean 'concurrency'?)"),
    ({"workload": {"concurrency": 0}}, "workload.concurrency must be > 0, got 0"),
    ({"workload": {"dtype": "fp8"}}, "workload.dtype: got 'fp8'; allowed: bf16, fp16, fp32, int8"),
    ({"workload": {"kv_dtype": "fp8"}}, "workload.kv_dtype: got 'fp8'; allowed: 'bf16' (the "
                                        "compute dtype) or 'int8'"),
    ({"workload": {"dtype": "fp16"}}, "workload.kv_dtype: got 'bf16'; allowed: 'fp16'"),
    ({"resources": {"memory": "lots"}}, "resources.memory: got 'lots'; allowed: a Kubernetes quantity"),
    ({"resources": {"gpu": 1}}, "resources.gpu: unknown key"),
    ({"device_resource": "Ascend910"}, "device_resource: got 'Ascend910'; allowed: an extended resource name"),
    ({"pod_network": None}, "pod_network: missing; mode: pd needs the network the pods' IPs "
                            "come from, e.g. pod_network: 10.244.0.0/16"),
    ({"pod_network": "10.244.0.1"}, "pod_network: got '10.244.0.1'; allowed: a network in CIDR "
                                    "notation"),
    ({"pod_network": "10.244.0.0/33"}, "pod_network: got '10.244.0.0/33'; allowed: a network "
                                       "in CIDR notation"),
    ({"pod_network": "pods"}, "pod_network: got 'pods'; allowed: a network in CIDR notation"),
    ({"pod_network": 10}, "pod_network: got 10; allowed: a network in CIDR notation"),
    ({"pod_network": []}, "pod_network: got []; allowed: a network in CIDR notation"),
    ({"pod_network": "10.244.7.1/16"}, "pod_network: got '10.244.7.1/16'; allowed: a network "
                                       "address; this one has host bits set (did you mean "
                                       "'10.244.0.0/16'?)"),
    ({"pod_network": "0.0.0.0/0"}, "pod_network: got '0.0.0.0/0'; allowed: a network narrower "
                                   "than /0"),
    ({"pod_network": ["10.244.0.0/16", "fd00::1/64"]},
     "pod_network[1]: got 'fd00::1/64'; allowed: a network address; this one has host bits "
     "set (did you mean 'fd00::/64'?)"),
    ({"mode": "colocated", "pod_network": "10.244.0.0/16"},
     "pod_network: got '10.244.0.0/16'; allowed: only with mode: pd"),
    ({"pod_networks": "10.244.0.0/16"}, "pod_networks: unknown key (did you mean "
                                        "'pod_network'?)"),
    ({"kv_events": "http://redis:6379"}, "kv_events: 'http://redis:6379' is not a redis:// URL"),
    ({"kv_events": "redis://redis"}, "kv_events: 'redis://redis' needs a host and a port"),
    ({"kv_events": 6379}, "kv_events: 6379 is not a URL; write redis://HOST:PORT"),
    ({"kv_events": "redis://:hunter2@redis:6379"}, "kv_events: got 'redis://:***@redis:6379'; "
     "allowed: redis://HOST:PORT[/DB] without a user or password"),
    ({"kv_event": "redis://redis:6379"}, "kv_event: unknown key (did you mean 'kv_events'?)"),
    ({"router_namespace": "Kthena"}, "router_namespace: got 'Kthena'; allowed: a DNS label"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_a_bad_key_is_named_with_its_value_and_what_is_allowed(change, message):
    data = {k: v for k, v in {**PD_CPU, **change}.items() if v is not None}
    with pytest.raises(DeployError) as error:
        plan_deployment(load_deploy_spec(data))
    assert message in str(error.value)


LLAMA_2_PER_NODE = {**{k: v for k, v in LLAMA_ATLAS.items() if k != "topology"},
                    "device": "ascend-910b3", "devices": 2, "num_nodes": 8}


def group_pods(serving: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(entry container, worker container) of the one role."""
    (role,) = serving["spec"]["template"]["roles"]
    return (role["entryTemplate"]["spec"]["containers"][0],
            role["workerTemplate"]["spec"]["containers"][0])


def test_an_engine_larger_than_a_node_renders_one_serving_group_per_replica():
    """Llama-2-70B (128.5 GiB in bf16) on nodes of 2 x 57.6 GiB usable: an engine needs two
    nodes, and since TP2 x PP2 fits, no TP group spans them (TP4 would): each replica is an
    entry pod and a worker pod, scheduled together, both running kthena-run --serving-group
    with their share of the ranks."""
    dep, (serving, server, _) = render(LLAMA_2_PER_NODE)
    for manifest in render_manifests(dep):
        check_against_crd(manifest)
    assert (dep.tp, dep.pp, dep.num_nodes_per_engine, dep.num_ranks_per_pod) == (2, 2, 2, 2)
    tp4 = next(e for e in dep.plan.evaluations if e.layout.device_mapping == (4, 1, 4))
    assert tp4.reasons == ("its TP4 groups span 2 nodes, and a layout whose TP groups each "
                           "stay on one node fits (TP2 x PP2 x DP4)",)
    spec = serving["spec"]
    (role,) = spec["template"]["roles"]
    assert (spec["replicas"], role["replicas"], role["workerReplicas"]) == (dep.num_groups, 1, 1)
    assert spec["template"]["gangPolicy"] == {"minRoleReplicas": {"serve": 1}}
    assert spec["recoveryPolicy"] == "ServingGroupRecreate"
    entry, worker = group_pods(serving)
    assert entry["args"] == worker["args"] and entry["command"] == ["kthena-run"]
    args = entry["args"]
    assert args[:args.index("serve")] == [
        "--serving-group", "--nnodes", "2", "--nproc_per_node", "2", "--tp", "2", "--pp", "2",
        "--master_port", "29500", "--backend", "hccl", "--cpus", str(dep.cpu)]
    serve = args[args.index("serve") + 1:]  # kthena serve's flags, the same on every rank
    assert (serve[serve.index("--tp") + 1], serve[serve.index("--pp") + 1]) == ("2", "2")
    for container in (entry, worker):
        assert container["resources"]["limits"]["huawei.com/Ascend910"] == "2"
        env = env_of(container)
        assert env["HCCL_IF_IP"]["value"] == "$(POD_IP)"  # HCCL over nodes needs the NIC
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert not any(name.startswith("OMP_") for name in env)  # kthena-run sizes them
    # only the entry pod serves the API: the probes, the port and the router's pick are its
    assert {"ports", "startupProbe", "readinessProbe", "livenessProbe"} <= set(entry)
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(worker)
    assert server["spec"]["workloadSelector"]["matchLabels"] == {
        "modelserving.volcano.sh/name": "llama-2-70b", "modelserving.volcano.sh/entry": "true"}
    policy = render_manifests(dep)[0]
    assert {"from": [{"podSelector": policy["spec"]["podSelector"]}]} in policy["spec"]["ingress"]


def test_a_pipeline_over_two_cpu_nodes_renders_a_gloo_group():
    """The group kthena_serve/tests/test_serving_group.py runs in two network namespaces."""
    from kthena_core.config_plan import _PinnedPlanner
    from kthena_core.layout import Layout

    spec = load_deploy_spec({
        "name": "smollm2-pp", "image": "kthena-worker:test", "topology": "cpu-host",
        "num_nodes": 2, "resources": {"cpu": 1},
        "workload": {"dtype": "float32", "kv_dtype": "float32", "concurrency": 4}})
    dep = plan_deployment(spec, _PinnedPlanner(Layout(1, 2, 1)))
    for manifest in render_manifests(dep):
        check_against_crd(manifest)
    entry, worker = group_pods(render_manifests(dep)[1])
    args = entry["args"]
    assert args[args.index("--backend") + 1] == "gloo"
    assert args[args.index("--nproc_per_node") + 1] == "1" and args[args.index("--cpus") + 1] == "1"
    assert "HCCL_IF_IP" not in env_of(entry) and "POD_IP" not in env_of(worker)
    assert dep.summary().endswith("pods: 1 serve: entry + 1 worker pod(s), 1 rank(s) each")


def test_ranks_that_do_not_split_evenly_over_nodes_are_refused():
    from kthena_core.config_plan import _PinnedPlanner
    from kthena_core.layout import Layout

    spec = load_deploy_spec({**LLAMA_2_PER_NODE, "devices": 3, "num_nodes": 3})
    with pytest.raises(DeployError, match=r"TP8 x PP1: 8 ranks do not split evenly over the 3 "
                                          r"nodes of 3 device\(s\) it needs; allowed: nodes whose"):
        plan_deployment(spec, _PinnedPlanner(Layout(8, 1, 1)))


def test_a_pipeline_inside_one_pod_is_served_with_pp_and_sized_for_its_ranks():
    from kthena_core.config_plan import _PinnedPlanner
    from kthena_core.layout import Layout

    spec = load_deploy_spec({**LLAMA_ATLAS, "num_nodes": 1})
    dep = plan_deployment(spec, _PinnedPlanner(Layout(4, 2, 1)))
    _, serving, *_ = render_manifests(dep)
    check_against_crd(serving)
    args = pods(serving)["serve"]["args"]
    assert args[args.index("--tp") + 1] == "4" and args[args.index("--pp") + 1] == "2"
    assert dep.num_devices_per_pod == 8 and dep.cpu == 8 * 4
    # in PD mode the pinned layout is split into roles of its size, each pod one engine of it
    pd = plan_deployment(load_deploy_spec({**LLAMA_ATLAS, "num_nodes": 1, "mode": "pd",
                                           "pod_network": POD_NETWORK}),
                         _PinnedPlanner(Layout(2, 2, 2)))
    for container in pods(render_manifests(pd)[1]).values():
        engine = json.loads(container["args"][container["args"].index("--spec") + 1])["engine"]
        assert (engine["tp"], engine["pp"]) == (2, 2)
        assert container["resources"]["limits"]["huawei.com/Ascend910"] == "4"


def test_a_plan_with_sp_renders_kthena_serve_sp():
    from kthena_core.config_plan import _PinnedPlanner as _Pinned
    from kthena_core.layout import Layout

    spec = load_deploy_spec({**LLAMA_ATLAS, "num_nodes": 1})
    dep = plan_deployment(spec, _Pinned(Layout(8, 1, 1, 8)))
    _, serving, *_ = render_manifests(dep)
    check_against_crd(serving)
    args = pods(serving)["serve"]["args"]
    assert args[args.index("--tp") + 1] == "8" and args[args.index("--sp") + 1] == "8"
    plain = plan_deployment(spec, _Pinned(Layout(8, 1, 1)))
    assert "--sp" not in pods(render_manifests(plain)[1])["serve"]["args"]


def test_sp_with_pipeline_stages_or_pd_is_refused_by_name():
    from kthena_core.config_plan import _PinnedPlanner as _Pinned
    from kthena_core.layout import Layout, LayoutError

    spec = load_deploy_spec({**LLAMA_ATLAS, "num_nodes": 1})
    with pytest.raises(DeployError, match=r"with SP4 in mode colocated"):
        plan_deployment(spec, _Pinned(Layout(4, 2, 1, 4)))
    pd = load_deploy_spec({**LLAMA_ATLAS, "num_nodes": 1, "mode": "pd",
                           "pod_network": POD_NETWORK})
    with pytest.raises(LayoutError, match=r"TP4 x PP1 x DP2 \(SP4\) in mode pd: sp=4; allowed: "
                                          r"1 \(sequence parallelism is not wired in PD"):
        plan_deployment(pd, _Pinned(Layout(4, 1, 2, 4)))


def test_num_nodes_cannot_contradict_a_multi_node_topology_file(tmp_path):
    topo = tmp_path / "two.yaml"
    topo.write_text("nodes:\n  - {node: atlas-800t-a2, count: 2}\n", encoding="utf-8")
    with pytest.raises(DeployError, match=r"num_nodes: got 3; allowed: nothing, or 2"):
        load_deploy_spec({**LLAMA_ATLAS, "topology": str(topo), "num_nodes": 3})
    assert load_deploy_spec({**LLAMA_ATLAS, "topology": str(topo), "num_nodes": 2}
                            ).topology.num_devices == 16


# ---- the command ----------------------------------------------------------------------------------
def write_config(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def test_cli_prints_one_yaml_stream(tmp_path, capsys):
    assert main(["deploy", "k8s", "--config", write_config(tmp_path, PD_CPU),
                 "--image", "other:1"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "ModelServing", "ModelServer",
                                         "ModelRoute"]
    assert {c["image"] for c in pods(docs[1]).values()} == {"other:1"}


def test_cli_writes_one_file_per_object(tmp_path, capsys):
    out = tmp_path / "manifests"
    assert main(["deploy", "k8s", "--config", write_config(tmp_path, PD_CPU), "--out",
                 str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["modelroute.yaml", "modelserver.yaml",
                                                    "modelserving.yaml", "networkpolicy.yaml"]
    for path in out.iterdir():
        check_against_crd(yaml.safe_load(path.read_text(encoding="utf-8")))


def test_cli_error_names_the_key_without_a_traceback(tmp_path, capsys):
    assert main(["deploy", "k8s", "--config", write_config(tmp_path, {**PD_CPU, "mode": "x"})]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kthena deploy: error: mode: got 'x'") and "Traceback" not in err


def test_relative_topology_resolves_against_the_config_folder():
    spec = load_deploy_spec(DOCS / "llama-2-70b-atlas.yaml")
    assert spec.topology.num_devices == 16


# ---- the documented deployments -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["smollm2-pd", "llama-2-70b-atlas", "llama-2-70b-groups"])
def test_docs_show_what_the_command_renders_today(name):
    dep = plan_deployment(load_deploy_spec(DOCS / f"{name}.yaml"))
    rendered = (DOCS / f"{name}.rendered.yaml").read_text(encoding="utf-8")
    assert rendered == to_yaml(render_manifests(dep), header(dep)), (
        f"regenerate: kthena deploy k8s --config docs/deploy/{name}.yaml > "
        f"docs/deploy/{name}.rendered.yaml")
    for manifest in yaml.safe_load_all(rendered):
        check_against_crd(manifest)
