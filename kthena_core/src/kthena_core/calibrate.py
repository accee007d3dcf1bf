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
    (numpy least squares on the relative residuals; o = 0 is also tried), keep solutions with
    u, v > 0 and o >= 0, and return the one whose *true* model (with the max()) has the smallest
    sum of squared relative errors.

A factor no point constrains (e.g. u when every point is memory-bound) keeps its prior value.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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

__all__ = ["BenchPoint", "Calibration", "CalibrationError", "bench_points", "fit_calibration",
           "load_bench"]

_ONE = Layout(1, 1, 1)
_NO_LINKS = Links(math.inf, 0.0, math.inf, 0.0, math.inf)
# case -> (prompt_len, output_len, concurrency), as bench.py runs them
_CASES = {"a_batch1": (128, 64, 1), "b_offline": (128, 64, 32),
          "c_shared_prefix_reuse": (544, 16, 32), "c_shared_prefix_no_reuse": (544, 16, 32)}


class CalibrationError(ValueError):
    """The bench JSON cannot calibrate this plan; the message names the field or the mismatch."""


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

    def to_dict(self) -> dict[str, Any]:
        rows = [{"case": p.case, "quantity": p.quantity, "measured": p.measured,
                 "predicted_uncalibrated": u, "predicted": c,
                 "rel_error_uncalibrated": u / p.measured - 1, "rel_error": c / p.measured - 1}
                for p, u, c in zip(self.points, self.uncalibrated, self.calibrated, strict=True)]
        return {"source": self.source, "bench_machine": dict(self.bench_machine),
                "factors": {"compute_efficiency": self.params.compute_efficiency,
                            "memory_efficiency": self.params.memory_efficiency,
                            "step_overhead_s": self.params.step_overhead_s},
                "residuals": rows,
                "max_abs_rel_error": max(abs(r["rel_error"]) for r in rows)}


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
    """Fit compute_efficiency, memory_efficiency and step_overhead_s to `bench` (see module doc).

    Raises:
        CalibrationError: the bench JSON is invalid for this model, or no fit is possible.
    """
    prior = prior or CostParams()
    points = bench_points(bench, model, where=source)
    peak = Planner(CostParams(1.0, 1.0, prior.link_efficiency, prior.memory_utilization,
                              prior.runtime_reserve_bytes, 0.0)).device_figures(topology)
    terms = [_terms(p, model) for p in points]
    times = np.array([_as_time(p, p.measured) for p in points])
    base = Planner(prior).device_figures(topology)
    best: tuple[float, CostParams] | None = None
    for u, v, o in _candidates(terms, times, peak, prior):
        params = attrs.evolve(prior, compute_efficiency=1 / u, memory_efficiency=1 / v, step_overhead_s=o)
        dev = attrs.evolve(base, flops=peak.flops / u, memory_bw=peak.memory_bw / v, step_overhead=o)
        err = sum((_as_time(p, predict(p, model, dev)) / t - 1) ** 2 for p, t in zip(points, times, strict=True))
        if best is None or err < best[0]:
            best = (err, params)
    if best is None:
        raise CalibrationError(f"{source}: no positive efficiencies fit the measurements")
    params = best[1]
    fitted = Planner(params).device_figures(topology)
    return Calibration(params, source, dict(bench.get("machine") or {}), points,
                       tuple(predict(p, model, base) for p in points),
                       tuple(predict(p, model, fitted) for p in points))


def _candidates(terms: list[list[tuple[float, tuple[float, float]]]], times: np.ndarray,
                peak: DeviceFigures, prior: CostParams):
    """(u, v, o) least-squares solutions, one per assignment of max() sides and o free / o = 0."""
    flat = [(i, c, f / peak.flops, b / peak.memory_bw) for i, ts in enumerate(terms) for c, (f, b) in ts]
    fixed = {0: 1 / prior.compute_efficiency, 1: 1 / prior.memory_efficiency}
    for sides in itertools.product((0, 1), repeat=len(flat)):
        a = np.zeros((len(times), 3))
        for (i, c, xc, xm), side in zip(flat, sides, strict=True):
            a[i, side] += c * (xc if side == 0 else xm)
            a[i, 2] += c
        for free_o in (True, False):
            cols = [k for k in (0, 1) if a[:, k].any()] + ([2] if free_o else [])
            rhs = times - sum(a[:, k] * fixed[k] for k in (0, 1) if k not in cols)
            sol, *_ = np.linalg.lstsq(a[:, cols] / times[:, None], rhs / times, rcond=None)
            x = {**fixed, 2: 0.0, **dict(zip(cols, sol, strict=True))}
            if x[0] > 0 and x[1] > 0 and x[2] >= 0:
                yield float(x[0]), float(x[1]), float(x[2])
