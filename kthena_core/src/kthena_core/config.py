"""Typed configuration: the ``kthena_config.yaml`` format of the source article, validated.

```yaml
cluster:      {master_addr: 127.0.0.1, master_port: 29500, world_size: 8, local_rank: 0,
               topology: auto}
parallelism:  {strategy: tp_pp, tensor_parallel_size: 4, pipeline_parallel_size: 2,
               pipeline_split_points: [10]}    # optional: where stage 1 starts
model:        {checkpoint_path: default, dtype: float16}
service:      {api_type: http, host: 0.0.0.0, port: 8000, max_batch_size: 32, kv_cache_reuse: true}
kv_cache:     {max_tokens: 65536, reuse_bucket_size: 16, compression: {method: none}}
pd:           {prefill: {tp: 4, count: 1}, decode: {tp: 4}}   # service.mode pd: per role
```

``pd`` pins what a user wants of each PD role (``tp``, ``pp``, ``count``: instances), with
``service.mode: pd`` and ``parallelism.strategy: auto``; what it leaves out the planner chooses
(`kthena_core.pd_roles`). A role has no dtype of its own: ``pd.prefill.dtype`` is refused by
name (the decode worker reads the KV the prefill worker wrote, in ``model.dtype``).

Every section loads into a frozen attrs class. Every key is honoured by ``kthena serve --config``
or ``kthena-run``, or refused by name (``_reject_unsupported``: gRPC, fused all-reduce,
attention variants, SP, split compute/parameter dtypes), so no key validates and then does
nothing (docs/kthena_core.md has the key reference). A bad file raises `ConfigError` whose message
names the key path, the value and what is allowed; unknown keys are errors (with the nearest
known key suggested), because a typo silently ignored is a misconfigured cluster.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any

import attrs

from kthena_core._yaml import read_yaml
from kthena_core.dtypes import ENGINE_DTYPES, canonical_dtype
from kthena_core.layout import sp_with_pp_refusal
from kthena_core.model_spec import ModelSpec
from kthena_core.pd_roles import PD_ROLES, ROLE_KEYS, PDRoles, role_refusals
from kthena_core.shape import LayerSplitError, check_split_points, has_split_points_form


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def _check(cond: bool, path: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{path}: got {value!r}; allowed: {allowed}")


@attrs.frozen
class ClusterConfig:
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    world_size: int = 1
    local_rank: int = 0
    nnodes: int = 1
    node_rank: int = 0
    topology: str = "auto"


@attrs.frozen
class ParallelismConfig:
    strategy: str = "tp_pp"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    sequence_parallel_enabled: bool = False
    sequence_parallel_group_size: int = 1
    fused_communication: bool = False
    bucket_size_mb: float | None = None
    pipeline_split_points: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v)
    """The first layer of pipeline stages 1 .. pp - 1 (``[10]``: layers 0..9 on stage 0);
    unset: equal stages, or the planner's split where its cost model finds them unbalanced."""


@attrs.frozen
class ModelConfig:
    checkpoint_path: str = "default"
    dtype: str = "bf16"
    compute_dtype: str | None = None
    parameter_dtype: str | None = None
    attention_kernel: str = "flash"


@attrs.frozen
class CompressionConfig:
    """KV cache compression: ``int8`` stores K/V as int8 with a float32 scale per group of
    ``group_size`` elements; the engine's groups are one token's head vector, so ``group_size``
    must be the model's head_dim (unset means that; ``kthena serve`` checks it). With
    ``method: none`` it is only type-checked."""

    method: str = "none"
    group_size: int | None = None


@attrs.frozen
class KVCacheConfig:
    max_tokens: int | None = None
    memory_pool_size: str | None = None
    reuse_bucket_size: int = 16
    sharing_granularity: str = "block"
    compression: CompressionConfig = CompressionConfig()
    offload: str | None = None
    """Tiers below the device pool, as ``kthena serve --kv-offload`` reads them (e.g.
    ``"host=2GiB"`` or ``"host=2GiB,store=mooncake@127.0.0.1:50051"``); checked by the
    engine's config."""


@attrs.frozen
class ServiceConfig:
    api_type: str = "http"
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 32
    kv_cache_reuse: bool = True
    mode: str = "colocated"
    target_step_ms: float | None = None
    max_queue_delay: float | None = None


@attrs.frozen
class KthenaConfig:
    cluster: ClusterConfig = ClusterConfig()
    parallelism: ParallelismConfig = ParallelismConfig()
    model: ModelConfig = ModelConfig()
    service: ServiceConfig = ServiceConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    pd: PDRoles = PDRoles()
    """service.mode pd: each role's pinned tp, pp and count (unset: the planner's choice)."""

    def validate_against(self, model: ModelSpec) -> None:
        """Check the parallel sizes against a model's heads and layers.

        tp follows the engine's head split (`kthena_core.shape.check_tp`): uneven splits such as
        SmolLM2's 3 KV heads over tp=2 are allowed.

        pp need not divide the layers: without split points the planner cuts them where the
        slowest stage is fastest (`kthena_core.pipeline_split`), and the plan carries the points
        to the engine.

        Raises:
            ConfigError: tp cannot split the heads (the message lists the tp values that can),
                pp exceeds the layers, or the split points do not cut them into pp non-empty
                stages.
        """
        tp = self.parallelism.tensor_parallel_size
        pp = self.parallelism.pipeline_parallel_size
        points = self.parallelism.pipeline_split_points
        allowed = model.allowed_tp_sizes()
        _check(tp in allowed, "parallelism.tensor_parallel_size", tp,
               f"one of {', '.join(map(str, allowed))} ({model.name} has "
               f"{model.shape.num_attention_heads} attention heads, "
               f"{model.shape.num_kv_heads} KV heads)")
        if points is not None:
            try:
                check_split_points(model.shape.num_layers, pp, points)
            except LayerSplitError as e:
                raise ConfigError(f"parallelism.pipeline_split_points: {e} ({model.name})") from None
            return
        _check(pp <= model.shape.num_layers, "parallelism.pipeline_parallel_size", pp,
               f"at most {model.name}'s {model.shape.num_layers} layers (one per stage at "
               "least)")

    def validate_roles_against(self, model: ModelSpec) -> None:
        """Check the ``pd`` section's pinned sizes against a model's heads and layers.

        Raises:
            ConfigError: a pinned tp the heads cannot be split over, or a pp above the layers
                (the first such key, named).
        """
        refusals = role_refusals(model, self.pd)
        if refusals:
            raise ConfigError(refusals[0])

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


_SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "parallelism": ParallelismConfig,
    "model": ModelConfig,
    "service": ServiceConfig,
    "kv_cache": KVCacheConfig,
    "pd": PDRoles,
}
_CHOICES = {
    "parallelism.strategy": ("tp", "pp", "tp_pp", "tp_pp_dp", "dp", "auto"),
    "service.api_type": ("http", "grpc"),
    "service.mode": ("colocated", "pd"),
    "model.attention_kernel": ("flash", "memory_efficient", "high_throughput"),
    "kv_cache.sharing_granularity": ("block",),
    "kv_cache.compression.method": ("none", "int8"),
}
_POSITIVE = {
    "cluster.world_size", "cluster.nnodes", "parallelism.tensor_parallel_size",
    "parallelism.pipeline_parallel_size", "parallelism.data_parallel_size",
    "parallelism.sequence_parallel_group_size", "parallelism.bucket_size_mb", "service.max_batch_size",
    "kv_cache.max_tokens", "kv_cache.reuse_bucket_size", "kv_cache.compression.group_size",
    *(f"pd.{role}.{key}" for role in PD_ROLES for key in ROLE_KEYS),
}
_NON_NEGATIVE = {"cluster.local_rank", "cluster.node_rank", "service.target_step_ms",
                 "service.max_queue_delay"}
_PORTS = {"cluster.master_port", "service.port"}


def _build(cls: type, data: Any, path: str) -> Any:
    """Turn a mapping into `cls`, checking keys and value types field by field."""
    if data is None:
        data = {}
    _check(isinstance(data, Mapping), path, data, "a mapping of keys to values")
    fields = {f.name: f for f in attrs.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{key_path}: unknown key{hint}; allowed keys: {', '.join(fields)}")
        values[key] = _field_value(fields[key], value, key_path)
    return cls(**values)


def _field_value(field: attrs.Attribute, value: Any, path: str) -> Any:
    default = field.default
    if attrs.has(type(default)):
        return _build(type(default), value, path)
    kind = field.type if isinstance(field.type, str) else ""
    if kind.startswith("bool"):
        _check(isinstance(value, bool), path, value, "true or false")
    elif kind.startswith(("int", "float")):
        number = (int, float) if kind.startswith("float") else (int,)
        ok = isinstance(value, number) and not isinstance(value, bool)
        _check(ok or (value is None and "None" in kind), path, value, "a number" if "float" in kind else "an integer")
        _check_range(path, value)
    elif kind.startswith("str"):
        _check(isinstance(value, str) or (value is None and "None" in kind), path, value, "a string")
        if path in _CHOICES:
            _check(value in _CHOICES[path], path, value, ", ".join(_CHOICES[path]))
        if path.endswith("dtype") and value is not None:
            try:
                value = canonical_dtype(value)
            except ValueError as e:
                raise ConfigError(f"{path}: {e}") from None
    return value


def _check_range(path: str, value: Any) -> None:
    if value is None:
        return
    if path in _POSITIVE:
        _check(value > 0, path, value, "a number > 0")
    if path in _NON_NEGATIVE:
        _check(value >= 0, path, value, "a number >= 0")
    if path in _PORTS:
        _check(0 < value < 65536, path, value, "a TCP port in 1..65535")


def _cross_checks(cfg: KthenaConfig, base_dir: str | None) -> None:
    par, cl = cfg.parallelism, cfg.cluster
    used = par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    _check(used == cl.world_size, "cluster.world_size", cl.world_size,
           f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = "
           f"{par.tensor_parallel_size} x {par.pipeline_parallel_size} x {par.data_parallel_size} = {used}")
    _check(cl.local_rank < cl.world_size, "cluster.local_rank", cl.local_rank, f"0..{cl.world_size - 1}")
    _check(cl.node_rank < cl.nnodes, "cluster.node_rank", cl.node_rank, f"0..{cl.nnodes - 1}")
    _check_sequence_parallel(cfg)
    _check_pd_roles(cfg)
    _check_strategy(par)
    _check_split_points(par)
    _reject_unsupported(cfg)
    path = cfg.model.checkpoint_path
    if path != "default":
        full = os.path.join(base_dir or "", os.path.expanduser(path))
        _check(os.path.exists(full), "model.checkpoint_path", path,
               "an existing checkpoint folder, config.json or .gguf file, or 'default'")


# What each strategy lets vary; the others must stay 1 (a strategy that contradicts its sizes
# is a misread file). "auto" hands every size to the planner.
_STRATEGY_SIZES = {
    "tp": ("tensor_parallel_size",), "pp": ("pipeline_parallel_size",),
    "tp_pp": ("tensor_parallel_size", "pipeline_parallel_size"),
    "tp_pp_dp": ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"),
    "dp": ("data_parallel_size",), "auto": (),
}


def _check_strategy(par: ParallelismConfig) -> None:
    free = _STRATEGY_SIZES[par.strategy]
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(par, key)
        if value != 1 and key not in free:
            how = ("the planner chooses every size: drop the sizes, or name a strategy"
                   if par.strategy == "auto" else
                   f"strategy {par.strategy!r} varies only {', '.join(free)}; use a strategy "
                   f"that includes it (tp, pp, tp_pp, tp_pp_dp, dp) or set it to 1")
            raise ConfigError(f"parallelism.{key}: got {value} with parallelism.strategy "
                              f"{par.strategy!r}; {how}")


def _check_pd_roles(cfg: KthenaConfig) -> None:
    """A ``pd`` section pins PD roles: only with service.mode pd, and with strategy auto (a
    pinned strategy's sizes would say one layout for both roles)."""
    if not cfg.pd.is_set:
        return
    pinned = cfg.pd.to_dict()
    _check(cfg.service.mode == "pd", "pd", pinned, "unset with service.mode "
           f"{cfg.service.mode} (it pins the prefill and decode roles of service.mode pd)")
    _check(cfg.parallelism.strategy == "auto", "parallelism.strategy",
           cfg.parallelism.strategy, "auto with a pd section (each role's tp, pp and count "
           "are pd.prefill's and pd.decode's; parallelism's sizes would pin one layout for "
           "both roles)")


def load_pd_roles(pd: Any) -> PDRoles:
    """A ``pd`` section (``{prefill: {tp, pp, count}, decode: {...}}``), checked key by key as
    a config's is: deploy.yaml's ``pd`` reads the same way.

    Raises:
        ConfigError: an unknown key (a role's dtype named), a size that is not an int >= 1.
    """
    _refuse_role_dtype({"pd": pd})
    return _build(PDRoles, pd, "pd")


def _refuse_role_dtype(data: Mapping[str, Any]) -> None:
    """A role has no dtype of its own: name the key before the generic unknown-key error."""
    pd = data.get("pd")
    if not isinstance(pd, Mapping):
        return
    for role in PD_ROLES:
        section = pd.get(role)
        for key in ("dtype", "kv_dtype", "compute_dtype"):
            if isinstance(section, Mapping) and key in section:
                raise ConfigError(
                    f"pd.{role}.{key}: got {section[key]!r}; allowed: nothing: both roles "
                    "compute in model.dtype (the decode worker reads the KV the prefill "
                    f"worker wrote as it is); a role takes only {', '.join(ROLE_KEYS)}")


def _check_split_points(par: ParallelismConfig) -> None:
    """The points' form here; their range needs the model's layers (`validate_against`)."""
    points, pp = par.pipeline_split_points, par.pipeline_parallel_size
    if points is None:
        return
    path = "parallelism.pipeline_split_points"
    _check(par.strategy != "auto", path, list(points) if isinstance(points, tuple) else points,
           "unset with strategy auto (the planner chooses pp and its split); pin "
           "pipeline_parallel_size with a strategy that includes pp")
    _check(has_split_points_form(pp, points), path, list(points) if isinstance(points, tuple) else points,
           f"a list of {pp - 1} strictly increasing layer indices >= 1 for "
           f"pipeline_parallel_size {pp}: the first layer of stages 1..{pp - 1}" if pp > 1 else
           "unset with pipeline_parallel_size 1 (split points cut the layers into pp > 1 stages)")


def _check_sequence_parallel(cfg: KthenaConfig) -> None:
    """SP runs over the TP group (the seed's usual case: group size = TP size), colocated, with
    pp = 1; under ``strategy: auto`` the planner may pick it (group size unset: its tp)."""
    par = cfg.parallelism
    sp, tp = par.sequence_parallel_group_size, par.tensor_parallel_size
    if not par.sequence_parallel_enabled:
        _check(sp == 1, "parallelism.sequence_parallel_group_size", sp,
               "1 (unset) while sequence_parallel_enabled is false; set "
               "sequence_parallel_enabled: true to use it")
        return
    _check(cfg.service.mode == "colocated", "parallelism.sequence_parallel_enabled", True,
           "false with service.mode pd (sequence parallelism splits a prompt over a worker's "
           "TP ranks, and PD workers run tp = 1)")
    why = sp_with_pp_refusal(par.pipeline_parallel_size)
    _check(why is None, "parallelism.sequence_parallel_enabled", True,
           f"false with pipeline_parallel_size {par.pipeline_parallel_size} ({why})")
    if par.strategy == "auto":
        _check(sp == 1, "parallelism.sequence_parallel_group_size", sp,
               "unset with strategy auto (the planner picks SP over its own TP group)")
        return
    _check(sp == tp and tp > 1, "parallelism.sequence_parallel_group_size", sp,
           f"tensor_parallel_size ({tp}), which must be > 1: SP shares the TP group; a separate "
           "SP group with replicated weights is not wired")


def _reject_unsupported(cfg: KthenaConfig) -> None:
    """Values the SDK parses but cannot honour yet: refused by name, never silently kept."""
    par, model, kv = cfg.parallelism, cfg.model, cfg.kv_cache
    _check(cfg.service.api_type == "http", "service.api_type", cfg.service.api_type,
           "http (the OpenAI-compatible HTTP API is the only one served; there is no gRPC server)")
    # fused_communication is TP overlap (kthena serve --tp-overlap): each row-parallel matmul
    # fused with its all-reduce (MC2), not a bucketed all-reduce, so it has no bucket size
    _check(not par.fused_communication or cfg.service.mode == "colocated",
           "parallelism.fused_communication", True,
           "false with service.mode pd (it fuses each matmul with its TP all-reduce, and PD "
           "workers run tp = 1)")
    _check(not par.fused_communication or par.strategy == "auto"
           or par.tensor_parallel_size > 1, "parallelism.fused_communication", True,
           "false with tensor_parallel_size 1 (it fuses each matmul with its TP all-reduce, "
           "and one rank has none)")
    _check(par.bucket_size_mb is None, "parallelism.bucket_size_mb", par.bucket_size_mb,
           "unset (fused_communication fuses each matmul with its own all-reduce (MC2); "
           "there are no all-reduce buckets to size)")
    _check(model.attention_kernel == "flash", "model.attention_kernel", model.attention_kernel,
           "flash (the engine's one attention path: tiled paged attention that never "
           "materialises a sequence's full score matrix; no memory_efficient or "
           "high_throughput variant exists)")
    _check(model.dtype in ENGINE_DTYPES, "model.dtype", model.dtype,
           "bfloat16, float16 or float32 (the dtypes the engine serves weights in)")
    for key in ("compute_dtype", "parameter_dtype"):
        value = getattr(model, key)
        _check(value in (None, model.dtype), f"model.{key}", value,
               f"unset or model.dtype ({model.dtype}); the engine computes in its weight dtype")
    _check(kv.max_tokens is None or kv.memory_pool_size is None, "kv_cache.max_tokens",
           kv.max_tokens, "unset when kv_cache.memory_pool_size is set (both size the one "
           "KV pool; keep one)")


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> KthenaConfig:
    """Load and validate a config from a YAML file path or an already-parsed mapping.

    Relative checkpoint paths resolve against the YAML file's folder.

    Raises:
        ConfigError: unreadable file, bad YAML, unknown key, wrong type or inconsistent sizes.
    """
    data, base_dir = read_yaml(source, ConfigError, "config file")
    _check(isinstance(data, Mapping), "<top level>", data, f"a mapping with sections {', '.join(_SECTIONS)}")
    _refuse_role_dtype(data)
    cfg = _build(KthenaConfig, data, "")
    _cross_checks(cfg, base_dir)
    return cfg
