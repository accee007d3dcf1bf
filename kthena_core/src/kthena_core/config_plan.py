"""The plan a ``kthena_config.yaml`` asks for: the planner run on the config's model, topology
and sizes.

``parallelism.strategy: auto`` lets the planner choose tp x pp x dp over the topology's devices;
any other strategy pins the config's own sizes, and the planner judges that one layout (memory,
head split, layer split), so a pinned layout that cannot run is refused with the planner's
reasons instead of being served blind. ``parallelism.pipeline_split_points`` pins that layout's
stages too; without it the planner keeps equal stages, or moves the split where its cost model
finds them unbalanced (`kthena_core.pipeline_split`). ``sequence_parallel_enabled``
pins sp = ``sequence_parallel_group_size`` (= tp), or under auto lets the planner weigh sp = tp
for its pp = 1 layouts; without it every layout has sp = 1.

In PD mode (``service.mode: pd``) a pinned strategy's layout is split into prefill + decode
instances of its size (the planner weighs every split); under ``auto`` the planner chooses each
role's layout and count, keeping what the ``pd`` section pins (`kthena_core.pd_roles`). A
pinned role tp larger than a node is refused by name when a plan whose TP groups stay on one
node fits, as the planner refuses such layouts of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import attrs

from kthena_core import topology as topo
from kthena_core.config import ConfigError, KthenaConfig, load_config
from kthena_core.cost_model import CostParams
from kthena_core.known_models import load_model_spec
from kthena_core.layout import Layout, LayoutError, PDLayout
from kthena_core.model_spec import ModelSpec
from kthena_core.pd_roles import PD_ROLES, PDRoles, pd_splits
from kthena_core.planner import NoFeasiblePlanError, Plan, Planner
from kthena_core.topology import Topology
from kthena_core.workload import Workload

__all__ = ["config_workload", "load_config_file", "plan_config", "plan_config_file",
           "resolve_topology"]


class _PinnedPlanner(Planner):
    """The planner restricted to one layout (a pinned strategy; in PD mode its splits into
    prefill + decode instances), or to sp = 1 (auto), with the pinned layout's split points
    when the config names them, and in PD mode to the roles' pinned sizes."""

    def __init__(self, pinned: Layout | None, params: CostParams | None = None,
                 split_points: tuple[int, ...] | None = None, *, allow_sp: bool = False,
                 pd_roles: PDRoles | None = None) -> None:
        super().__init__(params, sequence_parallel=allow_sp)
        self.pinned = pinned
        self.split_points = split_points
        self.allow_sp = allow_sp  # auto: sp = tp too, where pp = 1 (what the engine runs)
        self.pd_roles = pd_roles or PDRoles()

    def pipeline_split_points(self, layout: Layout | PDLayout) -> tuple[int, ...] | None:
        return self.split_points if layout == self.pinned else None

    def layouts(self, model: ModelSpec, topology: Topology,
                workload: Workload) -> Iterator[Layout | PDLayout]:
        if self.pinned is not None:
            if workload.mode == "pd":
                yield from (lay for lay in _pd_splits(self.pinned) if self.pd_roles.matches(lay))
            else:
                yield self.pinned
            return
        for lay in super().layouts(model, topology, workload):
            if isinstance(lay, PDLayout):
                if self.pd_roles.matches(lay):
                    yield lay
            elif lay.sp == 1 or (self.allow_sp and lay.sp_refusal() is None):
                yield lay

    def role_tp_sizes(self, model: ModelSpec) -> tuple[int, ...]:
        pinned = {self.pd_roles.pin(role).tp for role in PD_ROLES} - {None}
        return tuple(sorted({*super().role_tp_sizes(model), *pinned}))  # type: ignore[arg-type]

    def plan(self, model: ModelSpec, topology: Topology, workload: Workload | None = None) -> Plan:
        """`Planner.plan`, refusing a pinned role tp larger than a node where a plan whose TP
        groups stay on one node fits (ConfigError naming ``pd.<role>.tp``)."""
        plan = super().plan(model, topology, workload)
        if plan.tp_notes and plan.pd_layout is not None:
            self._check_pinned_tp_in_node(model, topology, plan)
        return plan

    def _check_pinned_tp_in_node(self, model: ModelSpec, topology: Topology, plan: Plan) -> None:
        per_node = min(len(topology.devices_on_node(n)) for n in range(topology.num_nodes))
        for role in PD_ROLES:
            tp = self.pd_roles.pin(role).tp
            if tp is None or tp <= per_node:
                continue
            free = attrs.evolve(self.pd_roles, **{role: attrs.evolve(self.pd_roles.pin(role),
                                                                      tp=None)})
            try:
                other = _PinnedPlanner(None, self.params, pd_roles=free).plan(
                    model, topology, plan.workload)
            except (NoFeasiblePlanError, ConfigError):
                continue
            if not any("span" in note for note in other.tp_notes):
                raise ConfigError(
                    f"pd.{role}.tp: got {tp}, but a node of {topology.name or topology.source} "
                    f"has {per_node} devices and a plan whose TP groups each stay on one node "
                    f"fits ({other.chosen.layout.label}); allowed: at most {per_node}, or unset "
                    "(the planner's choice)")


def _pd_splits(layout: Layout) -> Iterator[PDLayout]:
    """`pd_roles.pd_splits`, refusing what a PD worker cannot run (SP) by LayoutError."""
    if layout.sp > 1:
        raise LayoutError(f"{layout.label} in mode pd: sp={layout.sp}; allowed: 1 (sequence "
                          "parallelism is not wired in PD workers)")
    yield from pd_splits(layout)


def config_workload(cfg: KthenaConfig) -> Workload:
    """The workload a config serves: its dtype, its mode, ``max_batch_size`` sequences at once."""
    return Workload(dtype=cfg.model.dtype, kv_dtype=cfg.model.dtype, mode=cfg.service.mode,
                    concurrency=cfg.service.max_batch_size)


def plan_config(cfg: KthenaConfig, topology: Topology, model: ModelSpec | None = None,
                params: CostParams | None = None) -> Plan:
    """Plan `cfg` on `topology` (``cluster.topology`` resolved by the caller).

    Args:
        cfg: a loaded config.
        topology: the devices to plan over.
        model: the model's spec; default ``load_model_spec(cfg.model.checkpoint_path)``.
        params: the cost model's factors (a calibration's); default ``CostParams()``.

    Raises:
        ConfigError: a pinned layout needs more devices than the topology has, or the
            model's heads/layers cannot be split by it.
        NoFeasiblePlanError: nothing fits (the planner's reasons).
    """
    model = model or load_model_spec(cfg.model.checkpoint_path)
    cfg.validate_roles_against(model)
    par = cfg.parallelism
    pinned = None
    if par.strategy != "auto":
        cfg.validate_against(model)
        sp = par.sequence_parallel_group_size if par.sequence_parallel_enabled else 1
        pinned = Layout(par.tensor_parallel_size, par.pipeline_parallel_size,
                        par.data_parallel_size, sp)
        if pinned.num_devices > topology.num_devices:
            raise ConfigError(
                f"parallelism: tp {pinned.tp} x pp {pinned.pp} x dp {pinned.dp} = "
                f"{pinned.num_devices} devices, but topology {topology.name or topology.source!r} "
                f"has {topology.num_devices}; lower the sizes, use strategy: auto, or name a "
                "larger cluster.topology")
        if cfg.service.mode == "pd" and pinned.dp < 2:
            raise ConfigError(
                f"parallelism.data_parallel_size: got {pinned.dp} with service.mode pd; "
                "allowed: at least 2 (a pinned layout's instances are split into prefill and "
                "decode ones, at least one each), or strategy: auto with a pd section")
    return _PinnedPlanner(pinned, params, par.pipeline_split_points,
                          allow_sp=par.sequence_parallel_enabled, pd_roles=cfg.pd).plan(
        model, topology, config_workload(cfg))


def resolve_topology(spec: str, *, cache_dir: str | os.PathLike[str] | None = None,
                     measure: bool = True, probe_file: str | os.PathLike[str] | None = None,
                     ) -> Topology:
    """'auto' (discover this machine), 'auto:cores' (this host's CPU, one device per core, as
    ``kthena serve --tp/--pp/--dp`` pins one rank per core), a YAML file, or a catalog node name
    with ':N' nodes.

    Discovery measures the host's memory bandwidth and matmul peak (``measure_host``, cached
    under ``cache_dir`` when given), or reads them from ``probe_file`` (a recorded probe,
    ``KTHENA_HOST_PROBE``), unless ``measure`` is False (estimates then).

    Raises:
        HostProbeError: ``probe_file`` is missing or malformed.
        TopologyError: a bad YAML file or catalog name.
    """
    if spec in ("auto", "auto:cores"):
        from kthena_core.discovery import discover, discover_cpu, measure_host

        host = measure_host(cache_dir, probe_file=probe_file) if measure else None
        return discover(host=host) if spec == "auto" else discover_cpu(per_core=True, host=host)
    if spec.endswith((".yaml", ".yml")):
        return topo.Topology.from_yaml(spec)
    name, _, count = spec.partition(":")
    try:
        num_nodes = int(count) if count else 1
    except ValueError:
        raise topo.TopologyError(f"--topology {spec!r}: node count {count!r} is not an integer") from None
    return topo.from_catalog(name, num_nodes)


def plan_config_file(path: str, *, cache_dir: str | os.PathLike[str] | None = None,
                     params: CostParams | None = None,
                     probe_file: str | os.PathLike[str] | None = None,
                     ) -> tuple[KthenaConfig, Topology, Plan]:
    """Load `path`, resolve its topology and plan it with ``params``: what ``kthena plan
    --config`` prints and ``kthena serve --config`` serves.

    Raises:
        ConfigError, TopologyError, NoFeasiblePlanError: as their loaders and the planner.
    """
    cfg, topology = load_config_file(path, cache_dir=cache_dir, probe_file=probe_file)
    return cfg, topology, plan_config(cfg, topology, params=params)


def load_config_file(path: str, *, cache_dir: str | os.PathLike[str] | None = None,
                     probe_file: str | os.PathLike[str] | None = None,
                     ) -> tuple[KthenaConfig, Topology]:
    """Load `path` and resolve its ``cluster.topology`` (host measurements cached under
    ``cache_dir``, or read from ``probe_file``). A relative ``model.checkpoint_path`` or topology YAML is relative to the
    config file.

    Raises:
        ConfigError, TopologyError: as their loaders.
    """
    cfg = load_config(path)
    base = os.path.dirname(os.path.abspath(path))
    checkpoint = cfg.model.checkpoint_path
    if checkpoint != "default":
        checkpoint = os.path.join(base, os.path.expanduser(checkpoint))
        cfg = attrs.evolve(cfg, model=attrs.evolve(cfg.model, checkpoint_path=checkpoint))
    spec = cfg.cluster.topology
    if spec.endswith((".yaml", ".yml")) and not os.path.isabs(spec):
        spec = os.path.join(base, spec)
    return cfg, resolve_topology(spec, cache_dir=cache_dir, probe_file=probe_file)
