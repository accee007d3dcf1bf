"""The calibration file: a fit written as JSON, read back, and found for a plan.

The file (`save_calibration`, `load_calibration`) is the fit's JSON (``Calibration.to_dict``:
factors, allowed ranges, the peaks they are relative to, residuals) plus ``"kind": "kthena
calibration"``. ``kthena plan --calibrate`` writes it to the cache for this machine
(`cached_calibration_path`: ``<cache_dir>/calibration/<CPU key>.json``) or to
``--calibration-out``; ``kthena plan``, ``kthena serve --config`` and ``kthena deploy k8s`` read
it with ``--calibration FILE`` or, for a plan on this machine's discovered topology, from the
cache (`find_calibration`).

A calibration belongs to the CPU that measured it (``cpu``: model name, family, model).
Planning this machine with a calibration file of another CPU is refused by name (`check_cpu`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kthena_core.bench_record import CalibrationError, cpu_text, same_cpu
from kthena_core.calibrate import (
    FITTED_FACTORS,
    SP_FACTOR,
    SP_FACTOR_CEIL,
    SP_FACTOR_FLOOR,
    Calibration,
    allowed_ranges,
    check_physical,
    factors_dict,
)
from kthena_core.cost_model import CostParams
from kthena_core.topology import Topology

__all__ = ["FILE_KIND", "CalibrationFile", "cached_calibration_path", "check_cpu",
           "find_calibration", "is_this_machine", "load_calibration", "machine_key",
           "planning_cpu", "save_calibration"]

FILE_KIND = "kthena calibration"


@attrs.frozen
class CalibrationFile:
    """A calibration read back: its factors over the default CostParams, and where it came from."""

    params: CostParams
    path: str
    data: Mapping[str, Any] = attrs.field(eq=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """What a plan reports as ``calibration``: the file, the bench it was fitted to, the
        factors used, their allowed ranges and the peaks they multiply."""
        return {"file": self.path, "source": self.data.get("source"),
                "model": self.data.get("model"), "created": self.data.get("created"), "factors": factors_dict(self.params),
                "allowed": self.data.get("allowed"), "relative_to": self.data.get("relative_to"),
                "max_abs_rel_error": self.data.get("max_abs_rel_error")}


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
        raise CalibrationError(f"{where}: not a calibration file: 'kind' is not "
                               f"{FILE_KIND!r}{hint}")
    factors = data.get("factors")
    values = {name: _number(factors, name, where) for name in FITTED_FACTORS}
    allowed = allowed_ranges(math.inf)
    if isinstance(factors, Mapping) and SP_FACTOR in factors:
        values[SP_FACTOR] = _number(factors, SP_FACTOR, where)
        allowed[SP_FACTOR] = (SP_FACTOR_FLOOR, SP_FACTOR_CEIL)
    params = attrs.evolve(CostParams(), **values)
    check_physical(params, allowed, where=where)
    return CalibrationFile(params, str(path), data)


def _number(factors: Any, name: str, where: str) -> float:
    value = factors.get(name) if isinstance(factors, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalibrationError(f"{where}: factors.{name}: expected a number, got {value!r}")
    return float(value)


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
