"""From a `DeploySpec` to a `Deployment`: the planner's chosen layout, cut into worker pods.

``plan_deployment`` runs `Planner.plan` on the spec's model, topology and workload and keeps
its layout as is. Colocated: one worker pod (or serving group) per replica (``dp`` of them),
each running one engine over ``tp x pp`` devices (``kthena serve --tp --pp``: its ranks are
processes of the pod; where the plan moved the pipeline's split points off equal stages,
``--pipeline-split-points`` too). PD: a ``prefill`` and a ``decode`` role, each with the plan's
own layout and count for it (deploy.yaml's ``pd`` section and ``num_prefill`` / ``num_decode``
pin what they name; the planner chooses the rest), each worker one engine of its role's
``tp x pp`` ranks.

A plan with sequence parallelism (sp = tp, pp = 1, colocated; weighed when deploy.yaml says
``sequence_parallel: true``) runs with ``kthena serve --sp``. The engine features deploy.yaml
asks for become their flags: int8 weights (``workload.dtype: int8``: ``--dtype bfloat16
--quantization int8``), an int8 KV pool (``workload.kv_dtype: int8``: ``--kv-cache-dtype
int8``), ``--tp-overlap``, ``--kv-offload`` and ``--enable-expert-parallel`` (the engine's EP:
a MoE model's experts whole over each worker's TP ranks).
An engine larger than a node (a colocated replica, or one instance of a PD role) runs as one
serving group of ``n`` pods, the fewest nodes that hold its ``tp x pp`` ranks in equal shares:
an entry pod and ``n - 1`` workers, each running ``kthena-run --serving-group`` (k8s.py).

It refuses a plan the serving engine cannot run, saying which key to change: sequence
parallelism with pipeline stages (not wired), wide expert parallelism (EP groups of instances,
which the engine does not run), tp x pp ranks that do not split evenly over the nodes an
engine needs (torchrun starts as many on each), and the features the engine refuses with the
plan's layout: ``tp_overlap`` at tp = 1 (in PD: a role at tp = 1) or with int8 weights,
``kv_offload`` with pp > 1, or tp > 1 off the cpu or over several pods, ``expert_parallel`` for a
dense model or a tp that is 1 or does not divide the experts (in PD: any role's).

Per pod of a role it sizes (unless deploy.yaml's ``resources`` says otherwise):

* memory = the plan's per-device total (weights + KV + activations + reserve) x the pod's
  ranks (tp x pp, or its share of them in a serving group) on a CPU; on an accelerator, the
  worker's share of the weights (they pass through host memory while loading) plus the plan's
  runtime reserve; plus the KV offload tiers' host memory; rounded up to whole GiB.
* cpu = 4 cores per rank of the pod (the engine's host threads; on a CPU, its compute threads).
* the KV pool (``--kv-cache-memory``) and the running-sequence cap (``--max-num-seqs``) the
  plan sized the memory for (PD: the role's own).
"""

from __future__ import annotations

import math

import attrs

from kthena_core.config import ConfigError
from kthena_core.config_plan import _PinnedPlanner
from kthena_core.cost_model import CostParams, Memory
from kthena_core.deploy.spec import DeployError, DeploySpec
from kthena_core.dtypes import ENGINE_DTYPES, torch_name
from kthena_core.layout import Layout
from kthena_core.planner import NoFeasiblePlanError, Plan, Planner

__all__ = ["Deployment", "Role", "deploy_planner", "plan_deployment"]

GiB = 1024**3
CPUS_PER_RANK = 4
ENGINE_DEVICE = {"cpu": "cpu", "gpu": "cuda", "npu": "npu"}
INT8 = "int8"  # weight-only int8 (--quantization), or the int8 KV pool (--kv-cache-dtype)
INT8_COMPUTE_DTYPE = "bf16"  # what a worker with int8 weights computes in (--dtype)


@attrs.frozen
class Role:
    """One ModelServing role (``serve`` colocated, ``prefill`` / ``decode`` in PD) and the
    engine each of its instances runs.

    Attributes:
        num_replicas: instances of the role in one ServingGroup (1 colocated: the group is the
            replica).
        tp, pp: one instance's engine.
        split_points: where its stages 1.. start when they are not equal stages, else None.
        num_nodes: pods (nodes) one instance spans: 1, or a serving group of an entry pod and
            ``num_nodes - 1`` worker pods.
        cpu, memory: per pod.
        kv_cache_bytes: KV pool per rank (the plan's per-device KV for the role).
        max_num_seqs: sequences one instance runs at once (what the plan sized KV for).
    """

    name: str
    num_replicas: int
    tp: int = 1
    pp: int = 1
    split_points: tuple[int, ...] | None = None
    num_nodes: int = 1
    cpu: int = CPUS_PER_RANK
    memory: str = "1Gi"
    kv_cache_bytes: int = 0
    max_num_seqs: int = 1

    @property
    def num_ranks_per_pod(self) -> int:
        """Ranks of an instance in each of its pods (all of them in a one-pod instance)."""
        return self.tp * self.pp // self.num_nodes

    @property
    def is_group(self) -> bool:
        """Whether an instance spans pods (a serving group)."""
        return self.num_nodes > 1


@attrs.frozen
class Deployment:
    """Everything the manifests say, decided: the plan, the roles and each pod's size.

    Attributes:
        num_groups: ModelServing replicas (ServingGroups): ``dp`` colocated, 1 in PD mode.
        roles: the roles of one group, each with its engine and pod size.

    The engine and pod figures read by name (``tp``, ``cpu``, ``num_nodes_per_engine`` ...)
    are the ``serve`` role's, in PD mode the decode role's: each role's are in ``roles``.
    """

    spec: DeploySpec
    plan: Plan
    device_kind: str
    device_name: str
    num_groups: int
    roles: tuple[Role, ...]

    @property
    def main_role(self) -> Role:
        """The ``serve`` role, or in PD mode the decode role."""
        return self.roles[-1]

    tp = property(lambda self: self.main_role.tp)
    pp = property(lambda self: self.main_role.pp)
    cpu = property(lambda self: self.main_role.cpu)
    memory = property(lambda self: self.main_role.memory)
    kv_cache_bytes = property(lambda self: self.main_role.kv_cache_bytes)
    max_num_seqs = property(lambda self: self.main_role.max_num_seqs)
    num_nodes_per_engine = property(lambda self: self.main_role.num_nodes)
    num_ranks_per_pod = property(lambda self: self.main_role.num_ranks_per_pod)

    @property
    def has_groups(self) -> bool:
        """Whether any role's instances span pods (serving groups)."""
        return any(r.is_group for r in self.roles)

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

    def devices_per_pod(self, role: Role) -> int:
        """Accelerators a pod of `role` requests (its ranks); 0 on a CPU."""
        return 0 if self.device_kind == "cpu" else role.num_ranks_per_pod

    @property
    def num_devices_per_pod(self) -> int:
        return self.devices_per_pod(self.main_role)

    def summary(self) -> str:
        """One line: model, nodes, mode, layout and roles."""
        lay = self.plan.chosen.layout
        roles = " + ".join(_role_text(r) for r in self.roles)
        groups = f"{self.num_groups} x ({roles})" if self.num_groups > 1 else roles
        return (f"{self.spec.model.name} on {self.plan.topology_name}, mode {self.spec.mode}: "
                f"{lay.label} on {self.plan.world_size} "
                f"{self.device_name} device(s); pods: {groups}")


def _role_text(role: Role) -> str:
    """``1 prefill`` or ``1 serve: entry + 1 worker pod(s), 2 rank(s) each``."""
    text = f"{role.num_replicas} {role.name}"
    if role.is_group:
        text += (f": entry + {role.num_nodes - 1} worker pod(s), {role.num_ranks_per_pod} "
                 "rank(s) each")
    return text


def compute_dtype(dtype: str) -> str:
    """The dtype a worker computes in for the workload's weight dtype: the same, or bf16 under
    weight-only int8."""
    return INT8_COMPUTE_DTYPE if dtype == INT8 else dtype


def deploy_planner(spec: DeploySpec, params: CostParams | None = None) -> Planner:
    """The planner a deploy file plans with: the cost factors ``params``, sequence parallelism
    weighed where the engine runs it (pp = 1) when ``sequence_parallel`` asks, no EP, in PD
    mode the roles' pinned sizes."""
    return _PinnedPlanner(None, params, allow_sp=spec.sequence_parallel, pd_roles=spec.pd_roles)


def plan_deployment(spec: DeploySpec, planner: Planner | None = None) -> Deployment:
    """Plan ``spec`` (with `deploy_planner` unless given a planner) and cut the chosen layout
    into worker pods.

    Raises:
        DeployError: the plan needs something the serving engine cannot run, or the PD roles
            deploy.yaml pins fit nowhere; the message names the deploy.yaml key to change.
        NoFeasiblePlanError: nothing fits the topology (its message says why).
    """
    plan = _plan(spec, planner or deploy_planner(spec))
    kind, name = _device(spec, plan)
    _check_engine_can_run(spec, plan)
    _check_features(spec, plan)
    if plan.pd_layout is not None:
        roles = tuple(_role(spec, plan, kind, r.name, r.layout, r.memory, r.split_points,
                            r.max_num_seqs) for r in plan.roles)
        num_groups = 1
    else:
        lay = plan.layout
        seqs = math.ceil(spec.workload.concurrency / lay.dp)
        assert plan.chosen.memory is not None  # a chosen plan is feasible: it has a memory
        roles = (_role(spec, plan, kind, "serve", lay, plan.chosen.memory,
                       plan.pipeline_split_points, seqs),)
        num_groups = lay.dp
    return Deployment(spec=spec, plan=plan, device_kind=kind, device_name=name,
                      num_groups=num_groups, roles=roles)


def _plan(spec: DeploySpec, planner: Planner) -> Plan:
    """The plan; pinned PD roles that fit nowhere are refused by their keys."""
    try:
        return planner.plan(spec.model, spec.topology, spec.workload)
    except DeployError:
        raise
    except ConfigError as error:  # a pinned role the planner refuses (pd.decode.tp ...)
        raise DeployError(str(error)) from None
    except NoFeasiblePlanError as error:
        if not spec.pd_roles.is_set:
            raise
        keys = ", ".join(_pinned_keys(spec))
        got = "; ".join(f"{role} " + ", ".join(f"{k} {v}" for k, v in sizes.items())
                        for role, sizes in spec.pd_roles.to_dict().items())
        least = sum(pin.count or 1 for pin in (spec.pd_roles.prefill, spec.pd_roles.decode))
        why = (f"{least} instances need at least {least} devices" if "no candidate" in str(error)
               else str(error))
        raise DeployError(f"{keys}: got {got}, but no PD layout with these sizes fits "
                          f"{spec.topology.num_devices} device(s) of "
                          f"{spec.topology.name or spec.topology.source} ({why}); allowed: "
                          "sizes whose instances fit, or unset (the planner's choice)") from None


def _pinned_keys(spec: DeploySpec) -> list[str]:
    """The deploy.yaml keys that pinned the PD roles (``num_prefill`` or ``pd.prefill.count``
    ...), for an error to name."""
    keys = []
    for role in ("prefill", "decode"):
        for key, value in attrs.asdict(spec.pd_roles.pin(role)).items():
            counted = getattr(spec, f"num_{role}")
            if value is not None:
                keys.append(f"num_{role}" if key == "count" and counted == value
                            else f"pd.{role}.{key}")
    return keys


def _role(spec: DeploySpec, plan: Plan, kind: str, name: str, layout: Layout, mem: Memory,
          split_points: tuple[int, ...] | None, max_num_seqs: int) -> Role:
    """A role's engine and pod size from the plan's layout and memory for it."""
    nodes = _nodes_per_engine(spec, name, layout)
    ranks = layout.tp * layout.pp // nodes  # per pod
    host_bytes = mem.total * ranks if kind == "cpu" else mem.weights * ranks + mem.reserve
    host_bytes += spec.kv_offload_bytes
    replicas = layout.dp if plan.pd_layout is not None else 1
    return Role(name, replicas, layout.tp, layout.pp, split_points, nodes,
                spec.cpu or CPUS_PER_RANK * ranks,
                spec.memory or f"{math.ceil(host_bytes / GiB)}Gi", int(mem.kv_cache),
                max_num_seqs)


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
    if lay.sp > 1 and lay.sp_refusal() is not None:
        raise _topology_error(spec, f"gets the plan TP{lay.tp} x PP{lay.pp} x DP{lay.dp} with "
                                    f"SP{lay.sp} in mode {spec.mode}",
                              "nodes where the plan needs no sequence parallelism with "
                              "pipeline stages (the engine runs SP over the TP group of a "
                              "pp=1 engine only): larger devices or more of them per node")


def _engine_tps(plan: Plan) -> dict[str, int]:
    """Each role's tp (``serve`` colocated)."""
    if plan.pd_layout is None:
        return {"serve": plan.layout.tp}
    return {name: lay.tp for name, lay in plan.pd_layout.roles}


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
    _check_tp_overlap(spec, plan)
    _check_expert_parallel(spec, plan)
    if spec.kv_offload is not None and _offload_refused(spec, plan):
        raise DeployError(f"kv_offload: got {spec.kv_offload!r}, but the plan gives each worker "
                          f"TP{lay.tp} x PP{lay.pp} on {_device(spec, plan)[0]}; allowed: pp=1, "
                          "and tp > 1 only with a worker's ranks as CPU processes of one pod "
                          "(kthena serve offloads at --tp > 1 from rank 0, which maps every "
                          "rank's pool in /dev/shm; it refuses --kv-offload with --pp > 1)")


def _offload_refused(spec: DeploySpec, plan: Plan) -> bool:
    """Whether kthena serve refuses ``--kv-offload`` with the plan's layout: pp > 1, or tp > 1
    off the cpu or over several pods (ranks a launcher starts)."""
    lay = plan.chosen.layout
    if lay.pp > 1:
        return True
    return lay.tp > 1 and (_device(spec, plan)[0] != "cpu"
                           or _nodes_per_engine(spec, "serve", lay) > 1)


def _check_tp_overlap(spec: DeploySpec, plan: Plan) -> None:
    """``tp_overlap`` fuses each row-parallel matmul with its TP all-reduce: every worker
    needs a TP group (in PD, both roles) and dense weights."""
    if not spec.tp_overlap:
        return
    tps = _engine_tps(plan)
    single = [name for name, tp in tps.items() if tp == 1]
    if single:
        whom = ("each worker" if len(single) == len(tps) else
                " and ".join(f"the {name} workers" for name in single))
        why = (f"the plan gives {whom} TP1, and TP overlap fuses each row-parallel matmul "
               "with its all-reduce over the TP group")
    elif spec.workload.dtype == INT8:
        why = "workload.dtype is int8, and the fused matmul + collective ops take dense weights"
    else:
        return
    raise DeployError(f"tp_overlap: got true, but {why}; allowed: false here")


def _check_expert_parallel(spec: DeploySpec, plan: Plan) -> None:
    """``expert_parallel`` runs the engine's EP: each TP rank holds experts / tp whole experts,
    so the model must have routed experts and every worker a tp > 1 that divides them."""
    if not spec.expert_parallel:
        return
    model = spec.model
    for name, tp in _engine_tps(plan).items():
        whose = "each worker" if name == "serve" else f"the {name} workers"
        if not model.is_moe:
            why = f"{model.name} has no routed experts"
        elif tp == 1:
            why = (f"the plan gives {whose} TP1, and the engine splits the experts over the TP "
                   "ranks")
        elif model.num_experts % tp:
            why = (f"the plan's TP{tp}{'' if name == 'serve' else f' for the {name} workers'} "
                   f"does not divide {model.name}'s {model.num_experts} experts (each TP rank "
                   "holds as many whole experts)")
        else:
            continue
        raise DeployError(f"expert_parallel: got true, but {why}; allowed: false here")


def _nodes_per_engine(spec: DeploySpec, role: str, layout: Layout) -> int:
    """Pods one instance of `role` spans: 1 where its tp x pp ranks fit a node, else the
    fewest nodes that hold an equal share of them each (torchrun starts as many ranks on
    every node).

    Raises:
        DeployError: the ranks do not split evenly over that many nodes.
    """
    ranks = layout.tp * layout.pp
    per_node = min(len(spec.topology.devices_on_node(n)) for n in range(spec.topology.num_nodes))
    nodes = math.ceil(ranks / per_node)
    if nodes == 1:
        return 1
    if ranks % nodes:
        whose = "" if role == "serve" else f"'s {role} role"
        raise _topology_error(spec, f"gets the plan{whose} TP{layout.tp} x PP{layout.pp}: "
                                    f"{ranks} ranks do not split evenly over the {nodes} nodes "
                                    f"of {per_node} device(s) it needs",
                              "nodes whose device count lets an engine's tp x pp ranks split "
                              "into equal shares (kthena-run starts as many ranks on each)")
    return nodes


def _topology_error(spec: DeploySpec, problem: str, allowed: str) -> DeployError:
    return DeployError(f"topology: {spec.topology.name or spec.topology.source} {problem}; "
                       f"allowed: {allowed}")
