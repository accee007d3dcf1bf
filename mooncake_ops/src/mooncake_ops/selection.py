"""Kernel choice by measurement: every CPU kernel that can run a model's matmuls and attention
here is timed once, at the model's own shapes, and the fastest runs.

    choice = choose_kernels("auto", layers, lm_head, attention, cache_dir=...)
    model.pack_linear_weights(choice.linear_kernel())   # the matmuls
    choice.apply()                                      # the attention ops (process-wide)

Three modes, taken from the caller's ``mode`` argument alone (this layer reads no environment;
``kthena_serve`` turns ``--kernels`` or ``KTHENA_KERNELS`` into the argument):

* ``auto`` (default): measured. The matmul candidates are the packed native bf16 kernel
  (AVX512_BF16 builds), oneDNN over weights it re-ordered (``torch.ops.mkldnn``: AMX where the
  CPU has it), bf16 weights computed in fp32 (the AVX2 build's dense kernel where loaded) and
  plain ``F.linear``; each is timed on decode-sized calls and on a prefill-sized one, and the
  paged attention ops per candidate of the dispatch table (`mooncake_ops.kernel_timing`). A
  candidate that raises is left out (logged). No ISA name decides anything. With
  ``quantization="int8"`` the candidates are the weight-only int8 paths (`int8_candidates`),
  all over one packed int8 form.
* ``native``: the choice made from the CPU's features, without timing (`select_linear_kernel`
  and the dispatch table's defaults): the behaviour before measurement existed.
* ``torch``: torch's own public kernels: ``F.linear`` over the dense weights, SDPA attention.

The matmul choice is made per row class (decode: at most `DECODE_MAX_ROWS` rows; prefill:
more). When the fastest decode kernel is within `SPLIT_LOSS` of the fastest prefill kernel's
time on prefill calls too, or the other way round, one kernel runs both (one packed copy of
each weight). Otherwise a split kernel runs each class on its own winner and holds both
packed copies, twice the weight memory, unless the two kernels pack alike (`split_kernel`).

A measurement is cached as JSON under ``<cache_dir>/kernels/`` (`mooncake_ops.kernel_cache`)
keyed by the CPU (model name and flags), torch's version and thread count, OpenMP's wait
settings (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``), the native build (file, size, mtime), the
mode and the shapes timed; a change to any of them times again. A file lock keeps two processes
that start together from timing side by side (the second reads the first's result). Each
measurement records the load it ran under; one timed while the machine was busy (1-minute load
above half this process's cores) is provisional: it runs, and the next start times again.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

from mooncake_ops.dispatch import choose_impl
from mooncake_ops.gguf_linear import GGUF_DEQUANT_DENSE, GGUF_WEIGHT_ONLY
from mooncake_ops.kernel_cache import (
    MachineLoad,
    cache_key,
    cached_or_measured,
    machine_load,
    read_records,
)
from mooncake_ops.kernel_timing import (
    ATTENTION_OPS,
    AttentionShape,
    MatmulWeight,
    Timer,
    measure_attention,
    measure_linear,
    median_time,
)
from mooncake_ops.layers import silu_and_mul
from mooncake_ops.linear import (
    FP32_COMPUTE_BF16,
    NATIVE_PACKED_BF16,
    ONEDNN_PACKED_BF16,
    TORCH_DENSE,
    LinearKernel,
    native_bf16_linear_available,
    onednn_bf16_available,
    select_linear_kernel,
)
from mooncake_ops.linear_int8 import (
    INT8_DEQUANT_DENSE,
    INT8_NATIVE_PANEL,
    INT8_OP,
    INT8_WEIGHT_ONLY,
    int8_panel_available,
)

__all__ = ["DECODE_MAX_ROWS", "MODES", "SPLIT_LOSS", "KernelChoice", "MachineLoad", "cache_key",
           "cached_choices", "choose_kernels", "fastest", "int8_candidates",
           "linear_candidates", "machine_load", "resolve_mode", "split_kernel",
           "split_or_single", "summary_line"]

_log = logging.getLogger("mooncake_ops")

MODES = ("auto", "native", "torch")
DECODE_MAX_ROWS = 16
SPLIT_LOSS = 1.2


@attrs.frozen
class KernelChoice:
    """What runs the matmuls and attention here, and why.

    Attributes:
        mode: ``auto``, ``native`` or ``torch``.
        linear_decode, linear_prefill: the matmul kernel's name per row class (None: no packed
            kernel, F.linear over the dense weights: dtypes other than bf16, devices other
            than the CPU).
        attention: op -> candidate name (`op_candidates`); absent ops keep the default.
        source: ``measured``, ``cached`` (a measurement read back) or ``fixed`` (no timing).
        timings_ms: family -> candidate -> median milliseconds (None: the candidate failed).
        key: the cache key (hex).
        load_1m, num_cores: the 1-minute load average just before timing and the cores this
            process could use (None: not timed, or a record older than these fields).
        measured_at, measured_at_s: when it was timed, ISO 8601 (local time with its offset)
            and epoch seconds (None: as above).
        provisional: timed while the machine was busy (`MachineLoad.is_busy`): it runs, and
            the next `choose_kernels` with the same cache times again.
    """

    mode: str
    linear_decode: str | None
    linear_prefill: str | None
    attention: Mapping[str, str] = attrs.field(factory=dict)
    source: str = "fixed"
    timings_ms: Mapping[str, Mapping[str, float | None]] = attrs.field(factory=dict)
    key: str = ""
    load_1m: float | None = None
    num_cores: int | None = None
    measured_at: str | None = None
    measured_at_s: float | None = None
    provisional: bool = False

    @property
    def split(self) -> bool:
        return self.linear_decode != self.linear_prefill

    def linear_kernel(self) -> LinearKernel | None:
        """The kernel the model packs its matmul weights for (a split one when the classes
        differ); None: keep F.linear."""
        if self.linear_decode is None or self.linear_prefill is None:
            return None
        small, large = _KERNELS[self.linear_decode], _KERNELS[self.linear_prefill]
        return small if small is large else split_kernel(small, large)

    def apply(self, device_type: str = "cpu") -> None:
        """Make the chosen attention implementations the ones dispatch runs (process-wide);
        ops without a choice return to the backend's default."""
        for op in ATTENTION_OPS:
            choose_impl(op, device_type, self.attention.get(op))

    def as_dict(self) -> dict:
        """For JSON reports and the cache record (`from_record` reads it back)."""
        return {"mode": self.mode, "source": self.source, "linear_decode": self.linear_decode,
                "linear_prefill": self.linear_prefill, "attention": dict(self.attention),
                "timings_ms": {f: dict(t) for f, t in self.timings_ms.items()}, "key": self.key,
                "load_1m": self.load_1m, "num_cores": self.num_cores,
                "measured_at": self.measured_at, "measured_at_s": self.measured_at_s,
                "provisional": self.provisional}

    @classmethod
    def from_record(cls, record: Mapping) -> KernelChoice:
        """A cache record (`as_dict`) read back, as source ``cached``; a record older than the
        load fields reads as final, its load and time unknown.

        Raises:
            KeyError: the record lacks a field every record has (not a kernel choice).
        """
        return cls(record["mode"], record["linear_decode"], record["linear_prefill"],
                   record["attention"], "cached", record["timings_ms"], record["key"],
                   record.get("load_1m"), record.get("num_cores"), record.get("measured_at"),
                   record.get("measured_at_s"), bool(record.get("provisional", False)))

    def margins(self) -> dict[str, float | None]:
        """Family -> runner-up time / winner time, from `timings_ms`: how close the choice
        was (1.0: a tie). None where fewer than two candidates finished, or the winner's time
        rounded to 0."""
        found: dict[str, float | None] = {}
        for family, times in self.timings_ms.items():
            ok = sorted(t for t in times.values() if t is not None and math.isfinite(t))
            found[family] = ok[1] / ok[0] if len(ok) > 1 and ok[0] > 0 else None
        return found

    def timed_under(self) -> str:
        """The load it was timed under, ``load 1.9 on 2 cores``; "" when unknown."""
        if self.load_1m is None or self.num_cores is None:
            return ""
        return f"load {round(self.load_1m, 2):g} on {self.num_cores} cores"

    def labels(self) -> dict[str, str]:
        """Flat name -> value (the ``kthena_kernels_info`` gauge's labels, the start-up line);
        a provisional choice adds ``provisional`` (the load it was timed under)."""
        labels = {"mode": self.mode, "source": self.source,
                  "matmul_decode": self.linear_decode or "F.linear",
                  "matmul_prefill": self.linear_prefill or "F.linear",
                  "decode_attention": self.attention.get("paged_decode_attention", "default"),
                  "prefill_attention": self.attention.get("paged_prefill_attention", "default")}
        if self.provisional:
            labels["provisional"] = f"timed at {self.timed_under()}"
        return labels

    def summary(self) -> str:
        """One line for the start-up log."""
        return summary_line(self.labels())


def summary_line(labels: Mapping[str, str]) -> str:
    """``KernelChoice.labels()`` as one line: ``kernels (auto, measured): matmul ...``, ending
    ``(provisional: timed at load 1.9 on 2 cores; timed again at the next start)`` for a
    provisional choice."""
    decode, prefill = labels["matmul_decode"], labels["matmul_prefill"]
    matmul = decode if decode == prefill else f"{decode} (decode) / {prefill} (prefill)"
    line = (f"kernels ({labels['mode']}, {labels['source']}): matmul {matmul}; decode "
            f"attention {labels['decode_attention']}; prefill attention "
            f"{labels['prefill_attention']}")
    if "decode_step" in labels:  # the model's (kthena_serve.model.llama.DecodeStepChoice)
        line += f"; decode step {labels['decode_step']}"
    if "provisional" in labels:
        line += f" (provisional: {labels['provisional']}; timed again at the next start)"
    return line


_KERNELS: dict[str, LinearKernel] = {k.name: k for k in (
    NATIVE_PACKED_BF16, ONEDNN_PACKED_BF16, FP32_COMPUTE_BF16, TORCH_DENSE,
    INT8_WEIGHT_ONLY, INT8_OP, INT8_NATIVE_PANEL, INT8_DEQUANT_DENSE,
    GGUF_WEIGHT_ONLY, GGUF_DEQUANT_DENSE)}
QUANTIZATIONS = (None, "int8")


def resolve_mode(kernels: str | None) -> str:
    """The mode ``kernels`` names, ``auto`` when None; nothing else (no environment) decides.

    Raises:
        ValueError: ``kernels`` names no mode (the message lists them).
    """
    mode = kernels or "auto"
    _check_mode(mode)
    return mode


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"kernels={mode!r}: the kernel choice is one of {', '.join(MODES)}")


def linear_candidates(weight: torch.Tensor) -> tuple[LinearKernel, ...]:
    """The matmul kernels that can run weights like ``weight`` here (bf16 on the CPU: up to
    four; anything else: none, F.linear runs)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return ()
    found = [TORCH_DENSE, FP32_COMPUTE_BF16]
    if onednn_bf16_available():
        found.insert(0, ONEDNN_PACKED_BF16)
    if native_bf16_linear_available():
        found.insert(0, NATIVE_PACKED_BF16)
    return tuple(found)


def int8_candidates(weight: torch.Tensor) -> tuple[LinearKernel, ...]:
    """The weight-only int8 matmul paths that can run a model of ``weight``'s dtype here, all
    over the same packed int8 weights: the ``int8_linear`` op, the AVX-512 build's panel-
    dequantising bf16 matmul (bf16 on such a build), the weight dequantised into torch's
    matmul, and `INT8_WEIGHT_ONLY`, which mixes them by fixed row counts. None off the CPU."""
    if weight.device.type != "cpu" or not weight.is_floating_point():
        return ()
    found = [INT8_OP, INT8_DEQUANT_DENSE, INT8_WEIGHT_ONLY]
    if weight.dtype == torch.bfloat16 and int8_panel_available():
        found.insert(1, INT8_NATIVE_PANEL)
    return tuple(found)


def fastest(times: Mapping[str, float | None]) -> str:
    """The name with the smallest finite time (None or inf: failed).

    Raises:
        RuntimeError: every candidate failed.
    """
    ok = {name: t for name, t in times.items() if t is not None and math.isfinite(t)}
    if not ok:
        raise RuntimeError(f"every candidate failed: {', '.join(times) or 'none given'}")
    return min(ok, key=ok.__getitem__)


def split_or_single(decode: Mapping[str, float | None], prefill: Mapping[str, float | None],
                    loss: float = SPLIT_LOSS) -> tuple[str, str]:
    """(decode kernel, prefill kernel): one kernel for both when some kernel is within
    ``loss`` of the best in both classes (the one with the smaller worst ratio), else each
    class's own winner."""
    best_d, best_p = decode[fastest(decode)], prefill[fastest(prefill)]
    worst = {}
    for name in set(decode) & set(prefill):
        d, p = decode[name], prefill[name]
        if d is not None and p is not None and math.isfinite(d) and math.isfinite(p):
            worst[name] = max(d / best_d, p / best_p)
    if worst and min(worst.values()) <= loss:
        single = min(sorted(worst), key=worst.__getitem__)
        return single, single
    return fastest(decode), fastest(prefill)


def split_kernel(small: LinearKernel, large: LinearKernel) -> LinearKernel:
    """A kernel running calls of at most `DECODE_MAX_ROWS` rows on ``small`` and larger ones on
    ``large``; each weight is packed for both (the tensor the model holds is ``small``'s; the
    other lives in this kernel, keyed by it, as long as the kernel does). Kernels with the same
    packing (the int8 paths) share one packed copy."""
    other: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}
    same_pack = small.pack is large.pack

    def pack(weight: torch.Tensor) -> torch.Tensor:
        primary = small.pack(weight)
        other[id(primary)] = (primary, primary if same_pack else large.pack(weight), False)
        return primary

    def linear(x: torch.Tensor, packed: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() <= DECODE_MAX_ROWS * x.shape[-1]:
            return small.linear(x, packed, bias)
        return large.linear(x, other[id(packed)][1], bias)

    def pack_gate_up(weight: torch.Tensor) -> torch.Tensor | None:
        primary = small.pack_gate_up(weight) if small.pack_gate_up is not None else None
        if primary is None:
            return None
        if large.pack_gate_up is small.pack_gate_up:
            fused = primary
        else:
            fused = large.pack_gate_up(weight) if large.pack_gate_up is not None else None
        other[id(primary)] = (primary, large.pack(weight) if fused is None else fused,
                              fused is not None)
        return primary

    def gate_up_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        if x.numel() <= DECODE_MAX_ROWS * x.shape[-1]:
            return small.gate_up_silu(x, packed)
        _, alt, fused = other[id(packed)]
        return large.gate_up_silu(x, alt) if fused else silu_and_mul(large.linear(x, alt))

    fused = small.gate_up_silu is not None
    return LinearKernel(f"{small.name}+{large.name}", pack, linear,
                        pack_gate_up if fused else None, gate_up_silu if fused else None)


# ---- the choice ----------------------------------------------------------------------------------
def _fixed(mode: str, weight: torch.Tensor | None, quantization: str | None) -> KernelChoice:
    if quantization == "int8":
        names = {"torch": INT8_DEQUANT_DENSE.name, "native": INT8_WEIGHT_ONLY.name}
        name = None if weight is None or not int8_candidates(weight) else names[mode]
        attention = {op: "torch-sdpa" for op in ATTENTION_OPS} if mode == "torch" else {}
        return KernelChoice(mode, name, name, attention)
    if mode == "torch":
        name = None if weight is None or not linear_candidates(weight) else TORCH_DENSE.name
        return KernelChoice(mode, name, name, {op: "torch-sdpa" for op in ATTENTION_OPS})
    kernel = None if weight is None else select_linear_kernel(weight)
    name = None if kernel is None else kernel.name
    return KernelChoice(mode, name, name)


def choose_kernels(mode: str, layers: Sequence[Sequence[MatmulWeight]],
                   lm_head: MatmulWeight | None, attention: AttentionShape | None, *,
                   cache_dir: str | os.PathLike[str] | None = None,
                   timer: Timer = median_time,
                   quantization: str | None = None,
                   load: Callable[[], MachineLoad] = machine_load) -> KernelChoice:
    """The kernels for a model with these matmul weights and attention shape on this machine.

    Args:
        mode: ``auto`` (measured, cached), ``native`` (by the CPU's features) or ``torch``.
        layers: each layer's matmul weights, in forward order (dense, as loaded).
        lm_head: the LM head's weight, when this rank computes logits.
        attention: the attention shape, or None to leave attention at the default.
        cache_dir: where measurements are kept (``<cache_dir>/kernels/<key>.json``); None:
            measure every time. A cached measurement is reused unless it is provisional: that
            one is timed again and overwritten.
        timer: ``timer(label, fn) -> seconds`` (tests inject timings through it).
        quantization: None (the weights' own dtype) or ``"int8"``: the weights are packed
            weight-only int8 by the chosen kernel, and the int8 paths are the candidates.
        load: the machine's load, read just before timing (tests inject it); a busy machine
            makes the measurement provisional.

    Returns:
        The choice; ``source`` says whether it was measured, read from the cache or fixed.

    Raises:
        ValueError: an unknown mode or quantization.
    """
    _check_mode(mode)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: None or 'int8' (weight-only int8)")
    sample = next((w.weight for layer in layers for w in layer), None)
    if mode != "auto":
        return _fixed(mode, sample, quantization)
    pick = int8_candidates if quantization == "int8" else linear_candidates
    candidates = () if sample is None else pick(sample)
    shapes = [[*w.weight.shape, str(w.weight.dtype), w.gate_up]
              for layer in layers for w in layer] + (
        [] if lm_head is None else [[*lm_head.weight.shape, "lm_head"]]) + (
        [["quantization", quantization]] if quantization else [])
    key = cache_key(mode, shapes, attention)

    def measure() -> KernelChoice:
        return _announced(lambda: _measure(key, candidates, layers, lm_head, attention, timer,
                                           load), len(candidates), attention, cache_dir)

    if cache_dir is None:
        return measure()
    return cached_or_measured(cache_dir, key, measure, KernelChoice.from_record)


def cached_choices(cache_dir: str | os.PathLike[str]) -> list[KernelChoice]:
    """Every kernel choice cached under ``<cache_dir>/kernels/`` (source ``cached``), by key.

    Args:
        cache_dir: the cache folder (``choose_kernels``'s ``cache_dir``).

    Returns:
        The choices whose records read back; unreadable files and JSON that is not a choice
        are skipped. Empty when the folder does not exist.
    """
    found = []
    for record in read_records(cache_dir):
        try:
            found.append(KernelChoice.from_record(record))
        except (KeyError, TypeError):  # another tool's JSON, or a hand-edited record
            continue
    return found


def _announced(measure: Callable[[], KernelChoice], num_matmul: int,
               attention: AttentionShape | None,
               cache_dir: str | os.PathLike[str] | None) -> KernelChoice:
    """``measure()`` between two INFO lines: what is timed and about how long it takes before
    (a start-up otherwise silent for seconds), the time taken and the choice after."""
    what = f"{num_matmul} matmul kernels" + (" and the attention kernels" if attention else "")
    cached = (f"cached in {os.fspath(cache_dir)}/kernels for later starts" if cache_dir
              else "not cached")
    _log.info("kernel selection: timing %s at this model's shapes, once on this machine "
              "(seconds, up to a minute on a busy one; %s)", what, cached)
    started = time.monotonic()
    choice = measure()
    _log.info("kernel selection: timed in %.1f s; %s", time.monotonic() - started,
              choice.summary())
    return choice


def _measure(key: str, candidates: Sequence[LinearKernel],
             layers: Sequence[Sequence[MatmulWeight]], lm_head: MatmulWeight | None,
             attention: AttentionShape | None, timer: Timer,
             load: Callable[[], MachineLoad]) -> KernelChoice:
    # read before timing: what the timings share the machine with, not what they add to it
    under, at_s = load(), time.time()
    timings: dict[str, dict[str, float | None]] = {}
    decode = prefill = None
    if candidates:
        linear = measure_linear(layers, lm_head, candidates, timer)
        timings |= {f"matmul_{cls}": times for cls, times in linear.items()}
        decode, prefill = split_or_single(linear["decode"], linear["prefill"])
    chosen = {}
    if attention is not None:
        for op, times in measure_attention(attention, timer).items():
            timings[op] = times
            chosen[op] = fastest(times)
    ms = {family: {name: None if t is None else round(t * 1e3, 4) for name, t in times.items()}
          for family, times in timings.items()}
    at = datetime.datetime.fromtimestamp(at_s).astimezone().isoformat(timespec="seconds")
    return KernelChoice("auto", decode, prefill, chosen, "measured", ms, key, under.load_1m,
                        under.num_cores, at, at_s, under.is_busy)
