"""Default cost-model factors per CPU, taken from the benches recorded on the CPUs this project
has measured.

An uncalibrated plan priced with `CostParams`' generic factors was 4x off on a 2-core Zen 3
(TPOT 632 ms predicted against 153 ms measured). The records in ``cpu_records/*.json`` are
``kthena bench serve`` JSONs of the default model, one per measured CPU, each with the host probe
of its own run (a ``host_probe``, or for older ones the limits probe ``limits.machine``) and a
``record`` object naming the CPU (``cpu``: model name, family, model; ``isa_class``) and where the
figures come from. `default_factors` chooses the factors for a CPU::

    1. a record of the same CPU model (name, family and model): the factors fitted to it
       (``kthena_core.calibrate.fit_calibration``, against its own probe; stored in the
       record's ``fit`` by ``scripts/cpu_record.py``, and refitted by a test);
    2. else the records of the same ISA class (``discovery.host_probe.isa_class``): the median
       of their fits;
    3. else every record: the median of their fits.

The factors multiply the figures of the probe being planned with, so a class default follows the
machine's own measured peaks. ``expected_error`` is the largest relative error of the chosen
factors over the records they came from (TTFT, decode step and throughput of each, predicted with
that record's probe): what an uncalibrated prediction on such a CPU is expected to miss by, at
best. A CPU the records do not hold is expected to miss by more; only `kthena plan --calibrate`
on the machine itself removes that.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kthena_core.bench_record import (
    BenchPoint,
    bench_points,
    bench_probe,
    bench_topology,
    cpu_text,
    same_cpu,
)
from kthena_core.calibrate import fit_calibration, predict
from kthena_core.calibration_file import CalibrationFile, planning_cpu
from kthena_core.cost_model import CostParams
from kthena_core.hardware import cpu_host_spec
from kthena_core.model_spec import ModelSpec
from kthena_core.topology import Device, Topology

__all__ = ["CALIBRATE_COMMAND", "RECORDS_DIR", "CpuRecord", "FactorDefault", "PlanFactors",
           "default_factors", "fit_record", "load_records", "plan_factors", "record_errors"]

# What removes the error of an uncalibrated plan: a bench of the default model on the machine,
# fitted and written to its cache (later plans on the machine take it).
CALIBRATE_COMMAND = "kthena bench serve --no-hf > bench.json && kthena plan --calibrate bench.json"

RECORDS_DIR = Path(__file__).parent / "cpu_records"
_FITTED = ("compute_efficiency", "memory_efficiency", "step_overhead_s")


@attrs.frozen
class CpuRecord:
    """One recorded CPU: its bench JSON (with the run's own probe) and the file it came from."""

    name: str
    cpu: Mapping[str, Any]
    isa_class: str
    bench: Mapping[str, Any] = attrs.field(repr=False)
    path: str = ""


@attrs.frozen
class FactorDefault:
    """The factors an uncalibrated plan on a CPU takes, and why.

    Attributes:
        params: the cost model's factors.
        origin: ``record`` (this CPU model was measured), ``isa class`` or ``all records``.
        records: the names of the records they come from.
        expected_error: the largest |predicted / measured - 1| of these factors over those
            records.
        cpu: the CPU they were chosen for.
    """

    params: CostParams
    origin: str
    records: tuple[str, ...]
    expected_error: float
    cpu: Mapping[str, Any]

    def describe(self) -> str:
        f = self.params
        return (f"class default for {cpu_text(self.cpu)} ({self.origin}: "
                f"{', '.join(self.records)}): compute_efficiency {f.compute_efficiency:.3g}, "
                f"memory_efficiency {f.memory_efficiency:.3g}, step_overhead_s "
                f"{f.step_overhead_s:.3g}; expected error of an uncalibrated prediction "
                f"+-{self.expected_error:.0%} on those records, more on another CPU")

    def to_json(self) -> dict[str, Any]:
        return {"origin": "class default", "chosen_by": self.origin, "records": list(self.records),
                "cpu": dict(self.cpu), "expected_error": round(self.expected_error, 4),
                "factors": {k: float(getattr(self.params, k)) for k in _FITTED}}


def load_records(folder: Path = RECORDS_DIR) -> tuple[CpuRecord, ...]:
    """Every record in ``folder``, by name."""
    out = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        record = data["record"]
        out.append(CpuRecord(record["name"], record["cpu"], record["isa_class"], data, str(path)))
    return tuple(out)


def _record_topology(record: CpuRecord) -> Topology:
    """A one-device topology for the fit: its figures are replaced by the record's own probe
    (``bench_record.bench_topology``)."""
    probe = bench_probe(record.bench, where=record.path)
    assert probe is not None, f"{record.path}: a record carries its run's probe"
    spec = cpu_host_spec(probe.threads, 24 << 30, memory_bw=probe.memory_bw,
                         peak_flops=probe.peak_flops, name="cpu-host", source=probe.describe())
    return Topology(devices=(Device(0, 0, 0, spec),), name=record.name, source="record")


@functools.cache
def _run(path: str) -> tuple[tuple[BenchPoint, ...], ModelSpec, Topology]:
    """The record's measured points, its model, and the topology of its run (its probe)."""
    from kthena_core.known_models import load_model_spec

    record = _by_path(path)
    model = load_model_spec(str(record.bench["model"]))
    topology = bench_topology(record.bench, _record_topology(record), where=record.path)
    return bench_points(record.bench, model, where=path), model, topology


def _by_path(path: str) -> CpuRecord:
    return next(r for r in load_records(Path(path).parent) if r.path == path)


def fit_record(record: CpuRecord) -> CostParams:
    """The factors fitted to ``record`` against its own probe (``calibrate.fit_calibration``):
    what its ``fit`` object holds (``scripts/cpu_record.py`` writes it; a test refits it)."""
    _, model, topology = _run(record.path)
    return fit_calibration(record.bench, model, topology, source=record.path).params


def _fitted(record: CpuRecord) -> CostParams:
    stored = record.bench.get("fit")
    if isinstance(stored, Mapping):
        return attrs.evolve(CostParams(), **{k: float(stored[k]) for k in _FITTED})
    return fit_record(record)


def record_errors(record: CpuRecord, params: CostParams) -> dict[str, float]:
    """``case.quantity`` -> predicted / measured - 1 of ``params`` on ``record`` (its probe)."""
    from kthena_core.planner import Planner

    points, model, topology = _run(record.path)
    figures = Planner(params).device_figures(topology)
    return {f"{p.case}.{p.quantity}": predict(p, model, figures) / p.measured - 1
            for p in points}


def default_factors(cpu: Mapping[str, Any], *,
                    records: tuple[CpuRecord, ...] | None = None) -> FactorDefault | None:
    """The factors for ``cpu`` ({"model_name", "family", "model", "isa_class"}), by the rule of
    the module docstring; None when there are no records."""
    records = load_records() if records is None else records
    if not records:
        return None
    exact = [r for r in records if cpu.get("family") and cpu.get("model") and same_cpu(r.cpu, cpu)]
    same_isa = [r for r in records if r.isa_class == cpu.get("isa_class")]
    chosen, origin = ((exact[:1], "record") if exact else (same_isa, "isa class") if same_isa
                      else (list(records), "all records"))
    fits = [_fitted(r) for r in chosen]
    params = attrs.evolve(CostParams(), **{k: statistics.median(getattr(f, k) for f in fits)
                                           for k in _FITTED})
    error = max(abs(e) for r in chosen for e in record_errors(r, params).values())
    return FactorDefault(params, origin, tuple(r.name for r in chosen), error, dict(cpu))


@attrs.frozen
class PlanFactors:
    """The cost-model factors a plan is scored with, and where they came from.

    Attributes:
        params: the factors.
        origin: ``calibration file``, ``class default`` (`default_factors`, for a plan on this
            machine without a calibration) or ``built-in default`` (`CostParams`' generic
            guesses: another topology, or no record at all).
        calibration: the calibration file, for ``calibration file``.
        default: the class default, for ``class default``.
    """

    params: CostParams
    origin: str
    calibration: CalibrationFile | None = None
    default: FactorDefault | None = None

    def describe(self) -> str:
        """One line for ``kthena plan`` and ``kthena serve``."""
        if self.calibration is not None:
            f = self.params
            return (f"calibration file {self.calibration.path} (fitted to "
                    f"{self.calibration.data.get('source')}): compute_efficiency "
                    f"{f.compute_efficiency:.3g}, memory_efficiency {f.memory_efficiency:.3g}, "
                    f"step_overhead_s {f.step_overhead_s:.3g}")
        if self.default is not None:
            return f"uncalibrated: {self.default.describe()}; {self.calibrate_hint()}"
        f = self.params
        values = (f"compute_efficiency {f.compute_efficiency:.3g}, memory_efficiency "
                  f"{f.memory_efficiency:.3g}, step_overhead_s {f.step_overhead_s:.3g}")
        if self.origin == "built-in default":
            return (f"uncalibrated: built-in default ({values}: generic guesses, not measured on "
                    "any CPU; expected error unknown, a CPU plan was seen 4x off); "
                    f"{self.calibrate_hint()}")
        return f"{self.origin}: {values}"

    @property
    def is_calibrated(self) -> bool:
        """Whether the factors were fitted to a bench (a calibration file)."""
        return self.calibration is not None

    def prediction_note(self) -> str | None:
        """What a plan's predictions are worth when uncalibrated (one line), or None."""
        if self.is_calibrated or self.origin not in ("class default", "built-in default"):
            return None
        error = (f"expected error +-{self.default.expected_error:.0%} on the recorded CPUs "
                 f"({', '.join(self.default.records)}), more on another CPU"
                 if self.default is not None else "expected error unknown (a CPU plan was "
                 "seen 4x off)")
        return f"uncalibrated: {error}; {self.calibrate_hint()}"

    @staticmethod
    def calibrate_hint() -> str:
        return f"to calibrate on the machine planned for: {CALIBRATE_COMMAND}"

    def to_json(self) -> dict[str, Any]:
        """What a plan's JSON carries as ``factors``."""
        out: dict[str, Any] = {"origin": self.origin,
                               "factors": {k: float(getattr(self.params, k)) for k in _FITTED}}
        if self.calibration is not None:
            out["file"] = self.calibration.path
        if self.default is not None:
            out |= self.default.to_json()
        return out


def plan_factors(calibration: CalibrationFile | None, topology: Topology,
                 this_machine: bool) -> PlanFactors:
    """The factors a plan takes: the calibration file when there is one; else, for a plan on
    this machine's discovered CPU, the class default of the CPU its probe ran on
    (``topology.probe``'s ``cpu``, which is this CPU unless ``KTHENA_HOST_PROBE`` names another
    one's probe); else `CostParams`' defaults."""
    if calibration is not None:
        return PlanFactors(calibration.params, "calibration file", calibration=calibration)
    if this_machine and topology.devices[0].spec.kind == "cpu":
        from kthena_core.discovery.host_probe import cpu_label

        here, cpu = cpu_label(), planning_cpu(topology)
        if not cpu.get("isa_class") and same_cpu(cpu, here):  # a probe cached without it
            cpu = {**cpu, "isa_class": here["isa_class"]}
        found = default_factors(cpu)
        if found is not None:
            return PlanFactors(found.params, "class default", default=found)
    return PlanFactors(CostParams(), "built-in default")
