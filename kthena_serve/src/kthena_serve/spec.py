"""ServeSpec: one deployment as ``kthena serve`` runs it, resolved once into a frozen value.

Three sources, one precedence, one place::

    flags given on the command line   (or a DistributedModel's explicit choices)
      > the config's keys and its plan  (kthena serve --config FILE.yaml)
        > the defaults of the typed values (EngineConfig, PDConfig, KVEventsConfig, ServeSpec)

``ServeSpec.resolve(flags, planned)`` takes the flags a user gave (by the name of what they set:
``tp``, ``enable_prefix_caching``, ``pd_policy`` ...) and the planned config, and builds every
typed value once. The CLI, ``launch_distributed_inference`` and the PD / DP launchers take the
spec; nothing reads a flag again. How the config's keys become settings:

    plan tp / pp / sp                    -> tp / pp / sp
    parallelism.fused_communication      -> tp_overlap (MC2: each matmul fused with its collective)
    plan's uneven pipeline split         -> pipeline_split_points (parallelism.pipeline_split_points,
                                            or the planner's balanced split; none: equal stages)
    plan dp (colocated)                  -> dp (replicas behind one router)
    service.mode pd + plan's PD split    -> mode pd, prefill N, decode M
    model.checkpoint_path / dtype        -> model / dtype
    service.max_batch_size               -> max_num_seqs
    service.kv_cache_reuse               -> enable_prefix_caching
    service.host / port                  -> host / port
    kv_cache.reuse_bucket_size           -> block_size
    kv_cache.memory_pool_size            -> kv_cache_memory
    kv_cache.max_tokens                  -> num_kv_blocks = ceil(max_tokens / block_size)
                                            (unless kv_cache_memory is a flag)
    kv_cache.compression.method          -> kv_cache_dtype (none: auto, int8: int8; group_size
                                            must be the model's head_dim: one scale per head)
    kv_cache.offload                     -> kv_offload (e.g. "host=2GiB,store=mooncake")

A plan one ``kthena serve`` cannot run (devices on several hosts without ``kthena-run``, tp or
pp > 1 per PD worker) raises ``UnservablePlanError``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kthena_core.dtypes import torch_name
from kthena_core.layout import Layout
from kthena_serve.cluster.config import RouterWeights
from kthena_serve.engine.config import ConfigError, EngineConfig
from kthena_serve.kv_events.config import KVEventsConfig, KVEventsConfigError
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.launcher import worker_names as pd_worker_names

if TYPE_CHECKING:
    from kthena_core.calibrate import CalibrationFile
    from kthena_core.config import CompressionConfig, KthenaConfig
    from kthena_core.cpu_defaults import PlanFactors
    from kthena_core.planner import Plan
    from kthena_core.topology import Topology

__all__ = ["DEFAULT_MODEL_NAME", "PlannedConfig", "ServeSpec",
           "UnservablePlanError", "check_servable", "config_settings", "engine_config",
           "flag_name", "model_name", "plan_config_path"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PLAN_CANDIDATES = 3  # runner-ups printed at start-up and carried in GET /plan
_ENGINE_FIELDS = frozenset(f.name for f in attrs.fields(EngineConfig))
# Settings whose flag is not --<name with dashes>.
_FLAG_NAMES = {"enable_prefix_caching": "--no-prefix-caching", "redis_url": "--kv-events",
               "max_queue_delay_s": "--max-queue-delay",
               "pod": "--pod-name", "chunk_size": "--kv-events-chunk-size",
               "max_chunks": "--kv-events-max-chunks"}
# kthena serve's settings that are not EngineConfig fields (with their defaults).
_SERVE_DEFAULTS: dict[str, Any] = {
    "mode": "colocated", "dp": 1, "prefill": 1, "decode": 1, "host": "127.0.0.1", "port": 8000,
    "api_key": None, "public_metrics": False, "served_model_name": None,
    "shutdown_timeout": 30.0, "stream_stall_timeout": None, "config": None,
    "pd_policy": "recompute", "pd_timeout": 30.0, "pd_transport": "shm",
    "pd_kv_push": "layerwise", "pd_threshold": 32, "router_weights": "1.0,0.5,0.25",
    "kv_events": None, "pod_name": None, "kv_events_chunk_size": 16, "kv_events_max_chunks": 128,
    "disable_log_stats": False, "enable_log_requests": False,
}


class UnservablePlanError(ValueError):
    """The plan needs something ``kthena serve`` cannot run on one host yet."""


def flag_name(setting: str) -> str:
    """The command-line flag of a setting (``tp`` -> ``--tp``; ``enable_prefix_caching`` ->
    ``--no-prefix-caching``): messages name what the user typed."""
    return _FLAG_NAMES.get(setting, "--" + setting.replace("_", "-"))


def model_name(model: str) -> str:
    """The id clients send for ``model``: SmolLM2's for the default, a Hub repo id as it is,
    else the folder's (or GGUF file's) name."""
    if model == "default":
        return DEFAULT_MODEL_NAME
    from kthena_serve.model.source import served_name

    return served_name(model)


def engine_config(flags: Mapping[str, Any]) -> EngineConfig:
    """The ``EngineConfig`` of the engine settings in ``flags`` (other keys are ignored).

    Raises:
        ValueError: a refused value; the message starts with the flag, then says what the
            config field takes (``--dtype: EngineConfig.dtype must be ...``).
    """
    try:
        return EngineConfig(**{k: v for k, v in flags.items() if k in _ENGINE_FIELDS})
    except ConfigError as error:
        raise ValueError(f"{flag_name(error.field)}: {error}") from None


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
        """The settings the config and its plan give (see the module docstring)."""
        return config_settings(self.config, self.plan)

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
        out["figures"] = dict(self.figures) if self.figures else None
        return out


@attrs.frozen(kw_only=True)
class ServeSpec:
    """Everything one ``kthena serve`` runs, as typed values.

    Attributes:
        engine: the engine of every replica / worker.
        mode: ``"colocated"`` or ``"pd"`` (prefill and decode workers behind a router).
        dp: colocated replicas behind one router (1: one engine in this process).
        num_prefill, num_decode: PD worker counts.
        pd: PD and router settings (the router weights also rank DP replicas).
        host, port: where the API listens.
        served_model_name: the model id clients send.
        api_key: what the API requires (None: nothing); never in ``to_json``.
        public_metrics: /metrics without the API key.
        shutdown_timeout_s: on SIGTERM, how long running requests may take.
        stream_stall_timeout_s: colocated: a stream whose client reads nothing this long is
            stopped (None: the engine's default).
        kv_events: KV events to Redis for the Kthena router (None: off).
        log_stats: print vLLM's periodic stats line (``--disable-log-stats`` turns it off).
        log_requests: print a line per request received and finished
            (``--enable-log-requests``, off by default as in vLLM).
        config_path: the ``--config`` file, if one was planned.
        plan: the plan's JSON (GET /plan), if a config was planned.
    """

    engine: EngineConfig = attrs.field(factory=EngineConfig)
    mode: str = attrs.field(default="colocated",
                            validator=attrs.validators.in_(("colocated", "pd")))
    dp: int = 1
    num_prefill: int = 1
    num_decode: int = 1
    pd: PDConfig = attrs.field(factory=PDConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = DEFAULT_MODEL_NAME
    api_key: str | None = attrs.field(default=None, repr=False)
    public_metrics: bool = False
    shutdown_timeout_s: float = 30.0
    stream_stall_timeout_s: float | None = None
    kv_events: KVEventsConfig | None = None
    log_stats: bool = True
    log_requests: bool = False
    config_path: str | None = None
    plan: Mapping[str, Any] | None = attrs.field(default=None, eq=False, repr=False)

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def resolve(cls, flags: Mapping[str, Any], planned: PlannedConfig | None = None, *,
                world_size: int = 1) -> ServeSpec:
        """Flags over the planned config over the defaults, checked once.

        Args:
            flags: the settings the user gave, by name (the flags' argparse dests:
                ``tp``, ``enable_prefix_caching``, ``pd_policy``, ``router_weights`` ...).
                Defaults are not flags: a setting absent here comes from the config or the
                defaults.
            planned: the ``--config`` and its plan, or None.
            world_size: WORLD_SIZE when a launcher (``kthena-run`` / torchrun) started this
                process as one rank of several; such a rank runs one tp x pp engine only.

        Raises:
            ValueError: a refused value or combination; the message starts with the flag.
        """
        unknown = set(flags) - _ENGINE_FIELDS - set(_SERVE_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(sorted(unknown))}; allowed: "
                             f"{', '.join(sorted(_ENGINE_FIELDS | set(_SERVE_DEFAULTS)))}")
        given = {**(planned.settings() if planned else {}), **flags}
        if "pp" in flags and "pipeline_split_points" not in flags:
            given.pop("pipeline_split_points", None)  # the plan's points cut the plan's pp
        if (planned is not None and planned.config.kv_cache.max_tokens
                and "kv_cache_memory" not in flags):
            block = given.get("block_size", EngineConfig().block_size)
            given["num_kv_blocks"] = math.ceil(planned.config.kv_cache.max_tokens / block)
        s = {**_SERVE_DEFAULTS, **given}
        _check_launcher(s["mode"], s["dp"], world_size)
        _check_combinations(s)
        engine = engine_config(given)
        _check_ranks(engine, world_size)
        served = s["served_model_name"] or model_name(engine.model)
        return cls(engine=engine, mode=s["mode"], dp=s["dp"], num_prefill=s["prefill"],
                   num_decode=s["decode"], pd=_pd_config(s), host=s["host"], port=s["port"],
                   served_model_name=served, api_key=s["api_key"],
                   public_metrics=s["public_metrics"], shutdown_timeout_s=s["shutdown_timeout"],
                   stream_stall_timeout_s=s["stream_stall_timeout"],
                   kv_events=_kv_events(s, served),
                   log_stats=not s["disable_log_stats"], log_requests=s["enable_log_requests"],
                   config_path=planned.path if planned else s["config"],
                   plan=planned.to_json() if planned else None)

    # ---- reading ----------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """What this spec serves (in ``mode``): colocated is ``dp`` replicas; PD is one prefill
        + decode set."""
        dp = 1 if self.mode == "pd" else self.dp
        return Layout(self.engine.tp, self.engine.pp, dp, self.engine.sp)

    def served(self) -> dict[str, Any]:
        """GET /plan's ``served`` (and ``kthena_deployment_info``'s labels); PD adds its
        worker counts."""
        out: dict[str, Any] = {**attrs.asdict(self.layout), "mode": self.mode}
        if self.engine.pipeline_split_points is not None:
            out["pipeline_split_points"] = list(self.engine.pipeline_split_points)
        if self.mode == "pd":
            out.update(prefill=self.num_prefill, decode=self.num_decode)
        return out

    def report(self) -> dict[str, Any]:
        """What GET /plan answers: the layout served, the plan (when a config chose it) and
        the config's path."""
        return {"served": self.served(), "plan": self.plan, "config": self.config_path}

    def check_world(self, world_size: int) -> None:
        """Refuse to run as one of ``world_size`` launcher ranks unless that is one tp x pp
        engine of exactly that many ranks.

        Raises:
            ValueError: names WORLD_SIZE and what to change.
        """
        _check_launcher(self.mode, self.dp, world_size)
        _check_ranks(self.engine, world_size)

    @property
    def aliases(self) -> set[str]:
        """Other model ids the API accepts: the ``--model`` value and ``default``."""
        return {self.engine.model, "default"} - {self.served_model_name}

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """JSON-able fields (``from_json`` gives an equal spec); the API key is left out."""
        out = attrs.asdict(self, recurse=False, filter=lambda a, _: a.name != "api_key")
        out.update(engine=self.engine.to_json(), pd=self.pd.to_json(),
                   kv_events=None if self.kv_events is None else attrs.asdict(self.kv_events),
                   plan=None if self.plan is None else dict(self.plan))
        return out

    @classmethod
    def from_json(cls, fields: Mapping[str, Any]) -> ServeSpec:
        """The spec ``to_json`` wrote.

        Raises:
            ValueError: a field is missing, unknown or refused by its type.
        """
        data = dict(fields)
        try:
            data["engine"] = EngineConfig.from_json(data["engine"])
            data["pd"] = PDConfig.from_json(data["pd"])
            if data.get("kv_events") is not None:
                data["kv_events"] = KVEventsConfig(**data["kv_events"])
            return cls(**data)
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a ServeSpec's JSON: {error}") from None


# ---- resolve's parts ----------------------------------------------------------------------------
def _check_launcher(mode: str, dp: int, world_size: int) -> None:
    if world_size > 1 and (mode == "pd" or dp > 1):
        raise ValueError(f"WORLD_SIZE={world_size}: under kthena-run / torchrun each rank is "
                         "one tp x pp rank of one engine; --mode pd and --dp start their own "
                         "processes. Run them without a launcher, or set --dp 1 and --mode "
                         "colocated")


def _check_ranks(engine: EngineConfig, world_size: int) -> None:
    if world_size > 1 and world_size != engine.world_size:
        raise ValueError(f"WORLD_SIZE={world_size}, but --tp {engine.tp} x --pp {engine.pp} "
                         f"needs {engine.world_size} ranks; launch that many (kthena-run "
                         "--nnodes x --nproc_per_node) or change --tp / --pp")


def _check_combinations(s: Mapping[str, Any]) -> None:
    """Combinations of settings no deployment can run, refused with the flag to change."""
    dp, mode = s["dp"], s["mode"]
    if mode not in ("colocated", "pd"):
        raise ValueError(f"--mode: takes colocated or pd, got {mode!r}")
    port = s["port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port: {port!r} is not a TCP port; allowed 0 to 65535 (0: any "
                         "free port)")
    if mode != "pd":
        given = [f"--{name} {s[name]}" for name in ("prefill", "decode")
                 if s[name] != _SERVE_DEFAULTS[name]]
        if given:
            raise ValueError(f"{' '.join(given)}: PD worker counts, for --mode pd only; add "
                             "--mode pd, or drop them (colocated replicas: --dp N)")
    if dp < 1:
        raise ValueError(f"--dp: must be at least 1 (1: one engine; N > 1: N replicas behind "
                         f"one router), got {dp}")
    if dp > 1 and mode == "pd":
        raise ValueError(f"--dp {dp}: not supported with --mode pd, which sets its own worker "
                         "counts (--prefill N --decode M); drop --dp or --mode pd")
    if dp > 1 and s["kv_events"] is not None:
        raise ValueError(f"--dp {dp}: not supported with --kv-events: the replicas would "
                         "publish under one --pod-name and overwrite each other's blocks; "
                         "run one replica per pod with --kv-events, or drop it")
    if mode != "pd":
        return
    if s["decode"] < 1 or s["prefill"] < 0:
        raise ValueError(f"--prefill {s['prefill']} --decode {s['decode']}: PD needs at least "
                         "one decode worker and no negative count (--prefill 0: the decode "
                         "workers prefill every prompt themselves)")
    if s.get("kv_offload") is not None:
        raise ValueError("--kv-offload: not supported with --mode pd yet (prefill workers "
                         "write into the decode workers' pools); run it colocated or with --dp")
    if s["stream_stall_timeout"] is not None:
        raise ValueError("--stream-stall-timeout applies to colocated serving; PD decode "
                         "workers use 120 s: leave it out with --mode pd")
    for name, what in (("sp", "sequence parallelism splits a prompt over a worker's TP "
                              "ranks, which PD workers do not have"),
                       ("tp", "a TP decode worker's pool is split across ranks"),
                       ("pp", "a pipelined decode worker's pool is split by layers across "
                              "stages")):
        value = s.get(name, 1)
        if value > 1:
            raise ValueError(f"--{name} {value} is not supported in PD mode: a prefill worker "
                             f"writes a decode worker's whole KV pool, and {what}. Use --{name} "
                             f"1 with --mode pd, or --{name} N without it.")
    from kthena_serve.pd.pool_share import check_pd_device

    device = s.get("device", "cpu")
    if isinstance(device, str) and device.partition(":")[0] in ("cpu", "cuda", "npu"):
        check_pd_device(device, s["pd_transport"])  # a bad device: EngineConfig's message


def _pd_config(s: Mapping[str, Any]) -> PDConfig:
    try:
        weights = RouterWeights.parse(s["router_weights"])
    except ValueError as error:
        raise ValueError(f"--router-weights: {error}") from None
    if not s["pd_timeout"] > 0:
        raise ValueError(f"--pd-timeout: must be more than 0 seconds (how long a prefill and "
                         f"its KV hand-off may take before the request fails), got "
                         f"{s['pd_timeout']}")
    try:
        return PDConfig(policy=s["pd_policy"], transfer_timeout_s=s["pd_timeout"],
                        transport=s["pd_transport"], kv_push=s["pd_kv_push"],
                        pd_threshold_tokens=s["pd_threshold"], weights=weights)
    except ValueError as error:
        raise ValueError(f"PD settings: {error}") from None


def _kv_events(s: Mapping[str, Any], served: str) -> KVEventsConfig | None:
    """The ``KVEventsConfig`` of the settings, or None without ``kv_events``."""
    if s["kv_events"] is None:
        for name in ("pod_name", "kv_events_chunk_size", "kv_events_max_chunks"):
            if s[name] != _SERVE_DEFAULTS[name]:
                raise ValueError(f"{flag_name(name)} takes effect only with --kv-events "
                                 "redis://HOST:PORT")
        return None
    if s["pod_name"] is None:
        raise ValueError("--kv-events: needs --pod-name NAME.NAMESPACE, the owner name the "
                         "router looks for")
    if s.get("enable_prefix_caching") is False:
        raise ValueError("--kv-events: nothing is cached with --no-prefix-caching, so there "
                         "is nothing to announce; drop one of them")
    try:
        config = KVEventsConfig(redis_url=s["kv_events"], pod=s["pod_name"], model=served,
                                chunk_size=s["kv_events_chunk_size"],
                                max_chunks=s["kv_events_max_chunks"])
        if s["mode"] == "pd":  # each worker announces as --pod-name's NAME-WORKER.NAMESPACE
            for worker in pd_worker_names(s["prefill"], s["decode"]):
                config.for_worker(worker)
        return config
    except KVEventsConfigError as error:  # its ``model`` is the served name, not --model
        flag = "--served-model-name" if error.field == "model" else flag_name(error.field)
        raise ValueError(f"{flag}: {error}") from None


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
    from kthena_core.calibrate import find_calibration, is_this_machine, planning_cpu
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
        "tp": plan.layout.tp, "pp": plan.layout.pp, "sp": plan.layout.sp,
        "max_num_seqs": service.max_batch_size,
        "block_size": kv.reuse_bucket_size, "enable_prefix_caching": service.kv_cache_reuse,
        "host": service.host, "port": service.port, "mode": service.mode,
        "kv_cache_dtype": _kv_cache_dtype(kv.compression, plan.model.head_dim),
    }
    if service.mode == "pd":
        est = plan.chosen.estimate
        out.update(prefill=est.prefill_replicas, decode=est.decode_replicas)
    else:
        out["dp"] = plan.layout.dp
    if plan.pipeline_split_points is not None:  # pinned by the config, or moved by the plan
        out["pipeline_split_points"] = plan.pipeline_split_points
    if service.target_step_ms is not None:
        out["target_step_ms"] = service.target_step_ms
    if service.max_queue_delay is not None:
        out["max_queue_delay_s"] = service.max_queue_delay
    if kv.memory_pool_size is not None:
        out["kv_cache_memory"] = kv.memory_pool_size
    if kv.offload is not None:
        out["kv_offload"] = kv.offload
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
    if mode == "pd" and (lay.tp > 1 or lay.pp > 1):
        _refuse(f"PD with tp={lay.tp} x pp={lay.pp} per worker is not supported yet (a prefill "
                "worker writes a decode worker's whole KV pool). Set "
                "parallelism.tensor_parallel_size and pipeline_parallel_size to 1")


def _refuse(message: str) -> None:
    raise UnservablePlanError(f"plan not servable: {message}")
