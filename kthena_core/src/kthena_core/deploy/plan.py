"""From a `DeploySpec` to a `Deployment`: the planner's chosen layout, cut into worker pods.

``plan_deployment`` runs `Planner.plan` on the spec's model, topology and workload and keeps
its layout as is: one worker pod per replica (``dp`` of them), each running one engine over
``tp x pp`` devices (``kthena serve --tp --pp``: its ranks are processes of the pod; where the
plan moved the pipeline's split points off equal stages, ``--pipeline-split-points`` too). In PD mode the replicas are split into prefill and decode workers as the plan
splits them (or as ``num_prefill`` / ``num_decode`` ask, as long as they add up to ``dp``).

A plan with sequence parallelism (sp = tp, pp = 1, colocated; weighed when deploy.yaml says
``sequence_parallel: true``) runs with ``kthena serve --sp``. The engine features deploy.yaml
asks for become their flags: int8 weights (``workload.dtype: int8``: ``--dtype bfloat16
--quantization int8``), an int8 KV pool (``workload.kv_dtype: int8``: ``--kv-cache-dtype
int8``), ``--tp-overlap``, ``--kv-offload`` and ``--enable-expert-parallel`` (the engine's EP:
a MoE model's experts whole over each worker's TP ranks).
An engine larger than a node runs as one serving group of ``n`` pods, the fewest nodes that
hold its ``tp x pp`` ranks in equal shares: an entry pod and ``n - 1`` workers, each running
``kthena-run --serving-group`` (k8s.py).

It refuses a plan the serving engine cannot run, saying which key to change: sequence
parallelism with pipeline stages or in PD mode (not wired), wide expert parallelism (EP groups
of instances, which the engine does not run), tp x pp ranks that do not split evenly over the
nodes an engine needs (torchrun starts as many on each), in PD mode ``tp`` or ``pp > 1`` (a PD
decode worker holds one whole KV pool, which a prefill worker writes; ``kthena serve --mode
pd`` refuses them for the same reason), and the features the engine refuses with the plan's layout: ``tp_overlap`` at tp = 1
or with int8 weights, ``kv_offload`` with tp or pp > 1 (each rank would hold its own pool),
``expert_parallel`` for a dense model or a tp that is 1 or does not divide the experts.

Per pod it sizes (unless deploy.yaml's ``resources`` says otherwise):

* memory = the plan's per-device total (weights + KV + activations + reserve) x the pod's
  ranks (tp x pp, or its share of them in a serving group) on a CPU; on an accelerator, the
  worker's share of the weights (they pass through host memory while loading) plus the plan's
  runtime reserve; plus the KV offload tiers' host memory; rounded up to whole GiB.
* cpu = 4 cores per rank of the pod (the engine's host threads; on a CPU, its compute threads).
* the KV pool (``--kv-cache-memory``) and the running-sequence cap (``--max-num-seqs``) the
  plan sized the memory for.
"""

from __future__ import annotations

import math

import attrs

from kthena_core.config_plan import _PinnedPlanner
from kthena_core.cost_model import CostParams
from kthena_core.deploy.spec import DeployError, DeploySpec
from kthena_core.dtypes import ENGINE_DTYPES, torch_name
from kthena_core.planner import Plan, Planner, decode_replicas

__all__ = ["Deployment", "Role", "deploy_planner", "plan_deployment"]

GiB = 1024**3
CPUS_PER_RANK = 4
ENGINE_DEVICE = {"cpu": "cpu", "gpu": "cuda", "npu": "npu"}
INT8 = "int8"  # weight-only int8 (--quantization), or the int8 KV pool (--kv-cache-dtype)
INT8_COMPUTE_DTYPE = "bf16"  # what a worker with int8 weights computes in (--dtype)


@attrs.frozen
class Role:
    """One ModelServing role: ``prefill``, ``decode`` or ``serve`` (colocated), and its pods."""

    name: str
    num_replicas: int


@attrs.frozen
class Deployment:
    """Everything the manifests say, decided: the plan, the roles and each pod's size.

    Attributes:
        num_groups: ModelServing replicas (ServingGroups): ``dp`` colocated, 1 in PD mode.
        roles: the roles of one group.
        num_devices_per_pod: accelerators per worker pod (the plan's tp x pp); 0 on a CPU.
        kv_cache_bytes: KV pool per rank (the plan's per-device KV).
        max_num_seqs: sequences one worker runs at once (what the plan sized KV for).
        num_nodes_per_engine: pods (nodes) one engine's tp x pp ranks span: 1, or a serving
            group of an entry pod and ``num_nodes_per_engine - 1`` worker pods.
    """

    spec: DeploySpec
    plan: Plan
    device_kind: str
    device_name: str
    num_groups: int
    roles: tuple[Role, ...]
    cpu: int
    memory: str
    kv_cache_bytes: int
    max_num_seqs: int
    num_nodes_per_engine: int = 1

    @property
    def tp(self) -> int:
        return self.plan.layout.tp

    @property
    def pp(self) -> int:
        return self.plan.layout.pp

    @property
    def engine_device(self) -> str:
        return ENGINE_DEVICE[self.device_kind]

    @property
    def engine_dtype(self) -> str:
        return torch_name(compute_dtype(self.spec.workload.dtype))

    @property
    def quantization(self) -> str | None:
        """``"int8"`` for int8 weights (``--quantization int8``), else None."""
        return INT8 if self.spec.workload.dtype == INT8 else None

    @property
    def kv_cache_dtype(self) -> str | None:
        """``"int8"`` for the engine's int8 KV pool (``--kv-cache-dtype int8``), else None
        (KV in the compute dtype)."""
        return INT8 if self.spec.workload.kv_dtype == INT8 else None

    @property
    def num_ranks_per_pod(self) -> int:
        """Ranks of the engine in each of its pods (all of them in a one-pod engine)."""
        return self.tp * self.pp // self.num_nodes_per_engine

    @property
    def num_devices_per_pod(self) -> int:
        return 0 if self.device_kind == "cpu" else self.num_ranks_per_pod

    def summary(self) -> str:
        """One line: model, nodes, mode, layout and roles."""
        lay = self.plan.chosen.layout
        roles = " + ".join(f"{r.num_replicas} {r.name}" for r in self.roles)
        if self.num_nodes_per_engine > 1:
            roles += (f": entry + {self.num_nodes_per_engine - 1} worker pod(s), "
                      f"{self.num_ranks_per_pod} rank(s) each")
        groups = f"{self.num_groups} x ({roles})" if self.num_groups > 1 else roles
        return (f"{self.spec.model.name} on {self.plan.topology_name}, mode {self.spec.mode}: "
                f"{lay.label} on {self.plan.world_size} "
                f"{self.device_name} device(s); pods: {groups}")


def compute_dtype(dtype: str) -> str:
    """The dtype a worker computes in for the workload's weight dtype: the same, or bf16 under
    weight-only int8."""
    return INT8_COMPUTE_DTYPE if dtype == INT8 else dtype


def deploy_planner(spec: DeploySpec, params: CostParams | None = None) -> Planner:
    """The planner a deploy file plans with: the cost factors ``params``, sequence parallelism
    weighed where the engine runs it (pp = 1) when ``sequence_parallel`` asks, no EP."""
    return _PinnedPlanner(None, params, allow_sp=spec.sequence_parallel)


def plan_deployment(spec: DeploySpec, planner: Planner | None = None) -> Deployment:
    """Plan ``spec`` (with `deploy_planner` unless given a planner) and cut the chosen layout
    into worker pods.

    Raises:
        DeployError: the plan needs something the serving engine cannot run; the message
            names the deploy.yaml key to change.
        NoFeasiblePlanError: nothing fits the topology (its message says why).
    """
    plan = (planner or deploy_planner(spec)).plan(spec.model, spec.topology, spec.workload)
    kind, name = _device(spec, plan)
    _check_engine_can_run(spec, plan)
    _check_features(spec, plan)
    nodes = _nodes_per_engine(spec, plan)
    if spec.mode == "pd":
        num_groups, roles = 1, _pd_roles(spec, plan)
    else:
        num_groups, roles = plan.layout.dp, (Role("serve", 1),)
    mem = plan.chosen.memory
    assert mem is not None  # a chosen plan is feasible, so it has a memory estimate
    ranks = plan.layout.tp * plan.layout.pp // nodes  # per pod
    host_bytes = mem.total * ranks if kind == "cpu" else mem.weights * ranks + mem.reserve
    host_bytes += spec.kv_offload_bytes
    return Deployment(
        spec=spec, plan=plan, device_kind=kind, device_name=name, num_groups=num_groups,
        roles=roles, cpu=spec.cpu or CPUS_PER_RANK * ranks,
        memory=spec.memory or f"{math.ceil(host_bytes / GiB)}Gi",
        kv_cache_bytes=int(mem.kv_cache),
        max_num_seqs=math.ceil(spec.workload.concurrency / decode_replicas(spec.workload,
                                                                             plan.chosen.layout)),
        num_nodes_per_engine=nodes)


def _device(spec: DeploySpec, plan: Plan) -> tuple[str, str]:
    devices = spec.topology.devices
    used = {(devices[i].spec.kind, devices[i].spec.name) for i in plan.device_ids}
    if len(used) > 1:
        raise _topology_error(spec, "mixes device types " + ", ".join(sorted(n for _, n in used)),
                              "one device type (a pod template requests one kind of device)")
    return used.pop()


def _check_engine_can_run(spec: DeploySpec, plan: Plan) -> None:
    lay = plan.chosen.layout
    if lay.ep > 1:
        raise DeployError(f"expert_parallel: the plan {lay.label} groups {lay.ep} instances "
                          "for wide expert parallelism, which the serving engine does not run "
                          "(its --enable-expert-parallel, deploy.yaml's expert_parallel, splits "
                          "the experts over one instance's TP ranks); allowed: a plan without "
                          "wide EP")
    if lay.sp > 1 and (lay.sp_refusal() is not None or spec.mode == "pd"):
        raise _topology_error(spec, f"gets the plan TP{lay.tp} x PP{lay.pp} x DP{lay.dp} with "
                                    f"SP{lay.sp} in mode {spec.mode}",
                              "nodes where the plan needs no sequence parallelism with "
                              "pipeline stages or PD workers (the engine runs SP over the TP "
                              "group of a colocated pp=1 engine only): larger devices or more "
                              "of them per node")
    if spec.mode == "pd" and (lay.tp > 1 or lay.pp > 1):
        raise DeployError(
            f"mode: got 'pd', but the plan gives each worker TP{lay.tp} x PP{lay.pp} "
            f"({spec.model.name} on {plan.topology_name}); allowed: 'pd' only where the plan "
            "runs each worker at tp=1 and pp=1 (a PD decode worker holds one whole KV pool, "
            "which its prefill worker writes; `kthena serve --mode pd` refuses --tp and --pp > "
            "1 too). Use mode: colocated for this model and topology.")


def _check_features(spec: DeploySpec, plan: Plan) -> None:
    """The dtypes and engine features deploy.yaml asks for, against what the engine runs with
    the plan's layout (its own refusals, said here by deploy.yaml key)."""
    wl, lay = spec.workload, plan.chosen.layout
    if wl.dtype not in (*ENGINE_DTYPES, INT8):
        raise DeployError(f"workload.dtype: got {wl.dtype!r}; allowed: "
                          f"{', '.join(ENGINE_DTYPES)}, {INT8} (the dtypes the serving engine "
                          f"runs; {INT8}: weight-only int8, computed in {INT8_COMPUTE_DTYPE})")
    compute = compute_dtype(wl.dtype)
    if wl.kv_dtype not in (compute, INT8):
        raise DeployError(f"workload.kv_dtype: got {wl.kv_dtype!r}; allowed: {compute!r} (the "
                          f"compute dtype) or {INT8!r} (the engine's int8 KV pool, "
                          "--kv-cache-dtype int8)")
    if spec.tp_overlap and (lay.tp == 1 or wl.dtype == INT8):
        why = (f"the plan gives each worker TP{lay.tp}, and TP overlap fuses each row-parallel "
               "matmul with its all-reduce over the TP group" if lay.tp == 1 else
               "workload.dtype is int8, and the fused matmul + collective ops take dense weights")
        raise DeployError(f"tp_overlap: got true, but {why}; allowed: false here")
    _check_expert_parallel(spec, plan)
    if spec.kv_offload is not None and lay.tp * lay.pp > 1:
        raise DeployError(f"kv_offload: got {spec.kv_offload!r}, but the plan gives each worker "
                          f"TP{lay.tp} x PP{lay.pp}; allowed: only where the plan runs each "
                          "worker at tp=1 and pp=1 (each rank would have its own pool; kthena "
                          "serve refuses --kv-offload with --tp or --pp > 1)")


def _check_expert_parallel(spec: DeploySpec, plan: Plan) -> None:
    """``expert_parallel`` runs the engine's EP: each TP rank holds experts / tp whole experts,
    so the model must have routed experts and the plan a tp > 1 that divides them."""
    if not spec.expert_parallel:
        return
    model, tp = spec.model, plan.chosen.layout.tp
    if not model.is_moe:
        why = f"{model.name} has no routed experts"
    elif tp == 1:
        why = ("the plan gives each worker TP1, and the engine splits the experts over the TP "
               "ranks")
    elif model.num_experts % tp:
        why = (f"the plan's TP{tp} does not divide {model.name}'s {model.num_experts} experts "
               "(each TP rank holds as many whole experts)")
    else:
        return
    raise DeployError(f"expert_parallel: got true, but {why}; allowed: false here")


def _nodes_per_engine(spec: DeploySpec, plan: Plan) -> int:
    """Pods one engine spans: 1 where its tp x pp ranks fit a node, else the fewest nodes
    that hold an equal share of them each (torchrun starts as many ranks on every node).

    Raises:
        DeployError: the ranks do not split evenly over that many nodes, or a multi-node
            engine in PD mode.
    """
    lay = plan.chosen.layout
    ranks = lay.tp * lay.pp
    per_node = min(len(spec.topology.devices_on_node(n)) for n in range(spec.topology.num_nodes))
    nodes = math.ceil(ranks / per_node)
    if nodes == 1:
        return 1
    if ranks % nodes:
        raise _topology_error(spec, f"gets the plan TP{lay.tp} x PP{lay.pp}: {ranks} ranks do "
                                    f"not split evenly over the {nodes} nodes of "
                                    f"{per_node} device(s) it needs",
                              "nodes whose device count lets an engine's tp x pp ranks split "
                              "into equal shares (kthena-run starts as many ranks on each)")
    return nodes


def _topology_error(spec: DeploySpec, problem: str, allowed: str) -> DeployError:
    return DeployError(f"topology: {spec.topology.name or spec.topology.source} {problem}; "
                       f"allowed: {allowed}")


def _pd_roles(spec: DeploySpec, plan: Plan) -> tuple[Role, ...]:
    est = plan.chosen.estimate
    assert est is not None
    dp = plan.layout.dp
    prefill, decode = spec.num_prefill, spec.num_decode
    if prefill is None and decode is None:
        prefill, decode = est.prefill_replicas, est.decode_replicas
    elif prefill is None:
        prefill = dp - decode  # type: ignore[operator]
    elif decode is None:
        decode = dp - prefill
    if prefill < 1 or decode < 1 or prefill + decode != dp:
        raise DeployError(
            f"num_prefill, num_decode: got {spec.num_prefill or 'plan'} + "
            f"{spec.num_decode or 'plan'}; allowed: counts >= 1 that add up to the plan's "
            f"{dp} instances (TP{plan.layout.tp} x DP{dp}; the plan splits them "
            f"{est.prefill_replicas} + {est.decode_replicas})")
    return (Role("prefill", prefill), Role("decode", decode))
