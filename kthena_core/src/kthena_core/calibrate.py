"""Calibration: fit the cost model's efficiency factors to a ``kthena bench serve`` run.

The bench's engine cases become planner workloads on one device (the bench runs TP1)::

    a_batch1                  prompt 128, output 64, 1 sequence   -> TTFT, decode step time
    b_offline                 prompt 128, output 64, 32 sequences -> output tokens/s
    c_shared_prefix_reuse     prompt 544, output 16, 32 sequences,
                              hit rate = 1 - computed / (32 x 544) -> output tokens/s
    c_shared_prefix_no_reuse  the same with hit rate 0              -> output tokens/s

Every measured figure is turned into a time t_i (throughput T of c sequences: TPOT = c / T).
With u = 1 / compute_efficiency, v = 1 / memory_efficiency and o = step_overhead_s, the cost
model predicts each t_i as a sum of ``coef x max(u x flops / peak_flops, v x bytes / peak_bw) + o``
terms. Fixing which side of every max() wins makes t_i linear in (u, v, o), so the fit is:

    for every assignment of max() sides: solve min sum_i ((A_i . (u, v, o)) / t_i - 1)^2
    (numpy least squares on the relative residuals), with each of u and v free or pinned at a
    bound of its physical range and o free or 0; keep solutions with u, v > 0 and o >= 0, and
    return the physical one whose *true* model (with the max()) has the smallest sum of squared
    relative errors.

A factor no point constrains (e.g. u when every point is memory-bound) keeps its prior value.

**SP's collectives.** When the bench JSON carries ``collectives`` (``kthena bench serve``
times an all-reduce, a reduce-scatter and an all-gather of prompt-sized activations over two
ranks of the engine's backend on this machine), ``sp_collective_factor`` is their measured
ratio ``(reduce_scatter + all_gather) / all_reduce``, the median over the sizes timed, instead
of the ring's 1.0: the planner then prices sequence parallelism with what this machine's
collectives cost. Its physical range is [SP_FACTOR_FLOOR, SP_FACTOR_CEIL]: the two halves of an
all-reduce cannot together cost less than half of it, and a ratio past the ceiling is a timing
disturbed by other work, not the collectives.

**Physical factors.** The peaks are the topology's: on a CPU host, what the host probe measured
(``kthena_core.discovery.host_probe``). An efficiency is achieved / peak, so a fit is kept only
when each factor lies in its physical range::

    compute_efficiency   [EFFICIENCY_FLOOR, 1.0]   of the measured matmul peak
    memory_efficiency    [EFFICIENCY_FLOOR, 1.0]   of the measured memory bandwidth
    step_overhead_s      [0, the smallest measured time]

The fit pins a factor that would leave its range at the bound. When that pinned fit's largest
relative error is more than PINNING_TOLERANCE (10 points) worse than the unconstrained fit's,
only an unphysical factor explains the measurements: above 1.0 the peak it is relative to is too
low (a placeholder, or a probe on fewer threads than the bench ran), below the floor the cost
model misses a cost the bench paid. The factor would then describe an error, not the machine,
so the fit is refused with the factor, its value and its range (`UnphysicalFitError`), and
nothing is written.

**The bench's own probe.** A ``kthena bench serve`` JSON carries the host probe of its own run
(``host_probe``; older ones only the limits probe, ``limits.machine``), and the fit is relative to
those figures, scaled to the bench's threads (`bench_topology`), not to the probe of the machine
that fits it: a bench from another CPU fits as it fitted there. The calibration records that CPU
(``cpu``: model name, family, model). Planning this machine with a calibration file of another
CPU is refused by name (`check_cpu`); ``kthena bench layouts`` applying a bench of another CPU
says so, naming both.

**The calibration file** (`save_calibration`, `load_calibration`) is the fit's JSON
(``Calibration.to_dict``: factors, allowed ranges, the peaks they are relative to, residuals)
plus ``"kind": "kthena calibration"``. ``kthena plan --calibrate`` writes it to the cache for
this machine (`cached_calibration_path`: ``<cache_dir>/calibration/<CPU key>.json``) or to
``--calibration-out``; ``kthena plan``, ``kthena serve --config`` and ``kthena deploy k8s``
read it with ``--calibration FILE`` or, for a plan on this machine's discovered topology, from
the cache (`find_calibration`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kthena_core.cost_model import (
    CostParams,
    DeviceFigures,
    Links,
    decode_step,
    decode_work,
    estimate_colocated,
    prefill_time,
    prefill_work,
)
from kthena_core.layout import Layout
from kthena_core.model_spec import ModelSpec
from kthena_core.planner import Planner
from kthena_core.topology import Topology
from kthena_core.workload import Workload

if TYPE_CHECKING:
    from kthena_core.discovery.host_probe import HostFigures

__all__ = ["EFFICIENCY_FLOOR", "SP_FACTOR_CEIL", "SP_FACTOR_FLOOR", "BenchPoint", "Calibration",
           "CalibrationError", "CalibrationFile", "UnphysicalFitError", "bench_cpu",
           "bench_points", "bench_probe", "bench_topology", "cached_calibration_path",
           "check_cpu", "check_physical", "cpu_text", "factors_dict", "find_calibration",
           "fit_calibration", "is_this_machine", "load_bench", "load_calibration",
           "planning_cpu", "same_cpu", "save_calibration", "sp_collective_factor"]

# The lowest efficiency a fit may give (achieved / measured peak). A small model's kernels reach
# a fair share of a CPU's peak (kthena bench serve's fraction_of_limit: 0.27-0.97 on this
# project's hosts); 5% is far below any of them, so a factor under it means the cost model
# misses a cost, not that the hardware is that slow.
EFFICIENCY_FLOOR = 0.05
# A fit pinned to its physical ranges is kept unless its largest relative error is this much
# worse than the unconstrained fit's: then only an unphysical factor explains the measurements.
PINNING_TOLERANCE = 0.10
FILE_KIND = "kthena calibration"
_FACTORS = ("compute_efficiency", "memory_efficiency", "step_overhead_s")
SP_FACTOR = "sp_collective_factor"  # optional: present when the bench timed the collectives
SP_FACTOR_FLOOR, SP_FACTOR_CEIL = 0.5, 20.0

_ONE = Layout(1, 1, 1)
_NO_LINKS = Links(math.inf, 0.0, math.inf, 0.0, math.inf)
# case -> (prompt_len, output_len, concurrency), as bench.py runs them
_CASES = {"a_batch1": (128, 64, 1), "b_offline": (128, 64, 32),
          "c_shared_prefix_reuse": (544, 16, 32), "c_shared_prefix_no_reuse": (544, 16, 32)}


class CalibrationError(ValueError):
    """The bench JSON cannot calibrate this plan; the message names the field or the mismatch."""


class UnphysicalFitError(CalibrationError):
    """The best fit has a factor outside its physical range; the message names the factor, its
    value and the range."""


@attrs.frozen
class BenchPoint:
    """One measured figure of a bench case: quantity is "ttft_s", "decode_step_s" or "throughput_tok_s"."""

    case: str
    quantity: str
    workload: Workload
    measured: float


@attrs.frozen
class Calibration:
    """Fitted factors, where they came from, and predicted vs measured for every point."""

    params: CostParams
    source: str
    bench_machine: Mapping[str, Any]
    points: tuple[BenchPoint, ...]
    uncalibrated: tuple[float, ...]  # predictions with the prior params, one per point
    calibrated: tuple[float, ...]
    model: str = ""
    relative_to: Mapping[str, Any] = attrs.field(factory=dict)  # the peaks, and where from
    allowed: Mapping[str, tuple[float, float]] = attrs.field(factory=dict)
    cpu: Mapping[str, Any] = attrs.field(factory=dict)  # the CPU the bench ran on (`bench_cpu`)

    def to_dict(self) -> dict[str, Any]:
        rows = [{"case": p.case, "quantity": p.quantity, "measured": p.measured,
                 "predicted_uncalibrated": u, "predicted": c,
                 "rel_error_uncalibrated": u / p.measured - 1, "rel_error": c / p.measured - 1}
                for p, u, c in zip(self.points, self.uncalibrated, self.calibrated, strict=True)]
        return {"source": self.source, "model": self.model, "bench_machine": dict(self.bench_machine),
                "cpu": dict(self.cpu), "factors": factors_dict(self.params),
                "allowed": {k: list(v) for k, v in self.allowed.items()},
                "relative_to": dict(self.relative_to),
                "residuals": rows,
                "max_abs_rel_error": max(abs(r["rel_error"]) for r in rows)}


def factors_dict(params: CostParams) -> dict[str, float]:
    """The three fitted factors of ``params``, by name, and ``sp_collective_factor`` when it is
    not the ring's 1.0 (a calibration measured it)."""
    factors = {name: float(getattr(params, name)) for name in _FACTORS}
    if params.sp_collective_factor != 1.0:
        factors[SP_FACTOR] = float(params.sp_collective_factor)
    return factors


def sp_collective_factor(bench: Mapping[str, Any], *, where: str = "bench") -> float | None:
    """The median ``(reduce_scatter + all_gather) / all_reduce`` of the bench's ``collectives``
    (None: the bench did not time them).

    Raises:
        CalibrationError: ``collectives`` is there but malformed (the message names the field).
    """
    collectives = bench.get("collectives")
    if collectives is None or (isinstance(collectives, Mapping) and "skipped" in collectives):
        return None
    sizes = collectives.get("sizes") if isinstance(collectives, Mapping) else None
    if not isinstance(sizes, Mapping) or not sizes:
        raise CalibrationError(f"{where}: collectives.sizes: expected an object of timed sizes, "
                               f"got {sizes!r}")
    ratios = []
    for size, times in sizes.items():
        try:
            ratios.append((float(times["reduce_scatter"]) + float(times["all_gather"]))
                          / float(times["all_reduce"]))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise CalibrationError(f"{where}: collectives.sizes.{size}: expected positive "
                                   "seconds for all_reduce, reduce_scatter and all_gather, got "
                                   f"{times!r}") from None
    return float(np.median(ratios))


def _allowed(times: np.ndarray) -> dict[str, tuple[float, float]]:
    return {"compute_efficiency": (EFFICIENCY_FLOOR, 1.0),
            "memory_efficiency": (EFFICIENCY_FLOOR, 1.0),
            "step_overhead_s": (0.0, float(times.min()))}


def check_physical(params: CostParams, allowed: Mapping[str, tuple[float, float]], *,
                   where: str, peaks: str = "") -> None:
    """Refuse factors outside their physical range.

    Raises:
        UnphysicalFitError: names the first factor out of range, its value and the range.
    """
    for name, (low, high) in allowed.items():
        value = float(getattr(params, name))
        if low <= value <= high:
            continue
        if name == "step_overhead_s":
            unit, why = " s", "a fixed cost per step cannot exceed the fastest step measured"
        elif name == SP_FACTOR:
            unit, why = "", ("a reduce-scatter and an all-gather together cost at least half an "
                             "all-reduce; far more is a timing disturbed by other work")
        elif value > high:
            unit, why = " of the measured peak", ("the peak it is relative to is too low (a "
                                                  "placeholder, or a probe on fewer threads "
                                                  "than the bench ran)")
        else:
            unit, why = " of the measured peak", "the cost model misses a cost the bench paid"
        raise UnphysicalFitError(
            f"{where}: unphysical fit refused: {name} = {value:.4g} is outside the allowed "
            f"range [{low:.4g}, {high:.4g}]{unit}{f' ({peaks})' if peaks else ''}: {why}. "
            "Measure again (`kthena bench serve` on an idle machine), or plan with the default "
            "factors")


def load_bench(path: str | Path) -> dict[str, Any]:
    """Read a ``kthena bench serve`` JSON file.

    Raises:
        CalibrationError: unreadable file or not a JSON object.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"--calibrate {path}: cannot read bench JSON: {e}") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"--calibrate {path}: expected a JSON object from `kthena bench serve`")
    return data


def bench_points(bench: Mapping[str, Any], model: ModelSpec, *, where: str = "bench") -> tuple[BenchPoint, ...]:
    """The measured points of `bench`, checked against the model being planned.

    Raises:
        CalibrationError: not a ``kthena bench serve`` result, another model, a missing or
            non-positive field, or no engine cases.
    """
    if bench.get("bench") != "kthena serve":
        raise CalibrationError(f"{where}: 'bench' is {bench.get('bench')!r}; expected 'kthena serve' "
                               "(the JSON line `kthena bench serve` prints)")
    for key in ("model", "dtype", "kthena"):
        if key not in bench:
            raise CalibrationError(f"{where}: missing field {key!r}")
    _check_model(bench["model"], model, where)
    cases = bench["kthena"]
    if not isinstance(cases, Mapping) or not any(c in cases for c in _CASES):
        raise CalibrationError(f"{where}: 'kthena' holds no workloads; expected one of {', '.join(_CASES)}")
    points: list[BenchPoint] = []
    for case, (prompt, output, conc) in _CASES.items():
        if case in cases:
            points += _case_points(case, cases[case], Workload(prompt, output, conc, bench["dtype"],
                                                               bench["dtype"]), f"{where}: kthena.{case}")
    return tuple(points)


def _check_model(name: Any, model: ModelSpec, where: str) -> None:
    from kthena_core.known_models import load_model_spec

    try:
        ran = load_model_spec(str(name)).name
    except (ValueError, KeyError, OSError) as e:
        raise CalibrationError(f"{where}: cannot resolve the bench's model {name!r}: {e}") from None
    if ran != model.name:
        raise CalibrationError(f"{where}: the bench ran model {ran!r}, the plan is for {model.name!r}; "
                               "calibrate with a bench of the same model")


def _field(values: Any, key: str, where: str) -> float:
    if not isinstance(values, Mapping) or key not in values:
        raise CalibrationError(f"{where}: missing field {key!r}")
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise CalibrationError(f"{where}.{key}: expected a positive number, got {value!r}")
    return float(value)


def _case_points(case: str, values: Any, wl: Workload, where: str) -> list[BenchPoint]:
    if case == "a_batch1":
        return [BenchPoint(case, "ttft_s", wl, _field(values, "ttft_s", where)),
                BenchPoint(case, "decode_step_s", wl, 1.0 / _field(values, "decode_tok_s", where))]
    if case == "b_offline":
        return [BenchPoint(case, "throughput_tok_s", wl, _field(values, "output_tok_s", where))]
    total = _field(values, "total_s", where)
    if case == "c_shared_prefix_reuse":
        computed = _field(values, "computed_prompt_tokens", where)
        hit = min(max(0.0, 1 - computed / (wl.concurrency * wl.prompt_len)), 0.999)
        wl = attrs.evolve(wl, prefix_hit_rate=hit)
    return [BenchPoint(case, "throughput_tok_s", wl, wl.concurrency * wl.output_len / total)]


# ---- prediction ---------------------------------------------------------------------------------
def predict(point: BenchPoint, model: ModelSpec, dev: DeviceFigures) -> float:
    """The cost model's figure for `point` on one device with figures `dev`."""
    wl = point.workload
    if point.quantity == "ttft_s":
        return prefill_time(model, wl, _ONE, dev, _NO_LINKS)
    if point.quantity == "decode_step_s":
        return decode_step(model, wl, _ONE, dev, _NO_LINKS, wl.concurrency)[0]
    return estimate_colocated(model, wl, _ONE, dev, _NO_LINKS).throughput_tok_s


def _as_time(point: BenchPoint, value: float) -> float:
    """The figure as a time: throughput of c sequences -> TPOT = c / throughput."""
    return point.workload.concurrency / value if point.quantity == "throughput_tok_s" else value


def _terms(point: BenchPoint, model: ModelSpec) -> list[tuple[float, tuple[float, float]]]:
    """(coefficient, (flops, bytes)) of each max() term of the point's time; each term adds one o."""
    wl = point.workload
    prefill = prefill_work(model, wl, _ONE)
    decode = decode_work(model, wl, _ONE, wl.concurrency)
    if point.quantity == "ttft_s":
        return [(1.0, prefill)]
    if point.quantity == "decode_step_s":
        return [(1.0, decode)]
    # estimate_colocated: TPOT = step + batch x TTFT / output_len
    return [(1.0, decode), (wl.concurrency / wl.output_len, prefill)]


def fit_calibration(bench: Mapping[str, Any], model: ModelSpec, topology: Topology,
                    prior: CostParams | None = None, *, source: str = "bench") -> Calibration:
    """Fit compute_efficiency, memory_efficiency and step_overhead_s to `bench` (see module doc),
    within their physical ranges.

    Raises:
        CalibrationError: the bench JSON is invalid for this model, or no fit is possible.
        UnphysicalFitError: the measurements are explained only by a factor out of its range.
    """
    prior = prior or CostParams()
    points = bench_points(bench, model, where=source)
    topology = bench_topology(bench, topology, where=source)
    peak = Planner(CostParams(1.0, 1.0, prior.link_efficiency, prior.memory_utilization,
                              prior.runtime_reserve_bytes, 0.0)).device_figures(topology)
    terms = [_terms(p, model) for p in points]
    times = np.array([_as_time(p, p.measured) for p in points])
    base = Planner(prior).device_figures(topology)
    allowed = _allowed(times)
    best: dict[bool, tuple[float, float, CostParams]] = {}  # physical? -> (sq err, max err, params)
    for u, v, o in _candidates(terms, times, peak, prior):
        params = attrs.evolve(prior, compute_efficiency=1 / u, memory_efficiency=1 / v, step_overhead_s=o)
        dev = attrs.evolve(base, flops=peak.flops / u, memory_bw=peak.memory_bw / v, step_overhead=o)
        rel = [_as_time(p, predict(p, model, dev)) / t - 1 for p, t in zip(points, times, strict=True)]
        fit = (sum(r * r for r in rel), max(abs(r) for r in rel), params)
        physical = _is_physical(params, allowed)
        if physical not in best or fit[0] < best[physical][0]:
            best[physical] = fit
    if not best:
        raise CalibrationError(f"{source}: no positive efficiencies fit the measurements")
    relative_to = _relative_to(topology, peak)
    unphysical = best.get(False)
    if True not in best or (unphysical is not None and unphysical[0] < best[True][0]
                            and best[True][1] > unphysical[1] + PINNING_TOLERANCE):
        assert unphysical is not None
        check_physical(unphysical[2], allowed, where=source,
                       peaks=f"{peak.flops / 1e9:.1f} GFLOP/s, {peak.memory_bw / 1e9:.2f} GB/s: "
                             f"{relative_to['device_source']}")
    params = best[True][2]
    factor = sp_collective_factor(bench, where=source)
    if factor is not None:
        params = attrs.evolve(params, sp_collective_factor=factor)
        allowed = {**allowed, SP_FACTOR: (SP_FACTOR_FLOOR, SP_FACTOR_CEIL)}
        check_physical(params, {SP_FACTOR: allowed[SP_FACTOR]}, where=source)
    fitted = Planner(params).device_figures(topology)
    return Calibration(params, source, dict(bench.get("machine") or {}), points,
                       tuple(predict(p, model, base) for p in points),
                       tuple(predict(p, model, fitted) for p in points),
                       model.name, relative_to, allowed, bench_cpu(bench))


def _is_physical(params: CostParams, allowed: Mapping[str, tuple[float, float]]) -> bool:
    return all(low <= getattr(params, name) <= high for name, (low, high) in allowed.items())


def _relative_to(topology: Topology, peak: DeviceFigures) -> dict[str, Any]:
    spec = topology.devices[0].spec
    return {"topology": topology.source or topology.name, "device": spec.name,
            "device_source": spec.source, "peak_flops": peak.flops, "memory_bw": peak.memory_bw}


def _candidates(terms: list[list[tuple[float, tuple[float, float]]]], times: np.ndarray,
                peak: DeviceFigures, prior: CostParams):
    """(u, v, o) least-squares solutions, one per assignment of max() sides, with each of u and
    v free or pinned at a bound of its range (efficiency 1.0 or the floor) and o free or 0."""
    flat = [(i, c, f / peak.flops, b / peak.memory_bw) for i, ts in enumerate(terms) for c, (f, b) in ts]
    prior_x = {0: 1 / prior.compute_efficiency, 1: 1 / prior.memory_efficiency, 2: 0.0}
    pins = (None, 1.0, 1 / EFFICIENCY_FLOOR)
    for sides in itertools.product((0, 1), repeat=len(flat)):
        a = np.zeros((len(times), 3))
        for (i, c, xc, xm), side in zip(flat, sides, strict=True):
            a[i, side] += c * (xc if side == 0 else xm)
            a[i, 2] += c
        # pins only matter where the free fit leaves the physical range
        leaves = _leaves_range(a, times, prior_x)
        for pin_u, pin_v, pin_o in itertools.product(pins, pins, (None, 0.0)):
            if (pin_u, pin_v) != (None, None) and not leaves:
                continue
            fixed = {}
            for k, pin in ((0, pin_u), (1, pin_v), (2, pin_o)):
                if not a[:, k].any():  # no point constrains it: the prior's value
                    fixed[k] = prior_x[k]
                elif pin is not None:
                    fixed[k] = pin
            cols = [k for k in (0, 1, 2) if k not in fixed]
            rhs = times - sum(a[:, k] * x for k, x in fixed.items())
            sol = np.linalg.lstsq(a[:, cols] / times[:, None], rhs / times, rcond=None)[0] if cols else []
            x = {**fixed, **dict(zip(cols, sol, strict=True))}
            if x[0] > 0 and x[1] > 0 and x[2] >= 0:
                yield float(x[0]), float(x[1]), float(x[2])


def _leaves_range(a: np.ndarray, times: np.ndarray, prior_x: Mapping[int, float]) -> bool:
    """Whether the free fit of this side assignment puts u or v outside [1, 1 / floor]."""
    cols = [k for k in (0, 1, 2) if a[:, k].any()]
    rhs = times - sum(a[:, k] * prior_x[k] for k in (0, 1) if k not in cols)
    x = dict(zip(cols, np.linalg.lstsq(a[:, cols] / times[:, None], rhs / times, rcond=None)[0],
                 strict=True))
    return any(not 1.0 <= x[k] <= 1 / EFFICIENCY_FLOOR for k in (0, 1) if k in x)


# ---- the bench's own machine ---------------------------------------------------------------------
def bench_probe(bench: Mapping[str, Any], *, where: str = "bench") -> HostFigures | None:
    """The host probe of the bench's own run: its ``host_probe``, else its limits probe
    (``limits.machine``: bandwidth and matmul peaks at the model's shape, on its threads), else
    None (the bench recorded neither).

    Raises:
        CalibrationError: ``host_probe`` is there but malformed (the message names the field).
    """
    from kthena_core.discovery.host_probe import HostFigures, HostProbeError

    record = bench.get("host_probe")
    if record is not None:
        try:
            return HostFigures.from_dict(record, "the bench's own host probe",
                                         where=f"{where}: host_probe")
        except HostProbeError as e:
            raise CalibrationError(str(e)) from None
    limits = (bench.get("limits") or {}).get("machine") if isinstance(bench.get("limits"),
                                                                     Mapping) else None
    try:
        return HostFigures(float(limits["bandwidth_gb_s"]) * 1e9,
                           {"bf16": float(limits["matmul_peak_gflop_s"]) * 1e9,
                            "fp32": float(limits["matmul_float32_gflop_s"]) * 1e9},
                           int(limits.get("torch_threads") or 1),
                           source="the bench's own limits probe", cpu=bench_cpu(bench))
    except (KeyError, TypeError, ValueError):
        return None


def bench_cpu(bench: Mapping[str, Any]) -> dict[str, str]:
    """{"model_name", "family", "model"} of the CPU the bench ran on ("" where it does not say):
    from its host probe, else from ``machine.cpu`` and ``machine.cpu_isa`` ("family 25 model 1:
    ...")."""
    probe = bench.get("host_probe")
    if isinstance(probe, Mapping) and isinstance(probe.get("cpu"), Mapping) and probe["cpu"]:
        return {k: str(probe["cpu"].get(k, "")) for k in ("model_name", "family", "model")}
    machine = bench.get("machine") if isinstance(bench.get("machine"), Mapping) else {}
    found = re.match(r"family (\d+) model (\d+)", str(machine.get("cpu_isa") or ""))
    return {"model_name": str(machine.get("cpu") or ""),
            "family": found[1] if found else "", "model": found[2] if found else ""}


def same_cpu(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two CPU labels name the same CPU model (a field either leaves blank is not
    compared: an old bench that recorded no family cannot be told apart)."""
    return all(str(a.get(k) or "") == str(b.get(k) or "")
               for k in ("model_name", "family", "model") if a.get(k) and b.get(k))


def cpu_text(cpu: Mapping[str, Any]) -> str:
    """``AMD EPYC (family 25 model 17)``, or what the label holds."""
    name = cpu.get("model_name") or "an unnamed CPU"
    return (f"{name} (family {cpu['family']} model {cpu['model']})"
            if cpu.get("family") and cpu.get("model") else str(name))


def bench_topology(bench: Mapping[str, Any], topology: Topology, *,
                   where: str = "bench") -> Topology:
    """``topology``'s first device with the figures of the bench's own run: its probe's figures
    per thread times the threads the bench ran on (``machine.torch_threads``). Without a probe
    in the bench, ``topology`` as given (this machine's figures).

    Raises:
        CalibrationError: a malformed ``host_probe``.
    """
    probe = bench_probe(bench, where=where)
    if probe is None:
        return topology
    machine = bench.get("machine") if isinstance(bench.get("machine"), Mapping) else {}
    threads = int(machine.get("torch_threads") or probe.threads)
    bw, flops = probe.per_thread()
    device = topology.devices[0]
    spec = attrs.evolve(device.spec, memory_bw=bw * threads,
                        peak_flops={**dict(device.spec.peak_flops),
                                    **{k: v * threads for k, v in flops.items()}},
                        source=f"{threads} thread(s) of {probe.describe()}")
    return Topology(devices=(attrs.evolve(device, index=0, node=0, local_index=0, spec=spec),),
                    name=f"the bench's machine ({cpu_text(bench_cpu(bench))})",
                    source="bench:" + where)


def check_cpu(calibration: CalibrationFile, cpu: Mapping[str, Any]) -> None:
    """Refuse a calibration measured on another CPU model than ``cpu`` (this machine's).

    Raises:
        CalibrationError: names the file, its ``cpu`` field and both CPU models.
    """
    theirs = calibration.data.get("cpu")
    if isinstance(theirs, Mapping) and theirs and not same_cpu(theirs, cpu):
        raise CalibrationError(
            f"--calibration {calibration.path}: field 'cpu': it was measured on "
            f"{cpu_text(theirs)}, this machine is {cpu_text(cpu)}; its factors describe that "
            "CPU. Calibrate here (`kthena bench serve`, then `kthena plan --calibrate`), or "
            "plan with --calibration none")


# ---- the calibration file -----------------------------------------------------------------------
@attrs.frozen
class CalibrationFile:
    """A calibration read back: its factors over the default CostParams, and where it came from."""

    params: CostParams
    path: str
    data: Mapping[str, Any] = attrs.field(eq=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """What a plan reports as ``calibration``: the file, the bench it was fitted to, the
        factors used, their allowed ranges and the peaks they multiply."""
        return {"file": self.path, "source": self.data.get("source"), "model": self.data.get("model"),
                "created": self.data.get("created"), "factors": factors_dict(self.params),
                "allowed": self.data.get("allowed"), "relative_to": self.data.get("relative_to"),
                "max_abs_rel_error": self.data.get("max_abs_rel_error")}


def machine_key(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This machine's key for its cached calibration: the CPU model name and flags."""
    from kthena_core.discovery.host_probe import cpu_identity

    return hashlib.sha256(json.dumps(cpu_identity(cpuinfo)).encode()).hexdigest()[:20]


def cached_calibration_path(cache_dir: str | os.PathLike[str]) -> Path:
    """``<cache_dir>/calibration/<machine key>.json``: this machine's calibration."""
    return Path(cache_dir) / "calibration" / f"{machine_key()}.json"


def save_calibration(cal: Calibration, path: str | os.PathLike[str]) -> Path:
    """Write ``cal`` as a calibration file (atomically); returns the path."""
    path = Path(path)
    record = {"kind": FILE_KIND, **cal.to_dict(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": dict(cal.bench_machine)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    tmp.replace(path)
    return path


def load_calibration(path: str | os.PathLike[str]) -> CalibrationFile:
    """Read a calibration file and check its factors are physical.

    Raises:
        CalibrationError: unreadable, not a calibration file (a bench JSON is named as such),
            or a factor missing; ``UnphysicalFitError``: a factor outside its allowed range.
    """
    where = f"--calibration {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{where}: cannot read it: {e}") from None
    if not isinstance(data, dict) or data.get("kind") != FILE_KIND:
        hint = (" (this is a `kthena bench serve` JSON: fit it with `kthena plan --calibrate "
                "BENCH.json`, which writes the calibration file)"
                if isinstance(data, dict) and data.get("bench") == "kthena serve" else "")
        raise CalibrationError(f"{where}: not a calibration file: 'kind' is not {FILE_KIND!r}{hint}")
    factors = data.get("factors")
    values = {}
    for name in _FACTORS:
        value = factors.get(name) if isinstance(factors, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalibrationError(f"{where}: factors.{name}: expected a number, got {value!r}")
        values[name] = float(value)
    allowed = {"compute_efficiency": (EFFICIENCY_FLOOR, 1.0),
               "memory_efficiency": (EFFICIENCY_FLOOR, 1.0), "step_overhead_s": (0.0, math.inf)}
    if isinstance(factors, Mapping) and SP_FACTOR in factors:
        value = factors[SP_FACTOR]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalibrationError(f"{where}: factors.{SP_FACTOR}: expected a number, got "
                                   f"{value!r}")
        values[SP_FACTOR] = float(value)
        allowed[SP_FACTOR] = (SP_FACTOR_FLOOR, SP_FACTOR_CEIL)
    params = attrs.evolve(CostParams(), **values)
    check_physical(params, allowed, where=where)
    return CalibrationFile(params, str(path), data)


def planning_cpu(topology: Topology) -> dict[str, Any]:
    """The CPU a plan on ``topology`` is priced for: its host probe's (``topology.probe``; a
    ``KTHENA_HOST_PROBE`` file names another machine's), else this machine's."""
    from kthena_core.discovery.host_probe import cpu_label

    probe_cpu = (topology.probe or {}).get("cpu")
    return dict(probe_cpu) if isinstance(probe_cpu, Mapping) and probe_cpu else cpu_label()


def find_calibration(path: str | None, cache_dir: str | os.PathLike[str] | None,
                     this_machine: bool, *,
                     cpu: Mapping[str, Any] | None = None) -> CalibrationFile | None:
    """The calibration a plan uses: ``path`` when given ("none": no calibration); else, for a
    plan on this machine (``this_machine``: its topology is ``auto`` or ``auto:cores``), this
    machine's cached one when the cache holds one; else None. ``cpu``: the CPU the plan's
    figures are of (`planning_cpu`; default this machine's).

    Raises:
        CalibrationError: as `load_calibration`; for a plan on this machine, a calibration
            measured on another CPU model than ``cpu`` (`check_cpu`).
    """
    if path == "none":
        return None
    if path:
        found = load_calibration(path)
    elif cache_dir is None or not this_machine:
        return None
    else:
        cached = cached_calibration_path(cache_dir)
        if not cached.is_file():
            return None
        found = load_calibration(cached)
    if this_machine:
        from kthena_core.discovery.host_probe import cpu_label

        check_cpu(found, cpu_label() if cpu is None else cpu)
    return found


def is_this_machine(topology_spec: str) -> bool:
    """Whether a ``--topology`` / ``cluster.topology`` value discovers this machine."""
    return topology_spec in ("auto", "auto:cores")
