"""What calibration reads from a ``kthena bench serve`` JSON: its measured points, the machine it
ran on, and the collectives it timed.

The bench's engine cases become planner workloads on one device (the bench runs TP1)::

    a_batch1                  prompt 128, output 64, 1 sequence   -> TTFT, decode step time
    b_offline                 prompt 128, output 64, 32 sequences -> output tokens/s
    c_shared_prefix_reuse     prompt 544, output 16, 32 sequences,
                              hit rate = 1 - computed / (32 x 544) -> output tokens/s
    c_shared_prefix_no_reuse  the same with hit rate 0              -> output tokens/s

**The bench's own probe.** A bench JSON carries the host probe of its own run (``host_probe``;
older ones only the limits probe, ``limits.machine``), and a fit is relative to those figures,
scaled to the bench's threads (`bench_topology`), not to the probe of the machine that fits it:
a bench from another CPU fits as it fitted there. `bench_cpu` names that CPU (model name,
family, model); `same_cpu` and `cpu_text` compare and print such labels.

**SP's collectives.** When the bench carries ``collectives`` (an all-reduce, a reduce-scatter
and an all-gather of prompt-sized activations over two ranks of the engine's backend),
`sp_collective_factor` is their measured ratio ``(reduce_scatter + all_gather) / all_reduce``,
the median over the sizes timed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kthena_core.model_spec import ModelSpec
from kthena_core.topology import Topology
from kthena_core.workload import Workload

if TYPE_CHECKING:
    from kthena_core.discovery.host_probe import HostFigures

__all__ = ["BenchPoint", "CalibrationError", "bench_cpu", "bench_points", "bench_probe",
           "bench_topology", "cpu_text", "load_bench", "same_cpu", "sp_collective_factor"]

# case -> (prompt_len, output_len, concurrency), as bench.py runs them
_CASES = {"a_batch1": (128, 64, 1), "b_offline": (128, 64, 32),
          "c_shared_prefix_reuse": (544, 16, 32), "c_shared_prefix_no_reuse": (544, 16, 32)}


class CalibrationError(ValueError):
    """The bench JSON cannot calibrate this plan; the message names the field or the mismatch."""


@attrs.frozen
class BenchPoint:
    """One measured figure of a bench case: quantity is "ttft_s", "decode_step_s" or
    "throughput_tok_s"."""

    case: str
    quantity: str
    workload: Workload
    measured: float


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
        raise CalibrationError(f"--calibrate {path}: expected a JSON object from "
                               "`kthena bench serve`")
    return data


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


def bench_points(bench: Mapping[str, Any], model: ModelSpec, *,
                 where: str = "bench") -> tuple[BenchPoint, ...]:
    """The measured points of `bench`, checked against the model being planned.

    Raises:
        CalibrationError: not a ``kthena bench serve`` result, another model, a missing or
            non-positive field, or no engine cases.
    """
    if bench.get("bench") != "kthena serve":
        raise CalibrationError(f"{where}: 'bench' is {bench.get('bench')!r}; expected "
                               "'kthena serve' (the JSON line `kthena bench serve` prints)")
    for key in ("model", "dtype", "kthena"):
        if key not in bench:
            raise CalibrationError(f"{where}: missing field {key!r}")
    _check_model(bench["model"], model, where)
    cases = bench["kthena"]
    if not isinstance(cases, Mapping) or not any(c in cases for c in _CASES):
        raise CalibrationError(f"{where}: 'kthena' holds no workloads; expected one of "
                               f"{', '.join(_CASES)}")
    points: list[BenchPoint] = []
    for case, (prompt, output, conc) in _CASES.items():
        if case in cases:
            wl = Workload(prompt, output, conc, bench["dtype"], bench["dtype"])
            points += _case_points(case, cases[case], wl, f"{where}: kthena.{case}")
    return tuple(points)


def _check_model(name: Any, model: ModelSpec, where: str) -> None:
    from kthena_core.known_models import load_model_spec

    try:
        ran = load_model_spec(str(name)).name
    except (ValueError, KeyError, OSError) as e:
        raise CalibrationError(f"{where}: cannot resolve the bench's model {name!r}: {e}") from None
    if ran != model.name:
        raise CalibrationError(f"{where}: the bench ran model {ran!r}, the plan is for "
                               f"{model.name!r}; calibrate with a bench of the same model")


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
