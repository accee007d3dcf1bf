"""The grouped expert matmul chosen by measurement: every candidate of `moe_kernels` timed once
at a model's own expert shapes, per row class, with the kernel cache of `selection`.

    choice = choose_moe_kernels("auto", gate_up, down, top_k, cache_dir=...)   # once, at load
    experts = pack_experts(gate_up, down, **choice.pack_args())                 # each layer
    y = run_experts(x, weights, ids, experts)                                   # each step

Modes are `selection`'s (``auto``, ``native``, ``torch``; this layer reads no environment):

* ``auto``: each candidate (`moe_kernels.grouped_candidates`) runs one layer's experts (the
  model's own weights) on decode-sized batches (1 and 8 tokens, summed) and on a prefill-sized
  one (`PREFILL_ROWS` tokens), routed uniformly at random to ``top_k`` distinct experts each
  (fixed seed), through the whole `run_experts` path (sort, gather, grouped matmul, weighted
  sum); medians of `selection`'s timer. A candidate that raises is left out (logged). The
  decode and prefill winners run their classes when `split_or_single` says a split pays and
  the two share a layout; otherwise the one kernel with the smallest worst-class ratio runs
  both (expert weights are most of an MoE's bytes: never two copies).
* ``native``: without timing, the per-expert loop over the linear kernel
  `select_linear_kernel` picks for the dtype (bf16 on the CPU), else the torch loop.
* ``torch``: the torch loop (`moe_kernels.LOOP`), what `fused_experts` runs.

Off the CPU ``auto`` is ``torch`` (wall-clock timing of asynchronous devices is not done here).
Grouped calls of at most ``DECODE_MAX_ROWS * top_k`` rows (token-expert pairs) are decode.

Measurements are cached like the linear choice (`kernel_cache`: key by CPU, torch, threads,
OpenMP wait policy, native build, mode and shapes; a provisional record from a busy machine is
timed again at the next start), under ``<cache_dir>/kernels/`` beside it.
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

from mooncake_ops.kernel_cache import (
    MachineLoad,
    cache_key,
    cached_or_measured,
    machine_load,
)
from mooncake_ops.kernel_timing import PREFILL_ROWS, Timer, median_time
from mooncake_ops.linear import select_linear_kernel
from mooncake_ops.moe import run_experts
from mooncake_ops.moe_kernels import (
    LOOP,
    GroupedKernel,
    grouped_candidates,
    grouped_kernel,
    pack_experts,
)
from mooncake_ops.selection import DECODE_MAX_ROWS, MODES, split_or_single

__all__ = ["DECODE_TOKENS", "MoEKernelChoice", "choose_moe_kernels", "measure_experts",
           "one_layout"]

_log = logging.getLogger("mooncake_ops")

DECODE_TOKENS = (1, 8)


@attrs.frozen
class MoEKernelChoice:
    """Which grouped kernels run a model's experts here, and why.

    Attributes:
        mode: ``auto``, ``native`` or ``torch``.
        decode, prefill: the kernel's name per row class (`moe_kernels.grouped_kernel`).
        top_k: experts per token (decode calls have at most ``DECODE_MAX_ROWS * top_k`` rows).
        source: ``measured``, ``cached`` or ``fixed``.
        timings_ms: ``moe_decode`` / ``moe_prefill`` -> kernel -> median ms (None: failed).
        key: the cache key (hex).
        load_1m, num_cores, measured_at, measured_at_s, provisional: as in
            `selection.KernelChoice`.
    """

    mode: str
    decode: str
    prefill: str
    top_k: int
    source: str = "fixed"
    timings_ms: Mapping[str, Mapping[str, float | None]] = attrs.field(factory=dict)
    key: str = ""
    load_1m: float | None = None
    num_cores: int | None = None
    measured_at: str | None = None
    measured_at_s: float | None = None
    provisional: bool = False

    @property
    def decode_max_rows(self) -> int:
        return DECODE_MAX_ROWS * self.top_k

    def kernels(self) -> tuple[GroupedKernel, GroupedKernel]:
        """(decode kernel, prefill kernel)."""
        return grouped_kernel(self.decode), grouped_kernel(self.prefill)

    def pack_args(self) -> dict:
        """`pack_experts`' keyword arguments for this choice (add ``expert_start`` under EP)."""
        return {"kernels": self.kernels(), "decode_max_rows": self.decode_max_rows}

    def as_dict(self) -> dict:
        """For JSON reports and the cache record (`from_record` reads it back)."""
        return {"kind": "moe", "mode": self.mode, "moe_decode": self.decode,
                "moe_prefill": self.prefill, "top_k": self.top_k, "source": self.source,
                "timings_ms": {f: dict(t) for f, t in self.timings_ms.items()},
                "key": self.key, "load_1m": self.load_1m, "num_cores": self.num_cores,
                "measured_at": self.measured_at, "measured_at_s": self.measured_at_s,
                "provisional": self.provisional}

    @classmethod
    def from_record(cls, record: Mapping) -> MoEKernelChoice:
        """A cache record (`as_dict`) read back, as source ``cached``.

        Raises:
            KeyError: the record is not a MoE kernel choice.
        """
        return cls(record["mode"], record["moe_decode"], record["moe_prefill"],
                   int(record["top_k"]), "cached", record["timings_ms"], record["key"],
                   record.get("load_1m"), record.get("num_cores"), record.get("measured_at"),
                   record.get("measured_at_s"), bool(record.get("provisional", False)))

    def timed_under(self) -> str:
        """The load it was timed under, ``load 1.9 on 2 cores``; "" when unknown."""
        if self.load_1m is None or self.num_cores is None:
            return ""
        return f"load {round(self.load_1m, 2):g} on {self.num_cores} cores"

    def summary(self) -> str:
        """One line for the start-up log."""
        kernel = (self.decode if self.decode == self.prefill
                  else f"{self.decode} (decode) / {self.prefill} (prefill)")
        line = f"moe kernels ({self.mode}, {self.source}): grouped matmul {kernel}"
        if self.provisional:
            line += f" (provisional: timed at {self.timed_under()})"
        return line


def one_layout(decode: Mapping[str, float | None], prefill: Mapping[str, float | None],
               layouts: Mapping[str, str]) -> tuple[str, str]:
    """(decode kernel, prefill kernel) by `split_or_single`, unless the split's two kernels
    lay the weights out differently: then the kernel with the smallest worst-class ratio runs
    both."""
    small, large = split_or_single(decode, prefill)
    if layouts[small] == layouts[large]:
        return small, large
    single, _ = split_or_single(decode, prefill, loss=math.inf)
    return single, single


def _routing(tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, hidden: int,
             seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return x, weights / weights.sum(-1, keepdim=True), ids


def _time_kernel(kernel: GroupedKernel, gate_up: torch.Tensor, down: torch.Tensor,
                 top_k: int, timer: Timer) -> tuple[float | None, float | None]:
    """(decode seconds, prefill seconds) of ``kernel``; None where it raised."""
    try:
        experts = pack_experts(gate_up, down, kernels=(kernel, kernel))
    except Exception as exc:  # a candidate that cannot pack here is left out, not fatal
        _log.warning("moe kernel selection: %s failed to pack (%s: %s); left out", kernel.name,
                     type(exc).__name__, exc)
        return None, None
    num_experts, hidden = gate_up.shape[0], gate_up.shape[2]

    def timed(family: str, tokens: int) -> float:
        x, weights, ids = _routing(tokens, num_experts, top_k, gate_up.dtype, hidden, tokens)
        return timer(f"{family}:{kernel.name}:{tokens}",
                     lambda: run_experts(x, weights, ids, experts))

    found = []
    for family, sizes in (("moe_decode", DECODE_TOKENS), ("moe_prefill", (PREFILL_ROWS,))):
        try:
            found.append(sum(timed(family, tokens) for tokens in sizes))
        except Exception as exc:  # as above: logged, left out
            _log.warning("moe kernel selection: %s (%s) failed (%s: %s); left out",
                         kernel.name, family, type(exc).__name__, exc)
            found.append(None)
    return found[0], found[1]


def measure_experts(gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                    candidates: Sequence[GroupedKernel], timer: Timer = median_time,
                    ) -> dict[str, dict[str, float | None]]:
    """{"moe_decode": {kernel: s}, "moe_prefill": {kernel: s}}: decode is the sum over
    `DECODE_TOKENS` of a `run_experts` call, prefill one call of `PREFILL_ROWS` tokens; each
    candidate packs the experts for itself first (not timed) and drops them after."""
    decode: dict[str, float | None] = {}
    prefill: dict[str, float | None] = {}
    for kernel in candidates:
        decode[kernel.name], prefill[kernel.name] = _time_kernel(kernel, gate_up, down, top_k,
                                                                 timer)
    return {"moe_decode": decode, "moe_prefill": prefill}


def _fixed(mode: str, gate_up: torch.Tensor, top_k: int) -> MoEKernelChoice:
    name = LOOP.name
    if mode == "native":
        linear = select_linear_kernel(gate_up)
        name = LOOP.name if linear is None else grouped_kernel(linear.name).name
    return MoEKernelChoice(mode, name, name, top_k)


def choose_moe_kernels(mode: str, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, *,
                       cache_dir: str | os.PathLike[str] | None = None,
                       timer: Timer = median_time,
                       load: Callable[[], MachineLoad] = machine_load) -> MoEKernelChoice:
    """The grouped kernels for experts like ``gate_up`` / ``down`` on this machine.

    Args:
        mode: ``auto`` (measured, cached), ``native`` (by the CPU's features) or ``torch``.
        gate_up, down: one layer's experts as this rank holds them, dense ([E, 2I, H],
            [E, H, I]); they are timed as they are (the model's own weights).
        top_k: experts per token.
        cache_dir: where measurements are kept; None: measure every time.
        timer: ``timer(label, fn) -> seconds`` (tests inject timings through it; labels
            ``moe_decode:<kernel>:<tokens>`` and ``moe_prefill:<kernel>:<tokens>``).
        load: the machine's load just before timing (a busy machine: provisional).

    Raises:
        ValueError: an unknown mode, or top_k outside 1..E.
        OpsShapeError: the weights are not [E, 2I, H] and [E, H, I].
    """
    if mode not in MODES:
        raise ValueError(f"kernels={mode!r}: the kernel choice is one of {', '.join(MODES)}")
    if not 1 <= top_k <= gate_up.shape[0]:
        raise ValueError(f"top_k={top_k} must be in 1..{gate_up.shape[0]} (the experts given)")
    pack_experts(gate_up, down)  # the shape check, before anything is timed
    if mode != "auto" or gate_up.device.type != "cpu":
        return _fixed("torch" if mode == "auto" else mode, gate_up, top_k)
    shapes = [["moe", *gate_up.shape, *down.shape, str(gate_up.dtype), top_k]]
    key = cache_key(mode, shapes, None)

    def measure() -> MoEKernelChoice:
        return _measure(key, gate_up, down, top_k, timer, load)

    if cache_dir is None:
        return measure()
    return cached_or_measured(cache_dir, key, measure, MoEKernelChoice.from_record)


def _measure(key: str, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, timer: Timer,
             load: Callable[[], MachineLoad]) -> MoEKernelChoice:
    under, at_s = load(), time.time()
    candidates = grouped_candidates(gate_up)
    timings = measure_experts(gate_up, down, top_k, candidates, timer)
    layouts = {k.name: k.layout for k in candidates}
    decode, prefill = one_layout(timings["moe_decode"], timings["moe_prefill"], layouts)
    ms = {family: {name: None if t is None else round(t * 1e3, 4) for name, t in times.items()}
          for family, times in timings.items()}
    at = datetime.datetime.fromtimestamp(at_s).astimezone().isoformat(timespec="seconds")
    return MoEKernelChoice("auto", decode, prefill, top_k, "measured", ms, key,
                           under.load_1m, under.num_cores, at, at_s, under.is_busy)
