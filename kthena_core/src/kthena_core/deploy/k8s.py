"""Kubernetes manifests for Kthena (volcano-sh/kthena) from a `Deployment`: pure dicts, then YAML.

Three objects, named after deploy.yaml's ``name``::

    ModelServing  (workload.serving.volcano.sh)    the worker pods: a ``serve`` role (colocated,
                                                   one ServingGroup per replica) or ``prefill`` +
                                                   ``decode`` roles (PD, one ServingGroup)
    ModelServer   (networking.serving.volcano.sh)  the pods kthena-router sends to; in PD mode
                                                   a ``pdGroup`` pairing the roles by group and
                                                   a ``kvConnector``
    ModelRoute    (networking.serving.volcano.sh)  the model name clients send -> that server
    NetworkPolicy (networking.k8s.io)              who may reach the worker pods: kthena-router
                                                   on the worker port; in PD mode also the
                                                   deployment's own pods (the KV handoff)

The containers run this SDK's real entry points (the image is deploy/Dockerfile's):

* colocated: ``kthena serve`` (the OpenAI API, ``/health``, ``/metrics``).
* an engine larger than a node (a role with ``Role.num_nodes`` > 1): one serving group per
  instance, an entry pod plus ``workerReplicas`` worker pods (``gangPolicy``: scheduled
  together), each running ``kthena-run --serving-group ... serve <the kthena serve flags>`` (a PD
  role: ``... pd-worker <the PD worker's flags>``). kthena-run maps the ENTRY_ADDRESS /
  WORKER_INDEX / GROUP_SIZE Kthena injects to torchrun's master address, node rank and node
  count; rank 0 in the entry pod serves the API, so only entry pods have the port and the
  probes, and the ModelServer selects them by ``modelserving.volcano.sh/entry``.
* PD: ``python3 -m kthena_serve.pd.worker --role prefill|decode --spec JSON`` (``/health`` and
  the PD worker's routes on one port; ``--spec`` is kthena_serve's ``ServeSpec`` JSON:
  ``worker_spec``, whose engine carries the role's own ``tp``, ``pp`` and split points), its
  secret from the Kubernetes Secret ``<name>-pd-secret`` (key ``secret``) in the environment
  variable the PD auth reads, never on the command line; KV moves between pods over the
  Mooncake transport, advertised at the pod's IP. A decode worker takes KV only from hosts in
  deploy.yaml's ``pod_network`` (``--prefill-hosts``).

Every worker takes the API key from the Kubernetes Secret ``<name>-api-key`` (key ``api-key``)
in ``KTHENA_API_KEY`` (kthena-router forwards its client's ``Authorization`` header). With
deploy.yaml's ``kv_events``, every worker publishes its KV cache's router chunks to that Redis
(``--kv-events``; a PD worker's spec ``kv_events``) as its own pod,
``$(POD_NAME).$(POD_NAMESPACE)`` from the downward API: the name kthena-router's kvcache-aware
plugin looks for.

Every pod serves /metrics openly (``--public-metrics``; a PD worker's spec ``public_metrics``): kthena-router scrapes each pod's ``/metrics`` (vLLM's
``vllm:*`` names) without credentials, so that one path is open, as in vLLM; the OpenAI routes
keep the API key (if any) and the PD routes the deployment secret.

Every worker binds 0.0.0.0: a pod is its own network host, and the kubelet's probes and the
router reach it at the pod's IP. Probes use ``/health`` (200 when the engine runs, 503 when it
is dead or draining; no authentication): a startup probe covers model loading, then readiness
and liveness take over.
"""

from __future__ import annotations

import json
import math
from typing import Any

import yaml

from kthena_core.config import load_config
from kthena_core.deploy.plan import Deployment, GiB, Role
from kthena_core.launcher import rank_environment

__all__ = ["render_manifests", "render_model_route", "render_model_server",
           "render_model_serving", "render_network_policy", "to_yaml"]

SERVING_API = "workload.serving.volcano.sh/v1alpha1"
NETWORKING_API = "networking.serving.volcano.sh/v1alpha1"
NAME_LABEL = "modelserving.volcano.sh/name"
ROLE_LABEL = "modelserving.volcano.sh/role"
GROUP_KEY = "modelserving.volcano.sh/group-name"
ENTRY_LABEL = "modelserving.volcano.sh/entry"  # "true" on a role's entry pod
MASTER_PORT = 29500  # torchrun's rendezvous in a serving group's entry pod
# Must equal kthena_serve.cluster.auth.SECRET_ENV (a higher layer; kthena_serve's tests compare
# them).
PD_SECRET_ENV = "KTHENA_PD_SECRET"
# Must equal what kthena serve and the PD worker read (kthena_serve's tests compare them).
API_KEY_ENV = "KTHENA_API_KEY"
API_KEY_SECRET_KEY = "api-key"
# The pod owner name kthena-router's kvcache-aware plugin compares: {pod name}.{namespace}.
KV_EVENTS_OWNER = "$(POD_NAME).$(POD_NAMESPACE)"
# kthena-router's pods (its Helm chart's deployment) and the label every namespace carries.
ROUTER_POD_LABELS = {"app.kubernetes.io/component": "kthena-router"}
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
NETWORK_POLICY_API = "networking.k8s.io/v1"
HEALTH_PATH = "/health"
PUBLIC_METRICS_FLAG = "--public-metrics"  # kthena-router scrapes /metrics without credentials
KV_CONNECTOR = "mooncake"  # the PD transport the workers are told to use across pods
PD_WORKER_SCRIPT = "pd-worker"  # kthena-run's name for python -m kthena_serve.pd.worker
DEVICE_RESOURCE = {"npu": "huawei.com/Ascend910", "gpu": "nvidia.com/gpu"}
_BACKEND = {"cpu": "gloo", "gpu": "nccl", "npu": "hccl"}
STARTUP_BUDGET_S = 1800  # model loading; a 70B checkpoint from local disk takes minutes
GRACE_PERIOD_S = 60  # > kthena serve's default --shutdown-timeout (30 s): drains finish


def pd_secret_name(dep: Deployment) -> str:
    return f"{dep.spec.name}-pd-secret"


def api_key_secret_name(dep: Deployment) -> str:
    return f"{dep.spec.name}-api-key"


def render_manifests(dep: Deployment) -> list[dict[str, Any]]:
    """NetworkPolicy, ModelServing, ModelServer and ModelRoute, in the order to apply them
    (the policy first: no pod runs unguarded)."""
    return [render_network_policy(dep), render_model_serving(dep), render_model_server(dep),
            render_model_route(dep)]


def _metadata(dep: Deployment) -> dict[str, Any]:
    return {"name": dep.spec.name, "namespace": dep.spec.namespace}


# ---- ModelServing --------------------------------------------------------------------------------
def render_model_serving(dep: Deployment) -> dict[str, Any]:
    """The workers: one role per worker kind, ``workerReplicas: 0`` (one pod per instance),
    or for an engine larger than a node an entry pod and ``workerReplicas`` worker pods that
    are scheduled together (``gangPolicy``)."""
    pd, group = dep.spec.mode == "pd", dep.has_groups
    template: dict[str, Any] = {}
    if group:  # all of an engine's pods or none: a partial group would wait for its ranks
        template["gangPolicy"] = {"minRoleReplicas": {r.name: r.num_replicas for r in dep.roles}}
    template["roles"] = [_role(dep, role) for role in dep.roles]
    return {
        "apiVersion": SERVING_API, "kind": "ModelServing", "metadata": _metadata(dep),
        "spec": {
            "schedulerName": "volcano",
            "replicas": dep.num_groups,
            # PD: a prefill and a decode worker pair up inside one group; a multi-node engine's
            # ranks cannot rejoin a running one. Either way, recreate the group together.
            "recoveryPolicy": "ServingGroupRecreate" if pd or group else "RoleRecreate",
            "template": template,
        },
    }


def _role(dep: Deployment, role: Role) -> dict[str, Any]:
    workers = role.num_nodes - 1
    out = {"name": role.name, "replicas": role.num_replicas, "workerReplicas": workers,
           "entryTemplate": {"spec": _pod_spec(dep, role)}}
    if workers:
        out["workerTemplate"] = {"spec": _pod_spec(dep, role, is_entry=False)}
    return out


def _pod_spec(dep: Deployment, role: Role, is_entry: bool = True) -> dict[str, Any]:
    """A worker pod; in a serving group, ``is_entry`` False is a pod that runs ranks only (no
    API, so no port and no probes: the entry pod's /health reports a dead rank)."""
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    # The KV pool of a PD decode worker lives in POSIX shared memory (on a CPU one per rank of
    # the pod); the container default /dev/shm (64 MiB) would not hold it.
    pools = 0 if role.name != "decode" else role.num_ranks_per_pod if dep.device_kind == "cpu" else 1
    shm_bytes = pools * role.kv_cache_bytes + GiB
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {
        "medium": "Memory", "sizeLimit": f"{math.ceil(shm_bytes / GiB)}Gi"}}]
    if dep.spec.checkpoint != "default":
        mounts.append({"name": "model", "mountPath": dep.spec.checkpoint, "readOnly": True})
        volumes.append({"name": "model", "hostPath": {"path": dep.spec.checkpoint,
                                                      "type": "Directory"}})
    api: dict[str, Any] = {
        "ports": [{"name": "http", "containerPort": dep.spec.port, "protocol": "TCP"}]}
    container = {
        "name": "worker", "image": dep.spec.image, **_command(dep, role),
        "env": _env(dep, role), **(api if is_entry else {}),
        "resources": {"requests": _resources(dep, role), "limits": _resources(dep, role)},
        **(_probes(dep) if is_entry else {}), "volumeMounts": mounts,
    }
    return {"containers": [container], "volumes": volumes,
            "terminationGracePeriodSeconds": GRACE_PERIOD_S}


def engine_fields(dep: Deployment, role: Role) -> dict[str, Any]:
    """The engine settings a worker of `role` gets (``EngineConfig`` field names): its role's
    ``tp`` (and ``pp`` and ``pipeline_split_points`` when it pipelines), KV pool and sequence
    cap; int8 weights, the int8 KV pool and expert parallelism only when deploy.yaml asks for
    them."""
    fields: dict[str, Any] = {
        "model": dep.spec.checkpoint, "device": dep.engine_device, "dtype": dep.engine_dtype,
        "tp": role.tp, "kv_cache_memory": _mib(role.kv_cache_bytes),
        "max_num_seqs": role.max_num_seqs}
    if role.pp > 1:
        fields["pp"] = role.pp
    if role.split_points is not None:
        fields["pipeline_split_points"] = list(role.split_points)
    if dep.quantization is not None:
        fields["quantization"] = dep.quantization
    if dep.kv_cache_dtype is not None:
        fields["kv_cache_dtype"] = dep.kv_cache_dtype
    if dep.spec.expert_parallel:
        fields["expert_parallel"] = True
    return fields


def _feature_args(dep: Deployment) -> list[str]:
    """The ``kthena serve`` flags of the features deploy.yaml asks for (the plan's SP too)."""
    args = []
    if dep.quantization is not None:
        args += ["--quantization", dep.quantization]
    if dep.kv_cache_dtype is not None:
        args += ["--kv-cache-dtype", dep.kv_cache_dtype]
    if dep.plan.layout.sp > 1:
        args += ["--sp", str(dep.plan.layout.sp)]
    if dep.spec.tp_overlap:
        args.append("--tp-overlap")
    if dep.spec.expert_parallel:
        args.append("--enable-expert-parallel")
    if dep.spec.kv_offload is not None:
        args += ["--kv-offload", kv_offload_arg(dep.spec.kv_offload)]
    return args


def _offload_keys(value: str) -> set[str]:
    return {part.partition("=")[0] for part in value.split(",")}


def kv_offload_arg(value: str) -> str:
    """deploy.yaml's ``kv_offload``, with ``listen=$(POD_IP)`` where it names a Mooncake Store
    and no listen address: the store's other clients read this pod's segment at that address
    (kthena serve listens on 127.0.0.1 otherwise, which no other pod reaches)."""
    keys = _offload_keys(value)
    return value + ",listen=$(POD_IP)" if "store" in keys and "listen" not in keys else value


def _uses_store(dep: Deployment) -> bool:
    """Whether the workers lend memory to a Mooncake Store, whose peers read it from the pod."""
    return dep.spec.kv_offload is not None and "store" in _offload_keys(dep.spec.kv_offload)


def _split_args(role: Role) -> list[str]:
    """``--pipeline-split-points`` where the plan's stages are not equal (its cost model moved
    them: the LM head weighs on the last stage)."""
    points = role.split_points
    return [] if points is None else ["--pipeline-split-points", ",".join(map(str, points))]


def _mib(num_bytes: int) -> str:
    return f"{math.ceil(num_bytes / 2**20)}MiB"


def _command(dep: Deployment, role: Role) -> dict[str, list[str]]:
    port = str(dep.spec.port)
    if role.name == "serve":
        engine = engine_fields(dep, role)
        serve = {"command": ["kthena"], "args": [
            "serve", "--model", engine["model"], "--served-model-name", dep.spec.served_model_name,
            "--host", "0.0.0.0", "--port", port, "--device", engine["device"],
            "--dtype", engine["dtype"], "--tp", str(engine["tp"]),
            *(["--pp", str(role.pp)] if role.pp > 1 else []),
            *_split_args(role), *_feature_args(dep),
            "--kv-cache-memory", engine["kv_cache_memory"],
            "--max-num-seqs", str(engine["max_num_seqs"]), PUBLIC_METRICS_FLAG,
            *_kv_events_args(dep)]}
        return serve if not role.is_group else _group_command(dep, role, serve["args"][1:])
    compact = {"separators": (",", ":"), "sort_keys": True}
    # Prefill pod IPs are unknown until the pods run: a decode worker allows the pod network.
    allow = ["--prefill-hosts", ",".join(dep.spec.pod_network)] if role.name == "decode" else []
    args = ["--role", role.name, "--name", "$(POD_NAME)", "--host", "0.0.0.0", "--port", port,
            "--spec", json.dumps(worker_spec(dep, role), **compact), "--mooncake-host",
            "$(POD_IP)", *allow]
    if role.is_group:
        return _group_command(dep, role, args, script=PD_WORKER_SCRIPT)
    return {"command": ["python3", "-m", "kthena_serve.pd.worker"], "args": args}


def worker_spec(dep: Deployment, role: Role) -> dict[str, Any]:
    """What a PD worker pod of `role` serves, as the JSON of kthena_serve's ``ServeSpec`` (its
    field names): the engine (the role's own tp and pp; ``ranks_from: env`` when an instance
    spans pods, whose ranks kthena-run starts), the PD transport across pods, the served
    model name, /metrics open to kthena-router, and KV events under the pod's own name
    (Kubernetes fills in $(POD_NAME))."""
    kv_events = None if dep.spec.kv_events is None else {
        "redis_url": dep.spec.kv_events, "pod": KV_EVENTS_OWNER,
        "model": dep.spec.served_model_name}
    engine = engine_fields(dep, role)
    if dep.spec.tp_overlap:
        engine["tp_overlap"] = True
    if role.is_group:
        engine["ranks_from"] = "env"
    return {"engine": engine, "mode": "pd", "pd": {"transport": KV_CONNECTOR},
            "served_model_name": dep.spec.served_model_name, "public_metrics": True,
            "kv_events": kv_events}


def _group_command(dep: Deployment, role: Role, script_args: list[str],
                   script: str = "serve") -> dict[str, list[str]]:
    """Every pod of a serving group: ``kthena-run --serving-group`` starting its share of the
    instance's ranks, each running `script` (``serve``: ``kthena serve``; ``pd-worker``: the PD
    worker) with the same flags (rank 0, in the entry pod, serves the API). kthena-run takes
    the master address, node rank and node count from Kthena's ENTRY_ADDRESS, WORKER_INDEX and
    GROUP_SIZE, and refuses a GROUP_SIZE other than ``--nnodes``."""
    return {"command": ["kthena-run"], "args": [
        "--serving-group", "--nnodes", str(role.num_nodes),
        "--nproc_per_node", str(role.num_ranks_per_pod), "--tp", str(role.tp),
        "--pp", str(role.pp), "--master_port", str(MASTER_PORT),
        "--backend", _BACKEND[dep.device_kind], "--cpus", str(role.cpu), script, *script_args]}


def _kv_events_args(dep: Deployment) -> list[str]:
    """``--kv-events URL --pod-name $(POD_NAME).$(POD_NAMESPACE)``, or nothing without
    deploy.yaml's ``kv_events``."""
    if dep.spec.kv_events is None:
        return []
    return ["--kv-events", dep.spec.kv_events, "--pod-name", KV_EVENTS_OWNER]


def _field_env(name: str, path: str) -> dict[str, Any]:
    """An environment variable from the downward API (``metadata.name``, ``status.podIP``)."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _env(dep: Deployment, role: Role) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    is_pd, has_events = role.name != "serve", dep.spec.kv_events is not None
    if is_pd or has_events:
        env.append(_field_env("POD_NAME", "metadata.name"))
    if has_events:
        env.append(_field_env("POD_NAMESPACE", "metadata.namespace"))
    group = role.is_group
    if is_pd or (group and dep.device_kind == "npu") or _uses_store(dep):
        env.append(_field_env("POD_IP", "status.podIP"))
    if is_pd:
        env.append(_secret_env(PD_SECRET_ENV, pd_secret_name(dep), "secret"))
    env.append(_secret_env(API_KEY_ENV, api_key_secret_name(dep), API_KEY_SECRET_KEY))
    rank = _rank_environment(dep, role)
    if group:  # kthena-run sizes the OpenMP pools from --cpus
        rank = {k: v for k, v in rank.items() if not k.startswith("OMP_")}
        if dep.device_kind == "npu":  # HCCL over nodes: this pod's address (kthena-run checks it)
            rank["HCCL_IF_IP"] = "$(POD_IP)"
    return env + [{"name": k, "value": v} for k, v in sorted(rank.items())]


def _rank_environment(dep: Deployment, role: Role) -> dict[str, str]:
    """What kthena-run would export for one worker's ranks: OpenMP threads and wait policy
    (CPU), HCCL's connect timeout (Ascend). KTHENA_DIST_BACKEND is left out: the worker
    takes its layout and backend from its flags."""
    ranks = role.num_ranks_per_pod
    cfg = load_config({"cluster": {"world_size": ranks},
                       "parallelism": {"tensor_parallel_size": ranks}})
    env = rank_environment(cfg, _BACKEND[dep.device_kind], ranks, num_cpus=role.cpu)
    env = {k: v for k, v in env.items() if not k.startswith("KTHENA_")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads
    return env


def _resources(dep: Deployment, role: Role) -> dict[str, str]:
    """Requests = limits: Guaranteed QoS, so the kubelet's static CPU manager policy (where
    the nodes use it) gives the pod whole cores, which the worker sizes its threads to."""
    res = {"cpu": str(role.cpu), "memory": role.memory}
    if dep.devices_per_pod(role):
        name = dep.spec.device_resource or DEVICE_RESOURCE[dep.device_kind]
        res[name] = str(dep.devices_per_pod(role))
    return res


def _probes(dep: Deployment) -> dict[str, Any]:
    get = {"httpGet": {"path": HEALTH_PATH, "port": dep.spec.port}}
    return {
        "startupProbe": {**get, "periodSeconds": 10, "failureThreshold": STARTUP_BUDGET_S // 10},
        "readinessProbe": {**get, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**get, "periodSeconds": 10, "failureThreshold": 6},
    }


# ---- NetworkPolicy -------------------------------------------------------------------------------
def render_network_policy(dep: Deployment) -> dict[str, Any]:
    """Ingress to the worker pods: kthena-router's pods (in ``router_namespace``) on the worker
    port; in PD mode, in a serving group and with a Mooncake Store below the KV offload also
    the deployment's own pods, on every port (the PD routes and Mooncake's transfer ports;
    torchrun's rendezvous and the collectives' ports, picked at run time; the store segments
    the other workers read). Egress (Redis, the registry, the store's master) is not
    restricted."""
    workers = {"matchLabels": {NAME_LABEL: dep.spec.name}}
    router = {"namespaceSelector": {"matchLabels": {
                  NAMESPACE_NAME_LABEL: dep.spec.router_namespace}},
              "podSelector": {"matchLabels": dict(ROUTER_POD_LABELS)}}
    rules: list[dict[str, Any]] = [
        {"from": [router], "ports": [{"protocol": "TCP", "port": dep.spec.port}]}]
    if dep.spec.mode == "pd" or dep.has_groups or _uses_store(dep):
        rules.append({"from": [{"podSelector": workers}]})
    return {"apiVersion": NETWORK_POLICY_API, "kind": "NetworkPolicy",
            "metadata": _metadata(dep),
            "spec": {"podSelector": workers, "policyTypes": ["Ingress"], "ingress": rules}}


# ---- ModelServer and ModelRoute ------------------------------------------------------------------
def render_model_server(dep: Deployment) -> dict[str, Any]:
    """What kthena-router routes to: the ModelServing's pods on the worker port."""
    selector: dict[str, Any] = {"matchLabels": {NAME_LABEL: dep.spec.name}}
    if dep.has_groups:  # only entry pods serve the API
        selector["matchLabels"][ENTRY_LABEL] = "true"
    spec: dict[str, Any] = {
        "model": dep.spec.served_model_name,
        # The CRD offers vLLM or SGLang; the workers follow vLLM's conventions where they
        # follow one (OpenAI API, /health).
        "inferenceEngine": "vLLM",
        "workloadSelector": selector,
        "workloadPort": {"port": dep.spec.port, "protocol": "http"},
    }
    if dep.spec.mode == "pd":
        selector["pdGroup"] = {"groupKey": GROUP_KEY,
                               "prefillLabels": {ROLE_LABEL: "prefill"},
                               "decodeLabels": {ROLE_LABEL: "decode"}}
        spec["kvConnector"] = {"type": KV_CONNECTOR}
    return {"apiVersion": NETWORKING_API, "kind": "ModelServer", "metadata": _metadata(dep),
            "spec": spec}


def render_model_route(dep: Deployment) -> dict[str, Any]:
    """Requests for the served model name go to this deployment's ModelServer."""
    return {"apiVersion": NETWORKING_API, "kind": "ModelRoute", "metadata": _metadata(dep),
            "spec": {"modelName": dep.spec.served_model_name,
                     "rules": [{"name": "default",
                                "targetModels": [{"modelServerName": dep.spec.name}]}]}}


# ---- YAML ----------------------------------------------------------------------------------------
class _Dumper(yaml.SafeDumper):
    """Writes a repeated sub-object in full each time: no ``&id001`` anchors for readers."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(manifests: list[dict[str, Any]], header: str = "") -> str:
    """Multi-document YAML (``---`` between objects), keys in the order rendered."""
    docs = [yaml.dump(m, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
            for m in manifests]
    lines = "".join(f"# {line}\n" for line in header.splitlines())
    return lines + "---\n".join(docs)
