"""ServeSpec: one deployment as ``kthena serve`` runs it, resolved once into a frozen value.

Three sources, one precedence, one place::

    flags given on the command line   (or a DistributedModel's explicit choices)
      > the config's keys and its plan  (kthena serve --config FILE.yaml)
        > the defaults of the typed values (EngineConfig, PDConfig, KVEventsConfig, ServeSpec)

``ServeSpec.resolve(flags, planned)`` takes the flags a user gave (by the name of what they set:
``tp``, ``enable_prefix_caching``, ``pd_policy`` ...) and the planned config, and builds every
typed value once. The CLI, ``launch_distributed_inference`` and the PD / DP launchers take the
spec; nothing reads a flag again. How the config's keys become settings:

    plan layout (tp x pp, sp)            -> the engine's layout (flags --tp / --pp / --sp
                                            change its parts)
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

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import attrs

from kthena_core.known_models import HUB_IDS, catalog_name
from kthena_core.known_models import served_name as known_served_name
from kthena_core.layout import Layout
from kthena_serve.cluster.config import RouterWeights, worker_names
from kthena_serve.engine.config import SETTINGS, ConfigError, EngineConfig
from kthena_serve.kv_events.config import KVEventsConfig, KVEventsConfigError
from kthena_serve.model.source import DEFAULT_MODEL_NAME, served_name
from kthena_serve.pd.config import PDConfig
from kthena_serve.planned import PlannedConfig
from kthena_serve.serve_args import check_tool_call_parser, flag_name

__all__ = ["ServeSpec", "engine_config", "model_aliases"]

_ENGINE_FIELDS = SETTINGS  # EngineConfig's settings by name (the flags' dests)
# kthena serve's settings that are not EngineConfig fields (with their defaults).
_SERVE_DEFAULTS: dict[str, Any] = {
    "mode": "colocated", "dp": 1, "prefill": 1, "decode": 1, "host": "127.0.0.1", "port": 8000,
    "api_key": None, "public_metrics": False, "served_model_name": None,
    "shutdown_timeout": 30.0, "stream_stall_timeout": None, "config": None,
    "prefill_tp": None, "decode_tp": None,
    "pd_policy": "recompute", "pd_timeout": 30.0, "pd_transport": "shm",
    "pd_kv_push": "layerwise", "pd_threshold": 32, "router_weights": "1.0,0.5,0.25",
    "kv_events": None, "pod_name": None, "kv_events_chunk_size": 16, "kv_events_max_chunks": 128,
    "disable_log_stats": False, "enable_log_requests": False, "tool_call_parser": "hermes",
    "no_engine_process": False,
    "structured_outputs_config": None, "timeout_keep_alive": None, "timeout_header_read": None,
}
# --structured-outputs-config's keys (vLLM's StructuredOutputsConfig names) served here.
STRUCTURED_OUTPUTS_KEYS = ("disable_any_whitespace",)


def engine_config(flags: Mapping[str, Any]) -> EngineConfig:
    """The ``EngineConfig`` of the engine settings in ``flags`` (other keys are ignored).

    Raises:
        ValueError: a refused value; the message starts with the flag, then says what the
            config field takes (``--dtype: EngineConfig.dtype must be ...``).
    """
    try:
        return EngineConfig(**{k: v for k, v in flags.items() if k in _ENGINE_FIELDS or k == "layout"})
    except ConfigError as error:
        raise ValueError(f"{flag_name(error.field)}: {error}") from None


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
        engine_process: a colocated one-rank engine without KV events runs in a process of
            its own (``kthena_serve.engine_core``; ``--no-engine-process``: on a thread of the
            API process, ``AsyncLLM``).
        tool_call_parser: the format chat output is parsed for tool calls in
            (``--tool-call-parser``; default hermes), in every mode: by the server, each DP
            replica, or the PD router.
        disable_any_whitespace: what a JSON constraint that does not say gets
            (``--structured-outputs-config '{"disable_any_whitespace": false}'``; True, the
            default: compact JSON), applied where requests are read (the server, each DP
            replica, the PD router).
        keep_alive_s: the public server closes a connection idle between requests after this
            long (``--timeout-keep-alive``; None: run_server's 75 s).
        header_timeout_s: ... and one that sends no complete request header this long after
            it opened (``--timeout-header-read``; None: run_server's 30 s).
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
    engine_process: bool = True
    tool_call_parser: str = attrs.field(default="hermes", converter=check_tool_call_parser)
    disable_any_whitespace: bool = True
    keep_alive_s: float | None = None
    header_timeout_s: float | None = None
    config_path: str | None = None
    plan: Mapping[str, Any] | None = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        """The rules between values, checked however the spec was built (``resolve``, or the
        JSON a PD worker is started with).

        Raises:
            ValueError: KV events without prefix caching (nothing would be announced).
        """
        if self.kv_events is not None and not self.engine.enable_prefix_caching:
            raise ValueError("--kv-events: nothing is cached with --no-prefix-caching, so "
                             "there is nothing to announce; drop one of them")

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
        served = s["served_model_name"] or served_name(engine.model)
        return cls(engine=engine, mode=s["mode"], dp=s["dp"], num_prefill=s["prefill"],
                   num_decode=s["decode"], pd=_pd_config(s), host=s["host"], port=s["port"],
                   served_model_name=served, api_key=s["api_key"],
                   public_metrics=s["public_metrics"], shutdown_timeout_s=s["shutdown_timeout"],
                   stream_stall_timeout_s=s["stream_stall_timeout"],
                   kv_events=_kv_events(s, served),
                   log_stats=not s["disable_log_stats"], log_requests=s["enable_log_requests"],
                   engine_process=not s["no_engine_process"],
                   tool_call_parser=s["tool_call_parser"],
                   disable_any_whitespace=_structured_outputs(s["structured_outputs_config"]),
                   keep_alive_s=_seconds("timeout_keep_alive", s["timeout_keep_alive"]),
                   header_timeout_s=_seconds("timeout_header_read", s["timeout_header_read"]),
                   config_path=planned.path if planned else s["config"],
                   plan=planned.to_json() if planned else None)

    # ---- reading ----------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """What this spec serves (in ``mode``): colocated is ``dp`` replicas; PD is one prefill
        + decode set."""
        return attrs.evolve(self.engine.layout, dp=1 if self.mode == "pd" else self.dp)

    def served(self) -> dict[str, Any]:
        """GET /plan's ``served`` (and ``kthena_deployment_info``'s labels); PD adds its
        worker counts and each role's TP size (``prefill_tp``, ``decode_tp``)."""
        out: dict[str, Any] = {**attrs.asdict(self.layout), "mode": self.mode}
        if self.engine.pipeline_split_points is not None:
            out["pipeline_split_points"] = list(self.engine.pipeline_split_points)
        if self.mode == "pd":
            out.update(prefill=self.num_prefill, decode=self.num_decode,
                       prefill_tp=self.pd.role_tp("prefill", self.engine.tp),
                       decode_tp=self.pd.role_tp("decode", self.engine.tp))
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

    def server_timeouts(self) -> dict[str, float]:
        """``run_server``'s connection timeouts the flags set (the others keep its defaults)."""
        out = {"keep_alive_s": self.keep_alive_s, "header_timeout_s": self.header_timeout_s}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def aliases(self) -> set[str]:
        """Other model ids the API accepts (``model_aliases``)."""
        return model_aliases(self.engine.model, self.served_model_name)

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


def model_aliases(model: str, served: str) -> set[str]:
    """The model ids other than ``served`` that a request's ``model`` may name, in every mode:
    ``default``, the ``--model`` value as given and, for a catalog model (not a path on this
    host), each of its names (kthena_core.known_models): its catalog name, served name and Hub
    id (``--model smollm2-135m-instruct`` also answers to ``SmolLM2-135M-Instruct`` and
    ``HuggingFaceTB/SmolLM2-135M-Instruct``). Exact spellings: the names are not matched
    case-insensitively."""
    names = {model, "default"}
    if model == "default" or not os.path.exists(model):
        catalog = catalog_name(model)
        if catalog is not None:
            names |= {catalog, HUB_IDS[catalog], known_served_name(catalog)}
    return names - {served}


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
        given = [f"{flag_name(name)} {s[name]}"
                 for name in ("prefill", "decode", "prefill_tp", "decode_tp")
                 if s[name] != _SERVE_DEFAULTS[name]]
        if given:
            raise ValueError(f"{' '.join(given)}: PD worker settings, for --mode pd only; add "
                             "--mode pd, or drop them (colocated replicas: --dp N)")
    if dp < 1:
        raise ValueError(f"--dp: must be at least 1 (1: one engine; N > 1: N replicas behind "
                         f"one router), got {dp}")
    if dp > 1 and mode == "pd":
        raise ValueError(f"--dp {dp}: not supported with --mode pd, which sets its own worker "
                         "counts (--prefill N --decode M); drop --dp or --mode pd")
    check_tool_call_parser(s["tool_call_parser"])
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
    if s["stream_stall_timeout"] is not None:
        raise ValueError("--stream-stall-timeout applies to colocated serving; PD decode "
                         "workers use 120 s: leave it out with --mode pd")
    _check_pd_layouts(s)
    _check_pd_offload(s)
    device = s.get("device", "cpu")
    if isinstance(device, str) and device.partition(":")[0] in ("cpu", "cuda", "npu"):
        PDConfig.check_device(device, s["pd_transport"])  # a bad device: EngineConfig's message


def _check_pd_offload(s: Mapping[str, Any]) -> None:
    """``--kv-offload`` in PD: a store written through (docs/pd.md). Workers of any TP size
    offload (a TP worker's blocks go whole, in the one-rank layout: engine/rank_blocks.py);
    PP is refused for every PD worker by ``_check_pd_layouts``."""
    from kthena_serve.engine.kv_offload_config import KVOffloadConfig

    value = s.get("kv_offload")
    try:
        offload = value if isinstance(value, KVOffloadConfig) else KVOffloadConfig.parse(value)
    except ValueError:
        return  # None, or text EngineConfig refuses with the syntax
    if offload.store_address is not None and not offload.store_write_through:
        raise ValueError(f"--kv-offload {value}: PD workers share the store with write=through "
                         "only (each block is put when it is computed, so every other "
                         "instance finds it); add ',write=through'")


def _check_pd_layouts(s: Mapping[str, Any]) -> None:
    """Each PD role's layout: TP workers on cpu (their ranks' pools are /dev/shm files; the
    hand-off copies between them over shm, or puts each rank's heads over mooncake); no PP
    and no SP in PD."""
    for name, what in (("sp", "sequence parallelism is not run in PD workers"),
                       ("pp", "a pipelined worker's pool is split by layers across stages, "
                              "and the hand-off moves heads between TP ranks only")):
        value = s.get(name, getattr(s.get("layout"), name, 1))  # a flag, else the plan's
        if value > 1:
            raise ValueError(f"--{name} {value} is not supported in PD mode: {what}. Use "
                             f"--{name} 1 with --mode pd, or --{name} N without it.")
    tp = s.get("tp", getattr(s.get("layout"), "tp", 1))
    sizes = {"--tp": tp, "--prefill-tp": s["prefill_tp"], "--decode-tp": s["decode_tp"]}
    for flag, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{flag}: a TP size is a whole number of at least 1, got {value!r}")
    big = {flag: value for flag, value in sizes.items() if value is not None and value > 1}
    if big and str(s.get("device", "cpu")).partition(":")[0] != "cpu":
        raise ValueError(f"{' '.join(f'{k} {v}' for k, v in big.items())} with --device "
                         f"{s.get('device')}: TP PD workers run on cpu only (their ranks' "
                         "pools are /dev/shm files); use --device cpu, or tp 1")


def _structured_outputs(config: str | Mapping[str, Any] | None) -> bool:
    """``--structured-outputs-config``'s ``disable_any_whitespace`` (True without the flag).

    Raises:
        ValueError: not a JSON object, an unknown key, or a value of the wrong type; names the
            flag and what it takes.
    """
    flag, allowed = "--structured-outputs-config", ", ".join(STRUCTURED_OUTPUTS_KEYS)
    if config is None:
        return True
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as error:
            raise ValueError(f"{flag}: not JSON ({error}); it takes a JSON object such as "
                             "'{\"disable_any_whitespace\": false}'") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"{flag}: takes a JSON object of {allowed}, got {config!r}")
    unknown = sorted(set(config) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {', '.join(unknown)}; allowed: {allowed} "
                         "(this server's structured outputs run on xgrammar, with no other "
                         "server-wide setting)")
    value = config.get("disable_any_whitespace", True)
    if not isinstance(value, bool):
        raise ValueError(f"{flag}: disable_any_whitespace takes true or false, got {value!r}")
    return value


def _seconds(setting: str, value: Any) -> float | None:
    """A connection timeout: None (the server's default) or positive, finite seconds.

    Raises:
        ValueError: anything else, naming the flag.
    """
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value < math.inf):
        raise ValueError(f"{flag_name(setting)}: must be a positive number of seconds, got "
                         f"{value!r}")
    return float(value)


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
                        pd_threshold_tokens=s["pd_threshold"], weights=weights,
                        prefill_tp=s["prefill_tp"] or 0, decode_tp=s["decode_tp"] or 0)
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
    try:
        config = KVEventsConfig(redis_url=s["kv_events"], pod=s["pod_name"], model=served,
                                chunk_size=s["kv_events_chunk_size"],
                                max_chunks=s["kv_events_max_chunks"])
        if s["mode"] == "pd":  # each worker announces as --pod-name's NAME-WORKER.NAMESPACE
            for worker in worker_names(s["prefill"], s["decode"]):
                config.for_worker(worker)
        return config
    except KVEventsConfigError as error:  # its ``model`` is the served name, not --model
        flag = "--served-model-name" if error.field == "model" else flag_name(error.field)
        raise ValueError(f"{flag}: {error}") from None
