"""``kthena serve --config FILE.yaml``: a ``kthena_config.yaml`` planned, then served as planned.

The config loads with kthena_core's loader (which refuses every key the SDK cannot honour), the
planner runs on it (``cluster.topology``: ``auto`` discovers this machine), the plan is printed,
and the plan plus the config's keys become the values of ``kthena serve``'s own flags:

    plan tp / pp                         -> --tp / --pp
    plan dp (colocated)                  -> --dp (replicas behind one router)
    service.mode pd + plan's PD split    -> --mode pd --prefill N --decode M
    model.checkpoint_path / dtype        -> --model / --dtype
    service.max_batch_size               -> --max-num-seqs
    service.kv_cache_reuse: false        -> --no-prefix-caching
    service.host / port                  -> --host / --port
    kv_cache.reuse_bucket_size           -> --block-size
    kv_cache.memory_pool_size            -> --kv-cache-memory
    kv_cache.max_tokens                  -> EngineConfig.num_kv_blocks = ceil(max_tokens / block)
    kv_cache.compression.method          -> --kv-cache-dtype (none: auto, int8: int8; group_size
                                            must be the model's head_dim: one scale per head)
    kv_cache.offload                     -> --kv-offload (e.g. "host=2GiB,store=mooncake")

A flag given on the command line wins over the config. To tell "given" from "default" (a
flag given with its default value still wins), those flags' actions record their dest when
argparse calls them (``mark_defaults``). A plan one ``kthena serve`` cannot run (devices on
several hosts without ``kthena-run``, tp or pp > 1 per PD worker) raises ``UnservablePlanError``.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import attrs

__all__ = ["OVERRIDABLE", "ServedLayout", "UnservablePlanError", "apply_config", "config_flags",
           "check_servable", "deployment_report", "mark_defaults", "served_layout"]

OVERRIDABLE = ("model", "dtype", "tp", "pp", "dp", "max_num_seqs", "block_size", "kv_cache_memory",
               "no_prefix_caching", "host", "port", "mode", "prefill", "decode", "kv_cache_dtype",
               "kv_offload")
PLAN_CANDIDATES = 3  # runner-ups printed at start-up and carried in GET /plan
_ENGINE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class UnservablePlanError(ValueError):
    """The plan needs something ``kthena serve`` cannot run on one host yet."""


@attrs.frozen
class ServedLayout:
    """The layout one ``kthena serve`` runs; printed at start-up and compared with the plan."""

    tp: int
    pp: int
    dp: int
    sp: int
    mode: str

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} sp={self.sp} mode={self.mode}"


def mark_defaults(parser: argparse.ArgumentParser) -> None:
    """Make the flags a config may set record, when given, their dest in
    ``args.explicit_flags`` (call after every flag is added). Defaults stay plain values."""
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public walk
        if action.dest in OVERRIDABLE:
            action.__class__ = _recording(type(action))


@functools.cache
def _recording(cls: type[argparse.Action]) -> type[argparse.Action]:
    class Recording(cls):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
            super().__call__(parser, namespace, values, option_string)
            explicit = set(getattr(namespace, "explicit_flags", None) or ())
            namespace.explicit_flags = explicit | {self.dest}

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


def plan_layout(plan) -> ServedLayout:  # noqa: ANN001 - kthena_core.planner.Plan
    lay = plan.chosen.layout
    return ServedLayout(lay.tp, lay.pp, lay.dp, lay.sp, plan.workload.mode)


def served_layout(args: argparse.Namespace) -> ServedLayout:
    """What the resolved flags serve: colocated is one replica; PD is prefill + decode."""
    pp = getattr(args, "pp", 1)
    if args.mode == "pd":
        return ServedLayout(args.tp, pp, args.prefill + args.decode, 1, "pd")
    return ServedLayout(args.tp, pp, getattr(args, "dp", 1), 1, "colocated")


def deployment_report(args: argparse.Namespace, plan=None) -> dict:  # noqa: ANN001
    """What GET /plan answers: the layout the flags serve, the plan (``kthena plan --config``'s
    JSON) when a config chose them, and the config's path."""
    served = attrs.asdict(served_layout(args))
    return {"served": served, "plan": None if plan is None else _plan_json(plan),
            "config": getattr(args, "config", None)}


def _plan_json(plan) -> dict:  # noqa: ANN001
    out = plan.to_dict(PLAN_CANDIDATES)
    out["calibration"] = None
    return out


def check_servable(plan, topology, nnodes: int = 1,  # noqa: ANN001
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


def config_flags(cfg, plan) -> dict[str, object]:  # noqa: ANN001 - KthenaConfig, Plan
    """The value of each overridable flag that `cfg` and its `plan` set."""
    service, kv = cfg.service, cfg.kv_cache
    flags: dict[str, object] = {
        "model": cfg.model.checkpoint_path, "dtype": _ENGINE_DTYPES[cfg.model.dtype],
        "tp": plan.tp_size, "pp": plan.pp_size, "max_num_seqs": service.max_batch_size,
        "block_size": kv.reuse_bucket_size, "no_prefix_caching": not service.kv_cache_reuse,
        "host": service.host, "port": service.port, "mode": service.mode,
        "kv_cache_dtype": _kv_cache_dtype(kv.compression, plan.model.head_dim),
    }
    if service.mode == "pd":
        est = plan.chosen.estimate
        flags.update(prefill=est.prefill_replicas, decode=est.decode_replicas)
    else:
        flags["dp"] = plan.dp_size
    if kv.memory_pool_size is not None:
        flags["kv_cache_memory"] = kv.memory_pool_size
    if kv.offload is not None:
        flags["kv_offload"] = kv.offload
    return flags


def _kv_cache_dtype(compression, head_dim: int) -> str:  # noqa: ANN001 - CompressionConfig
    """``--kv-cache-dtype`` for ``kv_cache.compression``.

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


def apply_config(args: argparse.Namespace):  # noqa: ANN201 - Plan | None
    """Set every flag the config sets that was not given on the command line.

    Prints the plan (and which flags override it). Returns the plan, or None without
    ``--config``.

    Raises:
        ValueError: a bad config (kthena_core's ``ConfigError``), no feasible plan, or
            ``UnservablePlanError``.
    """
    plan = cfg = None
    flags: dict[str, object] = {}
    if getattr(args, "config", None):
        cfg, plan = _plan(args.config, getattr(args, "launcher_world", 1))
        flags = config_flags(cfg, plan)
    explicit = getattr(args, "explicit_flags", None) or set()
    for dest, value in flags.items():
        if dest not in explicit:
            setattr(args, dest, value)
    args.num_kv_blocks = None
    if cfg is not None and cfg.kv_cache.max_tokens and "kv_cache_memory" not in explicit:
        args.num_kv_blocks = math.ceil(cfg.kv_cache.max_tokens / args.block_size)
    if plan is not None:
        overridden = [f"--{d.replace('_', '-')}" for d in OVERRIDABLE if d in explicit and d in flags]
        if overridden:
            print(f"kthena serve: command-line flags override the config: "
                  f"{', '.join(overridden)}", file=sys.stderr, flush=True)
    return plan


def _plan(path: str, launcher_world: int = 1):  # noqa: ANN202
    from kthena_core.config_plan import plan_config_file
    from kthena_core.report import format_plan

    cfg, topology, plan = plan_config_file(path)
    print(format_plan(plan, PLAN_CANDIDATES), flush=True)
    print(f"kthena serve: plan layout {plan_layout(plan)}", flush=True)
    check_servable(plan, topology, cfg.cluster.nnodes, launcher_world)
    return cfg, plan
