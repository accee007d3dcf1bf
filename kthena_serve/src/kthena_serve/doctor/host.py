"""``kthena doctor``'s host checks: this machine against the plan a config asks for.

Pure logic over what it is given, so a test stages each fault: the loaded config and its plan
(or the planner's refusal), what topology discovery found here, and the environment.

    devices          the plan's devices on this node vs what discovery (and *_VISIBLE_DEVICES)
                     shows
    collectives_env  HCCL / NCCL / gloo variables, with the launcher's own checks (hccl_env)
    host_probe       the measured figures a plan on this host is scored with: where they come
                     from (measured, cached, KTHENA_HOST_PROBE), their age and the load they were
                     taken under (warn: provisional, taken under load)
    native_kernels   mooncake_ops' native CPU build loaded (CPU plans)
    structured_output  xgrammar imports (JSON mode, json_schema, structured_outputs and
                     required or named tool calls need it); the import's own error if not
    kv_fit           the planned KV (and the pool the config sets) vs device or host memory
    calibration      the age and machine of the bench JSON the plan is calibrated from
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from kthena_core.config import KthenaConfig
from kthena_core.discovery import Discovery, NotPresent
from kthena_core.discovery.describe import format_bytes
from kthena_core.discovery.host_probe import HostFigures
from kthena_core.hccl_env import HcclEnvError, HcclSettings, check_hccl
from kthena_core.planner import Plan
from kthena_core.topology import Topology
from kthena_serve.doctor.check import Check, DoctorError
from kthena_serve.engine.sizes import parse_bytes

__all__ = ["HostFacts", "calibration_check", "host_checks", "load_host_facts"]

_BACKENDS = {"npu": "hccl", "gpu": "nccl", "cpu": "gloo"}
_VISIBLE = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "gpu": "CUDA_VISIBLE_DEVICES"}
CALIBRATION_MAX_AGE_DAYS = 30


@attrs.frozen
class HostFacts:
    """What the host checks read.

    Attributes:
        config: the loaded ``--config`` (None: no config given; plan checks skip).
        topology: the config's topology, resolved.
        plan: the planner's plan for it, or None when it refused (``plan_error`` says why).
        plan_error: the planner's refusal (``NoFeasiblePlanError``'s message).
        discovery: what each probe found on this machine.
        environ: the environment the engine's ranks would start with.
        probe: the host probe plans on this host use (None: none could be taken, no torch).
    """

    config: KthenaConfig | None
    topology: Topology | None
    plan: Plan | None
    plan_error: str | None
    discovery: Discovery
    environ: Mapping[str, str]
    probe: HostFigures | None = None


def load_host_facts(config_path: str | None, environ: Mapping[str, str],
                    discover: Callable[[], Discovery] | None = None) -> HostFacts:
    """Load and plan ``config_path`` (as ``kthena serve --config`` does) and discover this host.

    Raises:
        DoctorError: the config does not load, or its topology cannot be resolved.
    """
    from kthena_core.cache_dir import default_cache_dir, host_probe_file
    from kthena_core.config_plan import plan_config_file
    from kthena_core.discovery import discover_all, measure_host
    from kthena_core.discovery.host_probe import HostProbeError
    from kthena_core.planner import NoFeasiblePlanError

    discovery = (discover or discover_all)()
    try:  # what `kthena plan` on this host plans with (cached, or measured now)
        probe = measure_host(default_cache_dir(), probe_file=host_probe_file())
    except HostProbeError as error:
        raise DoctorError(str(error)) from None
    if config_path is None:
        return HostFacts(None, None, None, None, discovery, environ, probe)
    if not os.path.isfile(config_path):
        raise DoctorError(f"--config {config_path}: no such file")
    try:
        cfg, topology, plan = plan_config_file(config_path, cache_dir=default_cache_dir(),
                                               probe_file=host_probe_file())
    except NoFeasiblePlanError as error:
        cfg, topology = _config_and_topology(config_path)
        return HostFacts(cfg, topology, None, str(error), discovery, environ, probe)
    except ValueError as error:  # ConfigError, TopologyError: bad input
        raise DoctorError(f"--config {config_path}: {error}") from None
    return HostFacts(cfg, topology, plan, None, discovery, environ, probe)


def _config_and_topology(path: str) -> tuple[KthenaConfig, Topology]:
    """The config and topology of a config the planner refused (both loaded fine before)."""
    from kthena_core.cache_dir import default_cache_dir, host_probe_file
    from kthena_core.config_plan import load_config_file

    return load_config_file(path, cache_dir=default_cache_dir(), probe_file=host_probe_file())


def host_checks(facts: HostFacts) -> list[Check]:
    """Every host check, in checklist order (see the module docs)."""
    return [devices_check(facts), collectives_check(facts), host_probe_check(facts),
            native_kernels_check(facts), structured_output_check(), kv_fit_check(facts)]


def _kind(facts: HostFacts) -> str | None:
    """The device kind the config's topology plans for (None without a config)."""
    return None if facts.topology is None else facts.topology.devices[0].spec.kind


def _no_plan(name: str, facts: HostFacts) -> Check | None:
    if facts.config is None:
        return Check(name, "skip", "no --config: nothing to compare this host with")
    if facts.plan is None:
        return Check(name, "skip", "the planner found no plan for the config (see kv_fit)")
    return None


def devices_check(facts: HostFacts) -> Check:
    """The plan's devices on this node (``cluster.node_rank``) against the ones visible here."""
    skipped = _no_plan("devices", facts)
    if skipped is not None:
        return skipped
    assert facts.plan is not None and facts.topology is not None and facts.config is not None
    kind, node = _kind(facts), facts.config.cluster.node_rank
    needed = [i for i in facts.plan.device_ids if facts.topology.devices[i].node == node]
    if kind == "cpu":
        cpu = facts.discovery.cpu
        return Check("devices", "ok", f"a CPU plan: {len(needed)} CPU device(s) on node {node}; "
                     f"this host: {cpu.num_devices} CPU device(s), "
                     f"{format_bytes(_host_memory(cpu))} usable memory")
    found = facts.discovery.npu if kind == "npu" else facts.discovery.gpu
    seen = 0 if isinstance(found, NotPresent) else found.num_devices
    why = f" ({found.reason})" if isinstance(found, NotPresent) else ""
    visible_var = _VISIBLE[kind]  # type: ignore[index]
    mask = facts.environ.get(visible_var)
    if mask is not None and seen:
        seen = min(seen, len([d for d in mask.split(",") if d.strip()]))
        why = f" ({visible_var}={mask})"
    value = (f"the plan runs {len(needed)} {kind} device(s) on node {node} "
             f"({facts.plan.layout}); this host shows {seen}{why}")
    if seen < len(needed):
        return Check("devices", "fail", value,
                     f"run on a node with {len(needed)} visible {kind} devices (check the "
                     f"driver with `kthena topo`, and {visible_var}), or plan for this host "
                     "with cluster.topology: auto")
    return Check("devices", "ok", value)


def collectives_check(facts: HostFacts) -> Check:
    """The collective backend's variables, as ``kthena-run`` checks them before a launch."""
    skipped = _no_plan("collectives_env", facts)
    if skipped is not None:
        return skipped
    assert facts.plan is not None and facts.config is not None
    backend = _BACKENDS[_kind(facts) or "cpu"]
    nnodes = max(facts.config.cluster.nnodes, facts.topology.num_nodes if facts.topology else 1)
    env = facts.environ
    if backend == "hccl":
        try:
            settings = HcclSettings.from_environ(env)
            check_hccl(settings, nnodes=nnodes, world_size=facts.plan.world_size)
        except HcclEnvError as error:
            return Check("collectives_env", "fail", f"hccl over {nnodes} node(s): {error}",
                         "export the variable on every node (or pass kthena-run's --hccl-* "
                         "flags), then run kthena doctor again")
        shown = {k: env[k] for k in ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "RANK_TABLE_FILE")
                 if env.get(k)}
        return Check("collectives_env", "ok", f"hccl over {nnodes} node(s): "
                     f"{_pairs(shown) or 'no NIC variables needed on one node'}; "
                     f"HCCL_CONNECT_TIMEOUT={settings.connect_timeout_s}")
    ifname = {"nccl": "NCCL_SOCKET_IFNAME", "gloo": "GLOO_SOCKET_IFNAME"}[backend]
    if nnodes == 1:
        return Check("collectives_env", "ok", f"{backend} on one node: no NIC variable needed")
    if env.get(ifname):
        return Check("collectives_env", "ok", f"{backend} over {nnodes} nodes: "
                     f"{ifname}={env[ifname]}")
    if backend == "gloo":
        return Check("collectives_env", "ok", f"gloo over {nnodes} nodes: {ifname} unset; "
                     "kthena-run sets it to the interface that reaches master_addr")
    return Check("collectives_env", "warn", f"nccl over {nnodes} nodes: {ifname} unset",
                 f"NCCL then picks a NIC itself, which may not reach the other nodes: export "
                 f"{ifname} (e.g. =eth0) on every node")


def host_probe_check(facts: HostFacts) -> Check:
    """The host probe a CPU plan here is scored with: its figures, where they came from, their
    age and load (`HostFigures.describe`)."""
    kind = _kind(facts)
    if kind not in (None, "cpu"):
        return Check("host_probe", "skip", f"the plan runs on {kind} devices, priced from the "
                     "catalog; the host probe prices CPU plans")
    if facts.probe is None:
        return Check("host_probe", "warn", "not measured (torch is not importable): CPU plans "
                     "use estimates from the clock and flags", "install torch (README)")
    if facts.probe.provisional:
        return Check("host_probe", "warn", facts.probe.describe(),
                     "the next plan measures again; plan or serve once the machine is idle "
                     "(or name a recorded probe with KTHENA_HOST_PROBE)")
    return Check("host_probe", "ok", facts.probe.describe())


def structured_output_check() -> Check:
    """xgrammar, which structured output and required or named tool calls need, imports."""
    from kthena_serve.engine.grammar import xgrammar_problem

    problem = xgrammar_problem()
    if problem is None:
        import xgrammar

        shown = getattr(xgrammar, "__version__", "")
        return Check("structured_output", "ok", f"xgrammar {shown} imports".replace("  ", " "))
    return Check("structured_output", "fail", "structured output and required or named tool "
                 "calls answer 400", problem)


def native_kernels_check(facts: HostFacts) -> Check:
    """mooncake_ops' native CPU kernels (a CPU plan, or no config: this host's CPU)."""
    kind = _kind(facts)
    if kind not in (None, "cpu"):
        return Check("native_kernels", "skip", f"the plan runs on {kind} devices; the native "
                     "kernels are CPU kernels")
    from mooncake_ops.backends import native

    if native.is_available():
        return Check("native_kernels", "ok", f"native CPU kernels loaded ({native.isa()} build)")
    return Check("native_kernels", "warn", f"not loaded: {native.unavailable_reason()}; the "
                 "PyTorch reference ops run (slower)", f"build them: {native.BUILD_HINT}")


def kv_fit_check(facts: HostFacts) -> Check:
    """The planned KV of the config's workload, and the pool it sets, against memory."""
    if facts.config is None:
        return Check("kv_fit", "skip", "no --config: no workload to size")
    cfg = facts.config
    if facts.plan is None:
        return Check("kv_fit", "fail", f"no plan fits: {facts.plan_error}",
                     "lower service.max_batch_size (sequences at once), use int8 KV "
                     "(kv_cache.compression.method: int8), or plan over more devices")
    plan, mem = facts.plan, facts.plan.chosen.memory
    assert mem is not None
    workload = plan.workload
    tokens = workload.prompt_len + workload.output_len
    need = (f"KV for {workload.concurrency} sequences of {tokens} tokens: "
            f"{format_bytes(mem.kv_cache)} per device, "
            f"{format_bytes(mem.total)} with weights and reserve")
    if _kind(facts) == "cpu":
        host = _host_memory(facts.discovery.cpu)
        per_host = mem.total * max(1, _devices_on_node(facts))
        if host and per_host > host:
            return Check("kv_fit", "fail", f"{need}; this host has {format_bytes(host)}",
                         "lower service.max_batch_size, use int8 KV "
                         "(kv_cache.compression.method: int8), or spread over more hosts")
        room = f"this host has {format_bytes(host)}" if host else "host memory unknown"
    else:
        if not mem.fits:
            return Check("kv_fit", "fail", f"{need}; a device has {format_bytes(mem.capacity)}",
                         "lower service.max_batch_size or plan over more devices")
        room = f"a device has {format_bytes(mem.capacity)}"
    pool = cfg.kv_cache.memory_pool_size
    if pool is not None and parse_bytes(pool) < mem.kv_cache:
        held = int(workload.concurrency * parse_bytes(pool) / mem.kv_cache)
        return Check("kv_fit", "warn", f"{need}; kv_cache.memory_pool_size {pool} holds about "
                     f"{held} of them", "raise kv_cache.memory_pool_size to "
                     f"{format_bytes(mem.kv_cache)}, or lower service.max_batch_size to {held}: "
                     "otherwise sequences wait or are preempted")
    return Check("kv_fit", "ok", f"{need}; {room}")


def calibration_check(path: str | None, plan_report: Mapping | None = None, *,
                      now: float | None = None) -> Check:
    """The calibration the served plan uses: a live server's /plan, else ``--calibration``.

    Args:
        path: the ``kthena bench serve`` JSON the plan is (to be) calibrated from.
        plan_report: a live server's /plan answer (its ``plan.calibration``), if any.
        now: the time to age the file against (default: now).

    Raises:
        DoctorError: ``path`` is not a readable JSON object.
    """
    served = ((plan_report or {}).get("plan") or {}).get("calibration")
    if path is None:
        if served:
            return Check("calibration", "ok", f"the served plan is calibrated from "
                         f"{served.get('source', 'a bench file')}")
        return Check("calibration", "skip", "no --calibration file given, and no served plan "
                     "carries one: the cost model runs on its default efficiencies")
    try:
        bench = json.loads(Path(path).read_text(encoding="utf-8"))
        age_days = ((now or time.time()) - os.path.getmtime(path)) / 86400
    except (OSError, ValueError) as error:
        raise DoctorError(f"--calibration {path}: cannot read it as JSON ({error})") from None
    if not isinstance(bench, dict):
        raise DoctorError(f"--calibration {path}: expected the JSON object `kthena bench "
                          "serve` prints")
    machine = bench.get("machine") or {}
    value = (f"{path}: {age_days:.0f} day(s) old, measured on {machine.get('cpu', '?')} "
             f"({machine.get('cores', '?')} cores)")
    if age_days > CALIBRATION_MAX_AGE_DAYS:
        return Check("calibration", "warn", value,
                     "measure again on this machine (`kthena bench serve`), then "
                     "`kthena plan --calibrate` with the new file: kernels, drivers and "
                     "load change")
    return Check("calibration", "ok", value)


def _devices_on_node(facts: HostFacts) -> int:
    assert facts.plan is not None and facts.topology is not None and facts.config is not None
    node = facts.config.cluster.node_rank
    return sum(facts.topology.devices[i].node == node for i in facts.plan.device_ids)


def _host_memory(cpu: Topology) -> int:
    return sum(d.spec.memory_bytes for d in cpu.devices_on_node(0))


def _pairs(values: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())
