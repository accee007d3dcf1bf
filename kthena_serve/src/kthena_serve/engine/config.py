"""EngineConfig: every knob of one engine, validated once, as a frozen value.

Only the CLI (``kthena serve``) reads argv or the environment; it builds one of these and the
engine, runner and server take it explicitly. The one field read from the environment is the
default of ``kernels`` (``KTHENA_KERNELS``), taken only when no mode is given.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from kthena_core import dtypes
from kthena_core.known_models import names_default_model
from kthena_core.layout import Layout
from kthena_serve.engine.config_errors import ConfigError
from kthena_serve.engine.config_errors import is_bool as _is_bool
from kthena_serve.engine.config_errors import is_int as _is_int
from kthena_serve.engine.config_errors import optional_positive as _optional_positive
from kthena_serve.engine.config_errors import positive as _positive
from kthena_serve.engine.kv_offload_config import KVOffloadConfig
from kthena_serve.engine.parallel_config import (
    PARALLEL_SETTINGS,
    ParallelConfig,
    build_parallel,
    check_parallel,
)
from kthena_serve.engine.sizes import parse_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["SETTINGS", "ConfigError", "EngineConfig", "ParallelConfig", "parse_bytes"]

def _check_target_step(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= 60_000:
        raise ConfigError(attribute.name, "None or 0 (off), or milliseconds up to 60000",
                          value, "the step time the scheduler keeps to while requests decode")


def _check_queue_delay(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= 3600:
        raise ConfigError(attribute.name, "None or 0 (off), or seconds up to 3600", value,
                          "the estimated wait for a first token past which a request gets 503")


def _optional_count(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (not _is_int(value) or value < 0):
        raise ConfigError(attribute.name, "None or 0 (off), or a positive int", value)


def _model_path(value: object) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError("model", "'default' or a checkpoint folder (str or os.PathLike)", value)
    # The default model's other names (smollm2-135m-instruct, SmolLM2-135M-Instruct) are
    # "default" from here on; an existing folder of that name stays a folder.
    return "default" if names_default_model(value) and not os.path.exists(value) else value


def _one_of(*allowed: str) -> Callable[[object, attrs.Attribute, object], None]:
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value not in allowed:
            raise ConfigError(attribute.name, f"one of {', '.join(map(repr, allowed))}", value)

    return check


KERNEL_MODES = ("auto", "native", "torch")
KERNELS_ENV_VAR = "KTHENA_KERNELS"


def _kernels_default() -> str:
    """``KTHENA_KERNELS`` when set, else ``auto``: the environment fills in a kernel mode no one
    gave, and never overrides one given by flag or argument.

    Raises:
        ValueError: ``KTHENA_KERNELS`` names no mode (the message names the variable).
    """
    mode = os.environ.get(KERNELS_ENV_VAR) or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV_VAR}={mode!r}: the kernel choice is one of "
                         f"{', '.join(KERNEL_MODES)}")
    return mode


def _size(value: int | str) -> int:
    try:
        return parse_bytes(value)
    except ValueError:
        raise ConfigError("kv_cache_memory", "a positive size: bytes, or e.g. '1GiB', "
                          "'512MiB', '2G'", value) from None


# docs/kthena_serve.md, "Decode protection": chosen by scripts/step_budget_ab.py
DEFAULT_TARGET_STEP_MS = 100.0
# docs/kthena_serve.md, "Overload control": a generous bound, chosen by kthena bench soak
# --overload (docs/bench_serve.md)
DEFAULT_MAX_QUEUE_DELAY_S = 30.0
_DTYPE_CHOICES = tuple(dtypes.torch_name(key) for key in dtypes.ENGINE_DTYPES)  # bfloat16, float16, float32
_DEVICE = re.compile(r"^(cpu|cuda|npu)(:\d+)?$")


def _check_index(instance: object, attribute: attrs.Attribute, value: str) -> None:
    from mooncake_kv import available_indexes

    if value not in available_indexes():
        raise ConfigError(attribute.name, "a registered prefix index: one of "
                          f"{', '.join(map(repr, available_indexes()))}", value)


def _check_hash(instance: object, attribute: attrs.Attribute, value: str) -> None:
    from mooncake_kv import available_hash_algorithms

    if value not in available_hash_algorithms():
        raise ConfigError(attribute.name, "a registered hash algorithm: one of "
                          f"{', '.join(map(repr, available_hash_algorithms()))}", value)


def _check_kv_dtype(instance: EngineConfig, attribute: attrs.Attribute, value: str) -> None:
    requirement = f"'auto', the compute dtype ({instance.dtype!r}) or 'int8'"
    if value not in ("auto", instance.dtype, "int8"):
        raise ConfigError(attribute.name, requirement, value,
                          "the attention kernels read the cache in the compute dtype, or int8 "
                          "with a float32 scale per token per KV head")


def _check_quantization(instance: EngineConfig, attribute: attrs.Attribute,
                        value: object) -> None:
    if value not in (None, "int8", "gguf"):
        raise ConfigError(attribute.name, "None (weights in dtype) or 'int8' (weight-only int8), "
                          "or 'gguf' (a GGUF file's own quantized weights)", value)
    if value == "gguf" and instance.model != "default" and not instance.model.endswith(".gguf"):
        raise ConfigError(attribute.name, "'gguf' only with model 'default' or a .gguf file",
                          value, f"model {instance.model!r} is not a GGUF file; use None or "
                          "'int8' for a checkpoint folder or Hub repo")


def _check_device(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not _DEVICE.match(value):
        raise ConfigError(attribute.name, "one of 'cpu', 'cuda', 'cuda:N', 'npu', 'npu:N'", value)


def _check_device_present(instance: EngineConfig, attribute: attrs.Attribute,
                          value: str) -> None:
    """A tp x pp engine binds ``<type>:LOCAL_RANK`` per rank (all on this host when spawned);
    one rank binds ``device`` as given. Refuse a device this host does not have, by name."""
    kind, _, index = value.partition(":")
    if kind == "cpu":
        return
    parallel = instance.world_size > 1 or instance.ranks_from == "env"
    if parallel and index:
        raise ConfigError(attribute.name, f"{kind!r} without an index when tp x pp > 1 or "
                          "ranks_from='env'", value,
                          f"each rank binds {kind}:LOCAL_RANK (kthena-run / torchrun set it)")
    from kthena_comm.device import device_backend

    entry = device_backend(kind)
    have = entry.count()
    if parallel:
        spawned = instance.ranks_from == "spawn"
        need = instance.world_size if spawned else 1
        why = (f"tp {instance.tp} x pp {instance.pp} spawns one rank per {kind} device of this "
               f"host and needs {need}" if spawned else f"each rank binds {kind}:LOCAL_RANK")
    else:
        need = int(index or 0) + 1
        why = f"{value!r} needs {need} {kind} device(s)"
    if have < need:
        raise ConfigError(attribute.name, "a device this host has", value,
                          f"{why}, but this host has {have} ({kind} needs {entry.requirement}); "
                          "use device 'cpu' here")


def _kv_offload(value: object) -> KVOffloadConfig | None:

    if value is None or isinstance(value, KVOffloadConfig):
        return value
    try:
        if isinstance(value, dict):  # attrs.asdict of a config, e.g. sent to DP replicas
            return KVOffloadConfig(**value)
        return KVOffloadConfig.parse(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        raise ConfigError("kv_offload", "None or host=SIZE[,...]", value, str(error)) from None


def _check_kv_offload(instance: EngineConfig, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    # tp > 1: rank 0's process maps every rank's pool (/dev/shm files of this host's
    # spawned CPU ranks) and offloads whole blocks of all heads (engine/rank_blocks.py)
    if instance.pp > 1:
        raise ConfigError(attribute.name, "None with pp > 1", str(value),
                          "a pipeline stage's pool holds some layers only, and a block is "
                          "offloaded whole; use pp=1 (tp > 1 is fine)")
    if instance.ranks_from == "env":
        raise ConfigError(attribute.name, "None with ranks_from='env'", str(value),
                          "offload at tp > 1 maps every rank's pool from rank 0's process, "
                          "so the ranks must be spawned on this host; use ranks_from='spawn'")
    if instance.tp > 1 and str(instance.device).partition(":")[0] != "cpu":
        raise ConfigError(attribute.name, "None with tp > 1 off the cpu", str(value),
                          f"offload at tp > 1 maps every rank's pool, /dev/shm files of cpu "
                          f"ranks; device {instance.device!r} is not cpu: use tp=1 there")
    if not instance.enable_prefix_caching:
        raise ConfigError(attribute.name, "None without prefix caching", str(value),
                          "only cached (committed) blocks are offloaded and promoted")


@attrs.frozen(kw_only=True, init=False)
class EngineConfig:
    """How one engine is built.

    Every field is checked on construction; a bad value raises ``ConfigError`` (a
    ``ValueError``) reading ``EngineConfig.<field> must be ... (got ...)``. The parallel
    settings (tp, pp, sp, sp_min_tokens, tp_overlap, tp_overlap_tiles, pp_microbatches,
    pipeline_split_points, expert_parallel, or a ``layout``) are given by name, as the other settings are, and
    held as one value, ``parallel`` (a ``ParallelConfig``); each is also read by its name.

    Attributes:
        model: ``"default"`` (SmolLM2-135M-Instruct), a Hugging Face checkpoint folder, a
            llama ``.gguf`` file or a Hub repo id ``ORG/NAME`` (`kthena_serve.model.source`).
        dtype: weight and compute dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        device: where weights, KV pool and sampling live (``"cpu"``, ``"cuda[:N]"``,
            ``"npu[:N]"``); with ``tp * pp > 1`` (or ``ranks_from="env"``) no index: each rank
            binds ``<type>:LOCAL_RANK`` and loads its shard and pool there
            (`kthena_serve.engine.placement`). A device this host lacks (too few for the spawned
            ranks) is refused. Only CPU is verified on hardware (docs/accelerators.md).
        max_num_seqs: requests running at once (the decode batch size).
        max_num_batched_tokens: tokens one step may compute (prefill chunks + decodes).
        target_step_ms: decode protection: while any request decodes, a step's prefill tokens
            are capped so that its predicted time (``step_cost.StepCostModel``, learnt from the
            engine's own steps) stays within this many milliseconds, at least ``block_size``
            tokens; a step with no decode takes ``max_num_batched_tokens``. None or 0: off
            (every step fills ``max_num_batched_tokens``). Default 100 (docs/kthena_serve.md,
            "Decode protection", has the measurements). The PD prefill worker, which runs no
            decodes, ignores it.
        max_queue_delay_s: overload control (``kthena_serve.engine.admission``): a request whose
            estimated wait for its first token (the prompt tokens queued ahead of it and its own,
            over the rate the queue has been served at, measured) exceeds this many seconds is
            refused at once (HTTP 503 with ``Retry-After``). None or 0: off (unbounded
            queueing). Default 30 (docs/kthena_serve.md, "Overload control").
        max_queued_tokens: overload control by size: a request that would make the prompt
            tokens queued (admitted, no first token yet) exceed this many is refused (503).
            None or 0: off (the default).
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV pool (``"1GiB"`` also accepted).
        num_kv_blocks: exact pool size; overrides ``kv_cache_memory`` (tests use tiny pools).
        max_model_len: context length; default the model's, capped by the pool.
        enable_prefix_caching: reuse cached prompt blocks across requests.
        prefix_index: the KV manager's prefix index (``"hash"`` chain or ``"radix"`` tree).
        hash_algorithm: block-hash digest (``"xxh3_128"`` or ``"sha256"``; a deployment whose
            workers share an index must use one algorithm everywhere).
        kv_cache_dtype: KV pool dtype; ``"auto"`` is ``dtype``; ``"int8"`` stores K/V as int8
            with a float32 scale per token per KV head (the model still computes in ``dtype``).
        tp: tensor-parallel degree (worker processes, one per core).
        pp: pipeline-parallel degree: the layers split into ``pp`` stages, each stage ``tp``
            processes; ``tp * pp`` processes in all (one per core where there are enough).
        sp: sequence parallelism: 1 (off) or ``tp`` (a long forward's tokens are split over
            the TP group for the token-wise work: `kthena_serve.model.sp`); needs ``pp == 1``.
        sp_min_tokens: with ``sp > 1``, a forward of fewer tokens (and every decode-only one)
            runs as plain TP (default `DEFAULT_SP_MIN_TOKENS`); at most
            ``max_num_batched_tokens`` (a prompt is prefilled in chunks of that many tokens).
        tp_overlap: with ``tp > 1``, each row-parallel matmul and its all-reduce (and under
            ``sp`` each all-gather + matmul and matmul + reduce-scatter) run as one MC2 op that
            overlaps the communication with the compute (`kthena_serve.model.overlap`): the
            tiled op on cpu (gloo gives no overlap there: docs/kthena_serve.md, "TP overlap"),
            torch's symmetric-memory async-TP ops on cuda, torch_npu's MC2 ops on npu (both
            unverified on hardware); refused where the installed torch / torch_npu lacks them.
        tp_overlap_tiles: row tiles of the tiled op; None: the device's default (1 on cpu).
        pp_microbatches: micro-batches a step is cut into when ``pp > 1`` (runs of sequences
            with near-equal tokens), so stage s works on micro-batch m while stage s+1 works on
            m-1; default min(pp, step tokens / 64): small decode steps run whole.
        pipeline_split_points: where the pipeline stages start when ``pp > 1``: the first layer
            of stages 1 .. pp - 1, strictly increasing (``(10,)``: stage 0 holds layers 0..9,
            stage 1 the rest); None: equal stages (pp must divide the layers). Each stage's KV
            pool holds its own layers; the block count every rank shares is sized for the
            stage with the most layers, so every rank fits ``kv_cache_memory``.
        expert_parallel: with ``tp > 1`` and an MoE model, each TP rank holds
            ``experts / tp`` whole experts (tp must divide them) instead of a ``1 / tp`` slice of
            every expert; every rank routes the same tokens, runs its own experts' pairs and
            the layer's one all-reduce sums the ranks' shares (no all-to-all: the tokens are
            already on every rank). vLLM's ``--enable-expert-parallel``.
        ranks_from: where ranks 1.. of a ``tp * pp > 1`` engine come from: ``"spawn"`` (this
            process starts them on this host) or ``"env"`` (a launcher such as ``kthena-run``
            started them, on one host or several, and set RANK / WORLD_SIZE / MASTER_ADDR /
            MASTER_PORT; this process must be rank 0, the others run
            ``kthena_serve.engine.parallel_runner.serve_rank``).
        num_threads: torch threads; default the cores this process may run on.
        max_n: largest ``n`` (choices per request) the server accepts.
        check_invariants: run the KV manager's self-check after every verb (tests).
        chat_special_tokens: ``"text"``: special tokens typed in chat content are encoded as
            text, so a user cannot forge a turn; ``"control"``: they act as control tokens.
        quantization: ``"int8"``: weight-only int8 matmul weights (one float32 scale per output
            channel; activations and the KV cache keep ``dtype``); ``"gguf"`` (vLLM's name):
            the GGUF file's own Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K matmul weights, kept
            quantized and dequantised inside the matmul (only with ``model`` ``"default"`` or
            a ``.gguf`` file; `kthena_serve.model.load_model`); None: weights in ``dtype``.
        kv_offload: tiers below the pool, as text (``"host=2GiB"``,
            ``"host=2GiB,store=mooncake@127.0.0.1:50051"``, see ``kthena_serve.engine.kv_offload``)
            or a ``KVOffloadConfig``; None: blocks evicted from the pool are gone. With
            prefix caching and pp=1 only; at tp > 1 with spawned cpu ranks (rank 0 offloads
            every rank's heads of a block as one, `kthena_serve.engine.rank_blocks`).
        kernels: how the CPU matmul and attention kernels are chosen: ``"auto"`` (each
            candidate timed once on this machine at the model's shapes, the fastest taken,
            cached), ``"native"`` (by the CPU's features, no timing) or ``"torch"`` (F.linear
            and SDPA); default ``KTHENA_KERNELS`` when set, else ``"auto"``: the environment
            never overrides a mode given here (`mooncake_ops.selection`).

    Raises:
        ConfigError: a field's value is refused (the message names the field).
        ValueError: ``kernels`` was not given and ``KTHENA_KERNELS`` names no mode.
    """

    model: str = attrs.field(default="default", converter=_model_path)
    dtype: str = attrs.field(default="bfloat16", validator=_one_of(*_DTYPE_CHOICES))
    device: str = attrs.field(default="cpu", validator=[_check_device, _check_device_present])
    max_num_seqs: int = attrs.field(default=64, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=1024, validator=_positive)
    target_step_ms: float | None = attrs.field(default=DEFAULT_TARGET_STEP_MS,
                                               validator=_check_target_step)
    max_queue_delay_s: float | None = attrs.field(default=DEFAULT_MAX_QUEUE_DELAY_S,
                                                  validator=_check_queue_delay)
    max_queued_tokens: int | None = attrs.field(default=None, validator=_optional_count)
    block_size: int = attrs.field(default=16, validator=_positive)
    kv_cache_memory: int = attrs.field(default=1024**3, converter=_size)
    num_kv_blocks: int | None = attrs.field(default=None, validator=_optional_positive)
    max_model_len: int | None = attrs.field(default=None, validator=_optional_positive)
    enable_prefix_caching: bool = attrs.field(default=True, validator=_is_bool)
    prefix_index: str = attrs.field(default="hash", validator=_check_index)
    hash_algorithm: str = attrs.field(default="xxh3_128", validator=_check_hash)
    kv_cache_dtype: str = attrs.field(default="auto", validator=_check_kv_dtype)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig,
                                           validator=lambda config, _a, _v: check_parallel(config))
    ranks_from: str = attrs.field(default="spawn", validator=_one_of("spawn", "env"))
    num_threads: int | None = attrs.field(default=None, validator=_optional_positive)
    max_n: int = attrs.field(default=8, validator=_positive)
    check_invariants: bool = attrs.field(default=False, validator=_is_bool)
    chat_special_tokens: str = attrs.field(default="text", validator=_one_of("text", "control"))
    kv_offload: KVOffloadConfig | None = attrs.field(default=None, converter=_kv_offload,
                                                     validator=_check_kv_offload)
    quantization: str | None = attrs.field(default=None, validator=_check_quantization)
    kernels: str = attrs.field(factory=_kernels_default, validator=_one_of(*KERNEL_MODES))

    def __init__(self, **settings: Any) -> None:
        """``EngineConfig(model=..., tp=2, ...)``: every setting by name (``SETTINGS``);
        ``parallel`` (a ``ParallelConfig``) and ``layout`` (a ``Layout``) are taken too, the
        parallel settings given by name put over them."""
        given = {k: settings.pop(k) for k in (*PARALLEL_SETTINGS, "layout") if k in settings}
        parallel = build_parallel(settings.pop("parallel", None), given)
        self.__attrs_init__(parallel=parallel, **settings)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every setting's default by name (``kernels``' as this environment gives it)."""
        out = {f.name: f.default.factory() if isinstance(f.default, attrs.Factory) else f.default
               for f in attrs.fields(cls) if f.name != "parallel"}
        return {**out, **ParallelConfig().settings()}

    def to_json(self) -> dict:
        """Every setting as JSON by name, the parallel ones flat (what workers and replicas
        get); ``from_json`` reads it back."""
        out = attrs.asdict(self)
        del out["parallel"]
        return {**out, **self.parallel.settings()}

    # the parallel settings, read by name
    tp = property(lambda self: self.parallel.layout.tp)
    pp = property(lambda self: self.parallel.layout.pp)
    sp = property(lambda self: self.parallel.layout.sp)
    sp_min_tokens = property(lambda self: self.parallel.sp_min_tokens)
    tp_overlap = property(lambda self: self.parallel.tp_overlap)
    tp_overlap_tiles = property(lambda self: self.parallel.tp_overlap_tiles)
    pp_microbatches = property(lambda self: self.parallel.pp_microbatches)
    pipeline_split_points = property(lambda self: self.parallel.pipeline_split_points)
    expert_parallel = property(lambda self: self.parallel.expert_parallel)

    @classmethod
    def from_json(cls, fields: dict) -> EngineConfig:
        """The config ``to_json`` wrote (or any subset of its fields: the rest default).

        Raises:
            ConfigError: a field's value is refused.
            TypeError: an unknown field.
        """
        return cls(**fields)

    @property
    def world_size(self) -> int:
        """Processes one engine runs on: tp x pp."""
        return self.tp * self.pp

    @property
    def layout(self) -> Layout:
        """One engine's parallel layout (dp 1): its TP, PP and SP sizes as one value."""
        return self.parallel.layout

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype`` (torch is imported on first use)."""
        return dtypes.torch_dtype(self.dtype)


# Every setting EngineConfig takes by name (the flags' dests and to_json's keys). Read from the
# fields, not ``defaults()``: that runs the kernels default, which reads KTHENA_KERNELS, and a
# bad value there is EngineConfig's error to raise, not this module's import's.
SETTINGS = frozenset(f.name for f in attrs.fields(EngineConfig) if f.name != "parallel") | \
    frozenset(PARALLEL_SETTINGS)
