"""Calibration: fit the cost model's efficiency factors to a ``kthena bench serve`` run.

The bench's measured points (`kthena_core.bench_record`: TTFT, decode step time, output tokens/s
of its engine cases) are each turned into a time t_i (throughput T of c sequences: TPOT = c / T).
With u = 1 / compute_efficiency, v = 1 / memory_efficiency and o = step_overhead_s, the cost
model predicts each t_i as a sum of ``coef x max(u x flops / peak_flops, v x bytes / peak_bw) + o``
terms. Fixing which side of every max() wins makes t_i linear in (u, v, o), so the fit is:

    for every assignment of max() sides: solve min sum_i ((A_i . (u, v, o)) / t_i - 1)^2
    (numpy least squares on the relative residuals), with each of u and v free or pinned at a
    bound of its physical range and o free or 0; keep solutions with u, v > 0 and o >= 0, and
    return the physical one whose *true* model (with the max()) has the smallest sum of squared
    relative errors.

A factor no point constrains (e.g. u when every point is memory-bound) keeps its prior value.

**SP's collectives.** When the bench timed them (`bench_record.sp_collective_factor`),
``sp_collective_factor`` is their measured ratio ``(reduce_scatter + all_gather) / all_reduce``
instead of the ring's 1.0: the planner then prices sequence parallelism with what this machine's
collectives cost. Its physical range is [SP_FACTOR_FLOOR, SP_FACTOR_CEIL]: the two halves of an
all-reduce cannot together cost less than half of it, and a ratio past the ceiling is a timing
disturbed by other work, not the collectives.

**Physical factors.** The peaks are the topology's: on a CPU host, what the host probe measured
(``kthena_core.discovery.host_probe``), or the bench's own probe scaled to its threads
(`bench_record.bench_topology`). An efficiency is achieved / peak, so a fit is kept only when
each factor lies in its physical range::

    compute_efficiency   [EFFICIENCY_FLOOR, 1.0]   of the measured matmul peak
    memory_efficiency    [EFFICIENCY_FLOOR, 1.0]   of the measured memory bandwidth
    step_overhead_s      [0, the smallest measured time]

The fit pins a factor that would leave its range at the bound. When that pinned fit's largest
relative error is more than PINNING_TOLERANCE (10 points) worse than the unconstrained fit's,
only an unphysical factor explains the measurements: above 1.0 the peak it is relative to is too
low (a placeholder, or a probe on fewer threads than the bench ran), below the floor the cost
model misses a cost the bench paid. The factor would then describe an error, not the machine,
so the fit is refused with the factor, its value and its range (`UnphysicalFitError`), and
nothing is written. A fit is written and read back by `kthena_core.calibration_file`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from kthena_core.bench_record import (
    BenchPoint,
    CalibrationError,
    bench_cpu,
    bench_points,
    bench_topology,
    sp_collective_factor,
)
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

__all__ = ["EFFICIENCY_FLOOR", "FITTED_FACTORS", "SP_FACTOR", "SP_FACTOR_CEIL", "SP_FACTOR_FLOOR",
           "Calibration", "UnphysicalFitError", "allowed_ranges", "check_physical",
           "factors_dict", "fit_calibration", "predict"]

# The lowest efficiency a fit may give (achieved / measured peak). A small model's kernels reach
# a fair share of a CPU's peak (kthena bench serve's fraction_of_limit: 0.27-0.97 on this
# project's hosts); 5% is far below any of them, so a factor under it means the cost model
# misses a cost, not that the hardware is that slow.
EFFICIENCY_FLOOR = 0.05
# A fit pinned to its physical ranges is kept unless its largest relative error is this much
# worse than the unconstrained fit's: then only an unphysical factor explains the measurements.
PINNING_TOLERANCE = 0.10
FITTED_FACTORS = ("compute_efficiency", "memory_efficiency", "step_overhead_s")
SP_FACTOR = "sp_collective_factor"  # optional: present when the bench timed the collectives
SP_FACTOR_FLOOR, SP_FACTOR_CEIL = 0.5, 20.0

_ONE = Layout(1, 1, 1)
_NO_LINKS = Links(math.inf, 0.0, math.inf, 0.0, math.inf)


class UnphysicalFitError(CalibrationError):
    """The best fit has a factor outside its physical range; the message names the factor, its
    value and the range."""


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
    factors = {name: float(getattr(params, name)) for name in FITTED_FACTORS}
    if params.sp_collective_factor != 1.0:
        factors[SP_FACTOR] = float(params.sp_collective_factor)
    return factors


def allowed_ranges(max_overhead_s: float) -> dict[str, tuple[float, float]]:
    """The physical range of each fitted factor; ``max_overhead_s`` caps the step overhead (a fit:
    the fastest step measured; a file read back: inf)."""
    return {"compute_efficiency": (EFFICIENCY_FLOOR, 1.0),
            "memory_efficiency": (EFFICIENCY_FLOOR, 1.0),
            "step_overhead_s": (0.0, max_overhead_s)}


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
    allowed = allowed_ranges(float(times.min()))
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
