"""ParallelConfig: one engine's parallelism as one value, the ``parallel`` of an
``EngineConfig``: its ``Layout`` (tp x pp, sp; dp is 1), the pipeline split points, the SP
threshold, TP overlap, the pipeline micro-batches and expert parallelism.

``EngineConfig(tp=2, sp=2, ...)`` still takes these by their setting names (the flags' and the
YAML's), and ``EngineConfig.to_json`` writes them flat; ``build_parallel`` turns the names into
this value once. The rules live in kthena_core: SP's in ``kthena_core.layout.sp_refusal``, the
split points' form in ``kthena_core.shape.has_split_points_form``. ``check_parallel`` applies
them with the engine's other settings (the device, ``max_num_batched_tokens``, quantization),
each refusal naming its setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from kthena_core.layout import Layout, sp_refusal
from kthena_core.shape import has_split_points_form
from kthena_serve.engine.config_errors import (
    ConfigError,
    is_bool,
    is_int,
    optional_positive,
    positive,
)


class EngineSettings(Protocol):
    """What the parallel checks read of an ``EngineConfig`` (which satisfies it)."""

    parallel: ParallelConfig
    tp: int
    pp: int
    sp: int
    tp_overlap: bool
    max_num_batched_tokens: int
    quantization: str | None
    device: str

__all__ = ["DEFAULT_SP_MIN_TOKENS", "PARALLEL_SETTINGS", "EngineSettings", "ParallelConfig",
           "build_parallel", "check_parallel"]

# docs/kthena_serve.md, "Sequence parallelism": a forward of fewer tokens runs as plain TP
DEFAULT_SP_MIN_TOKENS = 512


def _check_sp(instance: EngineSettings, attribute: attrs.Attribute, value: object) -> None:
    """SP runs over the TP group (Megatron style): 1 (off) or tp, with pp = 1."""
    if not is_int(value) or value not in (1, instance.tp):
        hint = ("sequence parallelism splits a long prompt's tokens over the TP group, so "
                "sp = tp; a separate SP group with replicated weights (sp > 1 at tp = 1) is "
                "not wired")
        raise ConfigError(attribute.name, f"1 or tp ({instance.tp})", value, hint)
    why = sp_refusal(instance.tp, instance.pp, value)
    if why is not None:
        raise ConfigError(attribute.name, "1 with pp > 1", value,
                          f"{why}; use sp with pp=1, or pp without sp")


def _check_sp_min_tokens(instance: EngineSettings, attribute: attrs.Attribute,
                         value: object) -> None:
    positive(instance, attribute, value)
    if instance.sp > 1 and value > instance.max_num_batched_tokens:
        raise ConfigError(attribute.name, "at most max_num_batched_tokens "
                          f"({instance.max_num_batched_tokens}) when sp > 1", value,
                          "a forward holds at most max_num_batched_tokens tokens (long prompts "
                          "are prefilled in chunks of it), so SP would never run; lower it or "
                          "raise max_num_batched_tokens")


def _check_tp_overlap(instance: EngineSettings, attribute: attrs.Attribute,
                      value: object) -> None:
    """TP overlap fuses each matmul with its TP collective (`kthena_serve.model.overlap`)."""
    is_bool(instance, attribute, value)
    if not value:
        return
    if instance.tp == 1:
        raise ConfigError(attribute.name, "False with tp = 1", value,
                          "TP overlap fuses each row-parallel matmul with its all-reduce over "
                          "the TP group, and one rank has none; use it with tp > 1")
    if instance.quantization is not None:
        raise ConfigError(attribute.name, "False with quantization int8", value,
                          "the fused matmul + collective ops take dense weights")
    kind = instance.device.partition(":")[0]
    if kind != "cpu":  # cpu always has the tiled op; torch_npu is imported for npu only
        from mooncake_ops.dispatch import MC2_OPS
        from mooncake_ops.errors import UnsupportedDeviceError
        from mooncake_ops.mc2 import require_fused

        try:
            require_fused(kind, MC2_OPS if instance.sp > 1 else ("matmul_all_reduce",))
        except UnsupportedDeviceError as error:
            raise ConfigError(attribute.name, f"False on {kind} with this install", value,
                              str(error)) from None


def _check_expert_parallel(instance: EngineSettings, attribute: attrs.Attribute,
                           value: object) -> None:
    """EP splits an MoE model's experts over the TP ranks (whether the model is MoE, and
    whether tp divides its experts, is checked when it loads)."""
    is_bool(instance, attribute, value)
    if value and instance.tp == 1:
        raise ConfigError(attribute.name, "False with tp = 1", value,
                          "expert parallelism splits the experts over the TP ranks, and one "
                          "rank holds them all; use it with tp > 1")


def _check_tp_overlap_tiles(instance: EngineSettings, attribute: attrs.Attribute,
                            value: object) -> None:
    optional_positive(instance, attribute, value)
    if value is not None and not instance.tp_overlap:
        raise ConfigError(attribute.name, "None without tp_overlap", value,
                          "it sets the row tiles of TP overlap's tiled matmul + collective")




def _split_points(value: object) -> object:
    """A list (JSON, YAML) becomes a tuple; anything else is left for the validator."""
    return tuple(value) if isinstance(value, list) else value


def _check_split_points(instance: EngineSettings, attribute: attrs.Attribute,
                        value: object) -> None:
    """Count and order here; the layer range is checked against the model when it loads
    (`kthena_core.shape.check_split_points`, through ``PipelineStage.of``)."""
    if value is None:
        return
    requirement = (f"None (equal stages) or {instance.pp - 1} strictly increasing positive "
                   f"int(s) for pp={instance.pp}: the first layer of stages 1..{instance.pp - 1}")
    if instance.pp == 1:
        raise ConfigError(attribute.name, "None with pp=1", value,
                          "split points cut the layers into pp > 1 pipeline stages")
    if not has_split_points_form(instance.pp, value):
        raise ConfigError(attribute.name, requirement, value)




# The settings a ParallelConfig holds, by the names flags, the YAML and to_json use.
PARALLEL_SETTINGS = ("tp", "pp", "sp", "sp_min_tokens", "tp_overlap", "tp_overlap_tiles",
                     "pp_microbatches", "pipeline_split_points", "expert_parallel")


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """One engine's parallelism (see the module docstring; ``EngineConfig``'s docstring says
    what each setting does).

    Attributes:
        layout: tp x pp ranks, sp 1 or tp (dp is the deployment's, not the engine's: 1 here).
        pipeline_split_points: the first layer of pipeline stages 1 .. pp - 1 (None: equal).
        sp_min_tokens: with sp > 1, shorter forwards run as plain TP.
        tp_overlap: each row-parallel matmul fused with its collective (MC2).
        tp_overlap_tiles: row tiles of the tiled op (None: the device's default).
        pp_microbatches: micro-batches a pipelined step is cut into (None: chosen per step).
        expert_parallel: an MoE model's experts split whole over the TP ranks (EP = tp)
            instead of each expert split over them.
    """

    layout: Layout = attrs.field(factory=lambda: Layout(1))
    pipeline_split_points: tuple[int, ...] | None = None
    sp_min_tokens: int = DEFAULT_SP_MIN_TOKENS
    tp_overlap: bool = False
    tp_overlap_tiles: int | None = None
    pp_microbatches: int | None = None
    expert_parallel: bool = False

    def settings(self) -> dict[str, Any]:
        """Every setting by its name (``PARALLEL_SETTINGS``), as ``EngineConfig.to_json``
        writes them."""
        out = attrs.asdict(self, recurse=False)
        layout = out.pop("layout")
        return {"tp": layout.tp, "pp": layout.pp, "sp": layout.sp, **out}


@attrs.frozen
class _Named:
    name: str  # what a field check reads of its attrs.Attribute


@attrs.frozen
class _Sizes:
    tp: int
    pp: int


def build_parallel(base: ParallelConfig | Mapping[str, Any] | None,
                   settings: Mapping[str, Any]) -> ParallelConfig:
    """``base`` (a ParallelConfig, its ``attrs.asdict``, or None: the defaults) with the
    settings given by name put over it: ``layout`` (a Layout, e.g. a plan's), then ``tp``,
    ``pp``, ``sp`` and the rest (``PARALLEL_SETTINGS``).

    Raises:
        ConfigError: tp or pp not a positive int, sp neither 1 nor tp or with pp > 1; the
            checks that need the engine's other settings are ``check_parallel``'s.
    """
    if isinstance(base, Mapping):
        fields = dict(base)
        if isinstance(fields.get("layout"), Mapping):
            fields["layout"] = Layout(**fields["layout"])
        base = ParallelConfig(**fields)
    current = (base or ParallelConfig()).settings()
    layout = settings.get("layout")
    if layout is not None:
        current.update(tp=layout.tp, pp=layout.pp, sp=layout.sp)
    current.update({k: v for k, v in settings.items() if k != "layout"})
    positive(None, _Named("tp"), current["tp"])
    positive(None, _Named("pp"), current["pp"])
    _check_sp(_Sizes(current["tp"], current["pp"]), _Named("sp"), current["sp"])
    sizes = {k: current.pop(k) for k in ("tp", "pp", "sp")}
    current["pipeline_split_points"] = _split_points(current["pipeline_split_points"])
    return ParallelConfig(layout=Layout(sizes["tp"], sizes["pp"], 1, sizes["sp"]), **current)


def check_parallel(config: EngineSettings) -> None:
    """The parallel settings' checks that read the engine's other settings.

    Raises:
        ConfigError: naming the setting (``sp_min_tokens``, ``tp_overlap``, ...).
    """
    parallel = config.parallel
    _check_sp_min_tokens(config, _Named("sp_min_tokens"), parallel.sp_min_tokens)
    _check_tp_overlap(config, _Named("tp_overlap"), parallel.tp_overlap)
    _check_tp_overlap_tiles(config, _Named("tp_overlap_tiles"), parallel.tp_overlap_tiles)
    optional_positive(config, _Named("pp_microbatches"), parallel.pp_microbatches)
    _check_split_points(config, _Named("pipeline_split_points"), parallel.pipeline_split_points)
    _check_expert_parallel(config, _Named("expert_parallel"), parallel.expert_parallel)
