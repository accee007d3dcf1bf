"""A ``kthena_config.yaml`` and its plan: what ``kthena serve --config`` adds below the flags.

``plan_config_path`` loads and plans the file (printing the plan), ``check_servable`` refuses a
plan one ``kthena serve`` cannot run, and ``config_settings`` turns the config's keys and the
plan into settings by name (spec.py's docstring maps each key to its setting).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kthena_core.dtypes import torch_name
from kthena_core.layout import Layout

if TYPE_CHECKING:
    from kthena_core.calibration_file import CalibrationFile
    from kthena_core.config import CompressionConfig, KthenaConfig
    from kthena_core.cpu_defaults import PlanFactors
    from kthena_core.planner import Plan
    from kthena_core.topology import Topology

__all__ = ["PLAN_CANDIDATES", "PlannedConfig", "UnservablePlanError", "check_servable",
           "config_settings", "plan_config_path"]

PLAN_CANDIDATES = 3  # runner-ups printed at start-up and carried in GET /plan


class UnservablePlanError(ValueError):
    """The plan needs something ``kthena serve`` cannot run on one host yet."""


@attrs.frozen
class PlannedConfig:
    """A ``kthena_config.yaml`` with its plan: what ``--config`` adds to the flags.

    Attributes:
        path: the config file.
        config: the loaded config.
        plan: its plan (``kthena plan --config``).
        calibration: the calibration file the plan was scored with (None: default factors).
        factors: the factors it was scored with and their origin (``kthena_core.cpu_defaults
            .plan_factors``: the calibration file, this CPU's class default or the built-in
            ones); None: the calibration's, else the built-in ones.
        figures: the device figures it was scored with and where they came from
            (``kthena_core.report.figures_dict``).
    """

    path: str
    config: KthenaConfig
    plan: Plan
    calibration: CalibrationFile | None = None
    factors: PlanFactors | None = None
    figures: Mapping[str, Any] | None = None

    @property
    def layout(self) -> Layout:
        """The plan's layout (its mode is ``plan.workload.mode``)."""
        return self.plan.layout

    def settings(self) -> dict[str, Any]:
        """The settings the config and its plan give (see spec.py's docstring)."""
        return config_settings(self.config, self.plan)

    def overridden(self, flags: Mapping[str, Any]) -> list[str]:
        """The settings of the plan that ``flags`` override, in the plan's order (the layout's
        by tp, pp and sp)."""
        names = [part for name in self.settings()
                 for part in (("tp", "pp", "sp") if name == "layout" else (name,))]
        return [name for name in names if name in flags]

    def to_json(self) -> dict[str, Any]:
        """What GET /plan carries as ``plan`` (``kthena plan --config``'s JSON): the plan, the
        calibration it used (None: uncalibrated) and the cost factors it was scored with."""
        from kthena_core.calibrate import factors_dict
        from kthena_core.cost_model import CostParams

        out = self.plan.to_dict(PLAN_CANDIDATES)
        cal = self.calibration
        out["calibration"] = cal.to_json() if cal else None
        params = self.factors.params if self.factors else cal.params if cal else CostParams()
        out["cost_factors"] = factors_dict(params)
        out["factors"] = self.factors.to_json() if self.factors else None
        # as `kthena plan --json` says it: measured factors or a calibration file
        out["calibrated"] = bool(cal) or bool(self.factors and self.factors.is_calibrated)
        out["figures"] = dict(self.figures) if self.figures else None
        return out


# ---- the config and its plan --------------------------------------------------------------------
def plan_config_path(path: str, launcher_world: int = 1, calibration: str | None = None,
                     ) -> PlannedConfig:
    """Load and plan a ``kthena_config.yaml``, print the plan, and refuse what cannot be served.

    ``calibration``: a calibration file (``kthena plan --calibrate`` writes it), ``"none"`` for
    the default factors, or None: this machine's cached calibration when the config's topology
    is this machine's (``auto``), else the defaults.

    Raises:
        ValueError: a bad config (kthena_core's ``ConfigError``), a bad calibration file
            (``CalibrationError``), no feasible plan, or ``UnservablePlanError``.
    """
    from kthena_core.cache_dir import default_cache_dir, host_probe_file
    from kthena_core.calibration_file import find_calibration, is_this_machine, planning_cpu
    from kthena_core.config_plan import load_config_file, plan_config
    from kthena_core.cpu_defaults import plan_factors
    from kthena_core.report import figures_dict, format_figures, format_plan

    cache = default_cache_dir()
    cfg, topology = load_config_file(path, cache_dir=cache, probe_file=host_probe_file())
    this_machine = is_this_machine(cfg.cluster.topology)
    cal = find_calibration(calibration, cache, this_machine, cpu=planning_cpu(topology))
    factors = plan_factors(cal, topology, this_machine)
    plan = plan_config(cfg, topology, params=factors.params)
    planned = PlannedConfig(path, cfg, plan, cal, factors, figures_dict(topology))
    print(format_plan(plan, PLAN_CANDIDATES), flush=True)
    print(format_figures(topology), flush=True)
    print(f"kthena serve: plan scored with {factors.describe()}", flush=True)
    print(f"kthena serve: plan layout {planned.layout} mode={plan.workload.mode}", flush=True)
    check_servable(plan, topology, cfg.cluster.nnodes, launcher_world)
    return planned


def config_settings(cfg: KthenaConfig, plan: Plan) -> dict[str, Any]:
    """The settings ``cfg`` and its ``plan`` give, by name (``num_kv_blocks`` aside)."""
    service, kv = cfg.service, cfg.kv_cache
    out: dict[str, Any] = {
        "model": cfg.model.checkpoint_path, "dtype": torch_name(cfg.model.dtype),
        "layout": attrs.evolve(plan.layout, dp=1),  # the engine's; dp becomes replicas
        "max_num_seqs": service.max_batch_size,
        "block_size": kv.reuse_bucket_size, "enable_prefix_caching": service.kv_cache_reuse,
        "host": service.host, "port": service.port, "mode": service.mode,
        "kv_cache_dtype": _kv_cache_dtype(kv.compression, plan.model.shape.head_dim),
    }
    if service.mode == "pd":
        est = plan.chosen.estimate
        out.update(prefill=est.prefill_replicas, decode=est.decode_replicas)
        if plan.prefill_layout is not None and plan.decode_layout is not None:
            out.update(prefill_tp=plan.prefill_layout.tp, decode_tp=plan.decode_layout.tp)
    else:
        out["dp"] = plan.layout.dp
    if plan.pipeline_split_points is not None:  # pinned by the config, or moved by the plan
        out["pipeline_split_points"] = plan.pipeline_split_points
    optional = {"target_step_ms": service.target_step_ms,
                "max_queue_delay_s": service.max_queue_delay,
                "kv_cache_memory": kv.memory_pool_size, "kv_offload": kv.offload}
    out.update({key: value for key, value in optional.items() if value is not None})
    if cfg.parallelism.fused_communication:  # refused there with tp 1 or in PD mode
        out["tp_overlap"] = True
    return out


def _kv_cache_dtype(compression: CompressionConfig, head_dim: int) -> str:
    """``kv_cache_dtype`` for ``kv_cache.compression``.

    Raises:
        ValueError: an int8 ``group_size`` other than the head_dim (scales are per head).
    """
    if compression.method != "int8":
        return "auto"
    if compression.group_size not in (None, head_dim):
        raise ValueError(f"kv_cache.compression.group_size: got {compression.group_size}; "
                         f"allowed: {head_dim} (the model's head_dim) or unset: the int8 KV "
                         "cache keeps one float32 scale per token per KV head")
    return "int8"


def check_servable(plan: Plan, topology: Topology, nnodes: int = 1,
                   launcher_world: int = 1) -> None:
    """Refuse a plan ``kthena serve`` cannot run as planned.

    ``launcher_world``: WORLD_SIZE when ``kthena-run`` / torchrun started this process as one
    rank of several (1 otherwise). A plan spanning hosts runs only that way: one tp x pp engine
    whose ranks the launcher placed on every host.

    Raises:
        UnservablePlanError: names what is not supported yet and what to change.
    """
    lay, mode = plan.chosen.layout, plan.workload.mode
    hosts = sorted({topology.devices[i].node for i in plan.device_ids})
    spans = max(nnodes, len(hosts))
    if launcher_world > 1:
        if mode != "colocated" or lay.dp > 1 or lay.tp * lay.pp != launcher_world:
            _refuse(f"under kthena-run (WORLD_SIZE={launcher_world}) kthena serve runs one "
                    f"colocated engine of tp x pp = WORLD_SIZE ranks, but the plan is "
                    f"tp={lay.tp} pp={lay.pp} dp={lay.dp} mode={mode}. Pin "
                    f"tensor_parallel_size x pipeline_parallel_size = {launcher_world} with "
                    "data_parallel_size: 1, or launch without kthena-run")
    elif spans > 1:
        _refuse(f"the layout spans {spans} hosts; one kthena serve runs on one host. Start it "
                "on every host with `kthena-run --nnodes N --node_rank R --master_addr ...` "
                "(one tp x pp engine over the hosts), name a one-node cluster.topology with "
                "cluster.nnodes: 1, or render a multi-node deployment with `kthena deploy`")
    if mode == "pd" and lay.pp > 1:
        _refuse(f"PD with pp={lay.pp} per worker is not supported (the KV hand-off moves "
                "heads between TP ranks, not layers between stages). Set "
                "parallelism.pipeline_parallel_size to 1")


def _refuse(message: str) -> None:
    raise UnservablePlanError(f"plan not servable: {message}")
