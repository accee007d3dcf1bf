"""``kthena plan --calibrate``: fit the cost model to a recorded ``kthena bench serve`` run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from kthena_core.calibrate import CalibrationError, fit_calibration, load_bench
from kthena_core.cli import main
from kthena_core.hardware import DeviceSpec
from kthena_core.known_models import load_model_spec
from kthena_core.topology import Device, Topology

BENCH = Path(__file__).parent / "data" / "bench_cpu_smollm2.json"


def bench_host() -> Topology:
    """The 2-core AMD EPYC host the bench was recorded on, as CPU discovery described it."""
    spec = DeviceSpec(name="cpu-host", kind="cpu", vendor="AuthenticAMD", memory_bytes=25276059648,
                      memory_bw=10e9, peak_flops={"fp32": 332.3e9, "bf16": 664.6e9},
                      link_kind="memory", link_bw=10e9, link_latency=1e-6, pcie_bw=10e9)
    return Topology(devices=(Device(0, 0, 0, spec),), name="AMD EPYC", source="discovered:cpu")


def test_calibration_brings_every_recorded_point_within_25_percent():
    cal = fit_calibration(load_bench(BENCH), load_model_spec("default"), bench_host(), source=str(BENCH))
    d = cal.to_dict()
    assert {(r["case"], r["quantity"]) for r in d["residuals"]} == {
        ("a_batch1", "ttft_s"), ("a_batch1", "decode_step_s"), ("b_offline", "throughput_tok_s"),
        ("c_shared_prefix_reuse", "throughput_tok_s"), ("c_shared_prefix_no_reuse", "throughput_tok_s")}
    for row in d["residuals"]:
        assert abs(row["rel_error"]) <= 0.25, row
    # the defaults miss by more: calibration is doing the work
    assert max(abs(r["rel_error_uncalibrated"]) for r in d["residuals"]) > 0.5
    assert d["max_abs_rel_error"] <= 0.25
    assert set(d["factors"]) == {"compute_efficiency", "memory_efficiency", "step_overhead_s"}
    assert d["bench_machine"]["cpu"] == "AMD EPYC"


def test_fit_recovers_known_factors_from_synthetic_measurements():
    # Measurements produced by the model itself with chosen factors must be fitted back exactly.
    import attrs

    from kthena_core.calibrate import predict
    from kthena_core.cost_model import CostParams
    from kthena_core.planner import Planner

    model, topo = load_model_spec("default"), bench_host()
    truth = CostParams(compute_efficiency=0.3, memory_efficiency=0.7, step_overhead_s=0.005)
    cal = fit_calibration(load_bench(BENCH), model, topo)
    dev = Planner(truth).device_figures(topo)
    bench = copy.deepcopy(load_bench(BENCH))
    values = {(p.case, p.quantity): predict(p, model, dev) for p in cal.points}
    k = bench["kthena"]
    k["a_batch1"] = {"ttft_s": values["a_batch1", "ttft_s"], "decode_tok_s": 1 / values["a_batch1", "decode_step_s"]}
    k["b_offline"]["output_tok_s"] = values["b_offline", "throughput_tok_s"]
    for case in ("c_shared_prefix_reuse", "c_shared_prefix_no_reuse"):
        k[case]["total_s"] = 32 * 16 / values[case, "throughput_tok_s"]
    fitted = fit_calibration(bench, model, topo).params
    assert attrs.astuple(fitted) == pytest.approx(attrs.astuple(truth), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda b: b.pop("kthena"), "missing field 'kthena'"),
    (lambda b: b.update(model="llama-2-7b"), "the bench ran model 'llama-2-7b', the plan is for 'smollm2"),
    (lambda b: b.update(kthena={"c_speedup": 8.6}), "holds no workloads"),
    (lambda b: b["kthena"]["a_batch1"].pop("ttft_s"), "kthena.a_batch1: missing field 'ttft_s'"),
    (lambda b: b["kthena"]["b_offline"].update(output_tok_s=-1), "output_tok_s: expected a positive number"),
    (lambda b: b.update(bench="soak"), "expected 'kthena serve'"),
])
def test_invalid_bench_json_is_refused_by_name(edit, message):
    bench = copy.deepcopy(load_bench(BENCH))
    edit(bench)
    with pytest.raises(CalibrationError, match=message.replace("(", r"\(")):
        fit_calibration(bench, load_model_spec("default"), bench_host())


def test_unreadable_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(CalibrationError, match="expected a JSON object"):
        load_bench(bad)
    with pytest.raises(CalibrationError, match="cannot read bench JSON"):
        load_bench(tmp_path / "missing.json")


def test_cli_plan_json_carries_the_calibration(tmp_path, capsys):
    topo = tmp_path / "host.yaml"
    topo.write_text(yaml.safe_dump(bench_host().to_dict()))
    argv = ["plan", "--topology", str(topo), "--calibrate", str(BENCH),
            "--workload", "prompt_len=128,output_len=64,concurrency=32"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cal = out["calibration"]
    assert cal["source"] == str(BENCH) and cal["max_abs_rel_error"] <= 0.25
    assert all("predicted_uncalibrated" in r and "predicted" in r for r in cal["residuals"])
    # the plan is scored with the fitted factors: b_offline's workload gets b_offline's prediction
    b = next(r for r in cal["residuals"] if r["case"] == "b_offline")
    assert out["estimate"]["throughput_tok_s"] == pytest.approx(b["predicted"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "calibration from" in text and "uncalibrated" in text and "b_offline" in text


def test_cli_reports_a_bad_calibration_file(tmp_path, capsys):
    assert main(["plan", "--calibrate", str(tmp_path / "nope.json")]) == 2
    assert "cannot read bench JSON" in capsys.readouterr().err


def test_docs_example_is_the_recorded_fixture():
    docs = Path(__file__).parents[2] / "docs" / "examples" / "bench_cpu_smollm2.json"
    assert docs.read_bytes() == BENCH.read_bytes()
