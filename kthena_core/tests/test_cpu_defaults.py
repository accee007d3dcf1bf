"""Class defaults: the cost-model factors an uncalibrated plan takes on a CPU, fitted to the
benches recorded on the CPUs this project measured (``kthena_core/cpu_records``)."""

from __future__ import annotations

import attrs
import pytest

from kthena_core.cost_model import CostParams
from kthena_core.cpu_defaults import (
    default_factors,
    fit_record,
    load_records,
    plan_factors,
    record_errors,
)
from kthena_core.topology import from_catalog

# TPOT and TTFT: the figures a plan predicts for a user (throughput of c sequences is c / TPOT)
SERVED = ("a_batch1.ttft_s", "a_batch1.decode_step_s", "b_offline.throughput_tok_s")


def test_every_record_carries_its_runs_probe_and_its_stored_fit_is_the_fit(cpu_profile):
    record, _ = cpu_profile
    stored = record.bench["fit"]
    refit = fit_record(record)
    assert {k: getattr(refit, k) for k in stored} == pytest.approx(stored, rel=1e-6, abs=1e-9)


def test_the_class_default_predicts_tpot_and_ttft_within_2x_on_every_recorded_cpu(cpu_profile):
    record, _ = cpu_profile
    found = default_factors({**record.cpu, "isa_class": record.isa_class})
    assert found.origin == "record" and found.records == (record.name,)
    errors = record_errors(record, found.params)
    for name in SERVED:
        ratio = 1 + errors[name]
        assert 0.5 <= ratio <= 2, (record.name, name, ratio)
    assert found.expected_error == pytest.approx(max(abs(e) for e in errors.values()))
    assert f"+-{found.expected_error:.0%}" in found.describe()


def test_the_generic_factors_miss_by_more_than_the_class_defaults():
    worst_generic = max(abs(e) for r in load_records()
                        for n, e in record_errors(r, CostParams()).items() if n in SERVED)
    worst_default = max(
        abs(e) for r in load_records()
        for n, e in record_errors(r, default_factors({**r.cpu, "isa_class": r.isa_class})
                                  .params).items() if n in SERVED)
    assert worst_default < worst_generic


def test_a_cpu_without_a_record_takes_its_isa_class_then_every_record():
    records = load_records()
    avx512 = sorted(r.name for r in records if r.isa_class == "x86-avx512-bf16")
    found = default_factors({"model_name": "Unrecorded", "family": "99", "model": "9",
                             "isa_class": "x86-avx512-bf16"})
    assert found.origin == "isa class" and sorted(found.records) == avx512
    fits = [fit_record(r) for r in records if r.name in avx512]
    assert found.params.memory_efficiency == pytest.approx(
        sorted(f.memory_efficiency for f in fits)[len(fits) // 2] if len(fits) % 2 else
        sum(sorted(f.memory_efficiency for f in fits)[len(fits) // 2 - 1:len(fits) // 2 + 1]) / 2)
    anything = default_factors({"model_name": "RISC-V", "isa_class": "riscv64"})
    assert anything.origin == "all records" and len(anything.records) == len(records)
    assert default_factors({"isa_class": "x86-avx2"}, records=()) is None


def test_a_plan_says_where_its_factors_came_from(cpu_profile, tmp_path):
    from kthena_core.bench_record import load_bench
    from kthena_core.calibrate import fit_calibration
    from kthena_core.calibration_file import load_calibration, save_calibration
    from kthena_core.config_plan import resolve_topology
    from kthena_core.known_models import load_model_spec

    record, probe = cpu_profile
    here = resolve_topology("auto:cores", probe_file=probe)
    factors = plan_factors(None, here, this_machine=True)
    assert factors.origin == "class default" and factors.default.records == (record.name,)
    assert factors.to_json()["expected_error"] == round(factors.default.expected_error, 4)
    catalog = plan_factors(None, from_catalog("atlas-800t-a2"), this_machine=False)
    assert catalog.origin == "built-in default" and catalog.params == CostParams()
    assert "expected error unknown" in catalog.describe()
    model = load_model_spec("default")
    cal = fit_calibration(load_bench(record.path), model, here, source=record.path)
    used = load_calibration(save_calibration(cal, tmp_path / "cal.json"))
    chosen = plan_factors(used, here, this_machine=True)
    assert chosen.origin == "calibration file" and chosen.to_json()["file"] == str(tmp_path / "cal.json")
    assert attrs.astuple(chosen.params) == attrs.astuple(used.params)
