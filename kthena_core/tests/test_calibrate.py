"""``kthena plan --calibrate``: fit the cost model to a recorded ``kthena bench serve`` run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from kthena_core.bench_record import CalibrationError, load_bench
from kthena_core.calibrate import fit_calibration
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


def test_cli_plan_json_carries_the_calibration(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path / "cache"))
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
    assert not (tmp_path / "cache" / "calibration").exists()  # a YAML topology is not this machine


def test_cli_reports_a_bad_calibration_file(tmp_path, capsys):
    assert main(["plan", "--calibrate", str(tmp_path / "nope.json")]) == 2
    assert "cannot read bench JSON" in capsys.readouterr().err


def test_the_docs_example_is_the_zen4_records_run_with_its_probe():
    from kthena_core.cpu_defaults import load_records

    docs = load_bench(Path(__file__).parents[2] / "docs" / "examples" / "bench_cpu_smollm2.json")
    probe = json.loads((Path(__file__).parents[2] / "docs" / "examples"
                        / "host_probe_zen4.json").read_text())
    record = next(r for r in load_records() if r.name == "zen4").bench
    assert docs["host_probe"] == probe == record["host_probe"] and not probe["provisional"]
    assert {k: v for k, v in docs["kthena"].items() if k != "c_speedup"} == record["kthena"]


# ---- physical factors and the calibration file ---------------------------------------------------
def _synthetic_bench(truth, topo=None):
    """A bench whose every figure is the cost model's own prediction with the factors `truth`."""
    from kthena_core.bench_record import bench_points
    from kthena_core.calibrate import predict
    from kthena_core.planner import Planner

    model, topo = load_model_spec("default"), topo or bench_host()
    dev = Planner(truth).device_figures(topo)
    bench = copy.deepcopy(load_bench(BENCH))
    values = {(p.case, p.quantity): predict(p, model, dev) for p in bench_points(bench, model)}
    k = bench["kthena"]
    k["a_batch1"] = {"ttft_s": values["a_batch1", "ttft_s"],
                     "decode_tok_s": 1 / values["a_batch1", "decode_step_s"]}
    k["b_offline"]["output_tok_s"] = values["b_offline", "throughput_tok_s"]
    for case in ("c_shared_prefix_reuse", "c_shared_prefix_no_reuse"):
        k[case]["total_s"] = 32 * 16 / values[case, "throughput_tok_s"]
    return bench


@pytest.mark.parametrize("truth", [(0.9, 0.35, 0.003), (0.2, 0.95, 0.0), (0.06, 0.1, 0.01)])
def test_factors_inside_the_physical_range_are_fitted_back(truth):
    import attrs

    from kthena_core.calibrate import EFFICIENCY_FLOOR
    from kthena_core.cost_model import CostParams

    params = CostParams(compute_efficiency=truth[0], memory_efficiency=truth[1], step_overhead_s=truth[2])
    cal = fit_calibration(_synthetic_bench(params), load_model_spec("default"), bench_host())
    assert attrs.astuple(cal.params) == pytest.approx(attrs.astuple(params), rel=1e-6, abs=1e-9)
    d = cal.to_dict()
    assert d["allowed"]["memory_efficiency"] == [EFFICIENCY_FLOOR, 1.0]
    assert d["relative_to"]["memory_bw"] == 10e9 and d["relative_to"]["peak_flops"] == 664.6e9


@pytest.mark.parametrize(("factor", "value"), [("memory_efficiency", 5.9), ("compute_efficiency", 3.0),
                                               ("memory_efficiency", 0.01)])
def test_an_unphysical_fit_is_refused_naming_the_factor(factor, value):
    from kthena_core.calibrate import EFFICIENCY_FLOOR, UnphysicalFitError
    from kthena_core.cost_model import CostParams

    truth = CostParams(**{"compute_efficiency": 0.5, "memory_efficiency": 0.5, "step_overhead_s": 0.0,
                          factor: value})
    with pytest.raises(UnphysicalFitError) as refused:
        fit_calibration(_synthetic_bench(truth), load_model_spec("default"), bench_host())
    message = str(refused.value)
    assert f"{factor} = {value:.4g}" in message
    assert f"allowed range [{EFFICIENCY_FLOOR:.4g}, 1]" in message and "10.00 GB/s" in message


def test_the_placeholder_bandwidth_is_refused_and_the_benchs_own_probe_fits():
    # The case: a bench fitted against a host whose bandwidth was a 10 GB/s placeholder
    # wants a memory efficiency far above 1. A bench that carries the probe of its own run is
    # fitted against that, whatever topology it is given.
    import attrs

    from kthena_core.calibrate import UnphysicalFitError

    bench = load_bench(Path(__file__).parents[2] / "docs" / "bench_serve.json")
    limits = bench["limits"]["machine"]
    without = {k: v for k, v in bench.items() if k not in ("limits", "host_probe")}
    with pytest.raises(UnphysicalFitError, match="memory_efficiency = "):
        fit_calibration(without, load_model_spec("default"), bench_host())
    cal = fit_calibration(bench, load_model_spec("default"), bench_host())
    assert 0.05 <= cal.params.memory_efficiency <= 1 and 0.05 <= cal.params.compute_efficiency <= 1
    assert cal.relative_to["memory_bw"] == pytest.approx(limits["bandwidth_gb_s"] * 1e9)
    assert "the bench's own limits probe" in cal.relative_to["device_source"]
    spec = attrs.evolve(bench_host().devices[0].spec, memory_bw=limits["bandwidth_gb_s"] * 1e9,
                        peak_flops={"bf16": limits["matmul_peak_gflop_s"] * 1e9,
                                    "fp32": limits["matmul_float32_gflop_s"] * 1e9})
    measured = Topology(devices=(Device(0, 0, 0, spec),), source="discovered:cpu")
    assert fit_calibration(without, load_model_spec("default"), measured).params == cal.params


def _with_probe(bench, *, memory_bw, bf16, threads=2, cpu=None):
    probe = {"memory_bw": memory_bw, "peak_flops": {"bf16": bf16, "fp32": bf16 / 2},
             "threads": threads, "cpu": cpu or {"model_name": "Test CPU", "family": "1",
                                                "model": "2"}}
    return {**bench, "host_probe": probe, "machine": {**bench["machine"], "torch_threads": threads}}


def test_a_bench_is_fitted_against_its_own_probe_on_any_machine():
    truth_host = bench_host()
    from kthena_core.cost_model import CostParams

    truth = CostParams(compute_efficiency=0.4, memory_efficiency=0.6, step_overhead_s=0.002)
    spec = truth_host.devices[0].spec
    bench = _with_probe(_synthetic_bench(truth), memory_bw=spec.memory_bw,
                        bf16=spec.peak_flops["bf16"])
    bench["host_probe"]["peak_flops"]["fp32"] = spec.peak_flops["fp32"]
    elsewhere = Topology(devices=(Device(0, 0, 0, DeviceSpec(
        name="cpu-host", kind="cpu", vendor="generic", memory_bytes=1 << 34, memory_bw=1e9,
        peak_flops={"bf16": 1e9, "fp32": 1e9}, link_kind="memory", link_bw=1e9)),))
    import attrs

    for topology in (truth_host, elsewhere):  # this machine's figures do not enter the fit
        cal = fit_calibration(bench, load_model_spec("default"), topology)
        assert attrs.astuple(cal.params) == pytest.approx(attrs.astuple(truth), rel=1e-6,
                                                          abs=1e-9)
        assert cal.cpu == {"model_name": "Test CPU", "family": "1", "model": "2"}
    # the probe's figures are per thread: on one thread, half of two threads' figures
    halved = _with_probe(bench, memory_bw=spec.memory_bw / 2, bf16=spec.peak_flops["bf16"] / 2,
                         threads=1)
    halved["host_probe"]["threads"] = 1
    halved["machine"]["torch_threads"] = 2  # the bench itself ran on two
    cal = fit_calibration(halved, load_model_spec("default"), elsewhere)
    assert cal.relative_to["memory_bw"] == pytest.approx(spec.memory_bw)


def test_a_malformed_bench_probe_is_named():
    bench = {**copy.deepcopy(load_bench(BENCH)), "host_probe": {"memory_bw": 1e9}}
    with pytest.raises(CalibrationError, match="host_probe: missing field 'peak_flops'"):
        fit_calibration(bench, load_model_spec("default"), bench_host(), source="b.json")


def test_a_calibration_of_another_cpu_is_refused_on_this_machine_by_name(tmp_path, capsys,
                                                                       monkeypatch):
    from kthena_core.calibration_file import find_calibration, save_calibration

    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path / "cache"))
    bench = _with_probe(load_bench(BENCH), memory_bw=50e9, bf16=350e9,
                        cpu={"model_name": "AMD EPYC", "family": "25", "model": "17"})
    cal = fit_calibration(bench, load_model_spec("default"), bench_host(), source="zen4.json")
    path = save_calibration(cal, tmp_path / "zen4-cal.json")
    zen3 = {"model_name": "AMD EPYC", "family": "25", "model": "1"}
    with pytest.raises(CalibrationError) as refused:
        find_calibration(str(path), None, this_machine=True, cpu=zen3)
    message = str(refused.value)
    assert message.startswith(f"--calibration {path}: field 'cpu': ")
    assert "AMD EPYC (family 25 model 17)" in message and "AMD EPYC (family 25 model 1)" in message
    assert find_calibration(str(path), None, this_machine=False, cpu=zen3).path == str(path)
    same = {"model_name": "AMD EPYC", "family": "25", "model": "17"}
    assert find_calibration(str(path), None, this_machine=True, cpu=same).path == str(path)
    # through the command line: one line, exit 2 (the probe file says which CPU this is)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"memory_bw": 25e9, "peak_flops": {"bf16": 20e9, "fp32": 130e9},
                                 "threads": 2, "cpu": zen3}))
    monkeypatch.setenv("KTHENA_HOST_PROBE", str(probe))
    assert main(["plan", "--topology", "auto:cores", "--calibration", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "field 'cpu'" in err and "family 25 model 17" in err


def test_plan_calibrate_with_another_cpus_bench_says_so_and_keeps_the_cache(tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path / "cache"))
    bench = _with_probe(load_bench(BENCH), memory_bw=50e9, bf16=350e9,
                        cpu={"model_name": "AMD EPYC", "family": "25", "model": "17"})
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"memory_bw": 25e9, "peak_flops": {"bf16": 20e9, "fp32": 130e9},
                                 "threads": 2, "cpu": {"model_name": "AMD EPYC", "family": "25",
                                                       "model": "1"}}))
    monkeypatch.setenv("KTHENA_HOST_PROBE", str(probe))
    assert main(["plan", "--topology", "auto:cores", "--calibrate",
                 str(tmp_path / "bench.json")]) == 0
    err = capsys.readouterr().err
    assert "ran on AMD EPYC (family 25 model 17), this machine is AMD EPYC (family 25 model 1)" in err
    assert "not written: it is another CPU's" in err
    assert not (tmp_path / "cache" / "calibration").exists()


def test_the_calibration_file_round_trips_and_is_checked(tmp_path):
    from kthena_core.calibrate import UnphysicalFitError
    from kthena_core.calibration_file import find_calibration, load_calibration, save_calibration

    cal = fit_calibration(load_bench(BENCH), load_model_spec("default"), bench_host(), source="b.json")
    path = save_calibration(cal, tmp_path / "cal.json")
    used = load_calibration(path)
    assert used.params == cal.params and used.to_json()["source"] == "b.json"
    assert used.to_json()["factors"]["memory_efficiency"] == cal.params.memory_efficiency
    with pytest.raises(CalibrationError, match="a `kthena bench serve` JSON"):
        load_calibration(BENCH)
    data = json.loads(path.read_text())
    data["factors"]["memory_efficiency"] = 5.93
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(UnphysicalFitError, match=r"memory_efficiency = 5.93 is outside"):
        load_calibration(tmp_path / "bad.json")
    # this machine's cached calibration applies to a plan on this machine only
    (tmp_path / "cache" / "calibration").mkdir(parents=True)
    from kthena_core.calibration_file import cached_calibration_path

    save_calibration(cal, cached_calibration_path(tmp_path / "cache"))
    cpu = cal.cpu  # the CPU the bench ran on is the one planned for
    assert find_calibration(None, tmp_path / "cache", this_machine=True, cpu=cpu).params == cal.params
    assert find_calibration(None, tmp_path / "cache", this_machine=False) is None
    assert find_calibration("none", tmp_path / "cache", this_machine=True, cpu=cpu) is None
    assert find_calibration(str(path), tmp_path / "cache", this_machine=False).path == str(path)


def test_plan_calibrate_writes_the_file_and_calibration_uses_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path / "cache"))
    topo = tmp_path / "host.yaml"
    topo.write_text(yaml.safe_dump(bench_host().to_dict()))
    out = tmp_path / "cal.json"
    assert main(["plan", "--topology", str(topo), "--calibrate", str(BENCH),
                 "--calibration-out", str(out), "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["calibration"]["file"] == str(out) and out.is_file()
    assert main(["plan", "--topology", str(topo), "--calibration", str(out), "--json"]) == 0
    used = json.loads(capsys.readouterr().out)
    assert used["calibration"]["file"] == str(out)
    assert used["cost_factors"] == fitted["cost_factors"] == fitted["calibration"]["factors"]
    assert used["estimate"] == fitted["estimate"]
    assert main(["plan", "--topology", str(topo), "--calibrate", str(BENCH), "--calibration",
                 str(out)]) == 2
    # kthena deploy k8s scores its plan with the file and says so in the header
    deploy = Path(__file__).parents[2] / "docs" / "deploy" / "smollm2-pd.yaml"
    assert main(["deploy", "k8s", "--config", str(deploy), "--calibration", str(out)]) == 0
    assert f"(calibration {out})" in capsys.readouterr().out


def _with_collectives(sizes):
    bench = copy.deepcopy(load_bench(BENCH))
    bench["collectives"] = {"hidden": 576, "dtype": "bfloat16", "ranks": 2, "backend": "gloo",
                            "sizes": sizes}
    return bench


def test_the_benchs_collectives_become_the_sp_factor_of_the_calibration(tmp_path):
    """(reduce_scatter + all_gather) / all_reduce per size, the median kept: SP is priced with
    what this machine's collectives cost; without them the factor stays the ring's 1.0."""
    from kthena_core.calibrate import UnphysicalFitError, factors_dict
    from kthena_core.calibration_file import load_calibration, save_calibration

    model = load_model_spec("default")
    sizes = {"2048": {"all_reduce": 0.010, "reduce_scatter": 0.012, "all_gather": 0.013},
             "8192": {"all_reduce": 0.040, "reduce_scatter": 0.044, "all_gather": 0.052},
             "4096": {"all_reduce": 0.020, "reduce_scatter": 0.030, "all_gather": 0.030}}
    cal = fit_calibration(_with_collectives(sizes), model, bench_host())
    assert cal.params.sp_collective_factor == pytest.approx(2.5)  # median of 2.5, 2.4, 3.0
    plain = fit_calibration(load_bench(BENCH), model, bench_host())
    assert plain.params.sp_collective_factor == 1.0 and "sp_collective_factor" not in \
        factors_dict(plain.params)
    # the other factors are the same fit either way
    assert factors_dict(cal.params) == {**factors_dict(plain.params), "sp_collective_factor": 2.5}
    used = load_calibration(save_calibration(cal, tmp_path / "cal.json"))
    assert used.params == cal.params
    assert used.to_json()["factors"]["sp_collective_factor"] == pytest.approx(2.5)
    data = json.loads((tmp_path / "cal.json").read_text())
    data["factors"]["sp_collective_factor"] = 0.2
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(UnphysicalFitError, match=r"sp_collective_factor = 0.2 is outside"):
        load_calibration(tmp_path / "bad.json")
    fast = {"2048": {"all_reduce": 0.010, "reduce_scatter": 0.001, "all_gather": 0.001}}
    with pytest.raises(UnphysicalFitError, match="sp_collective_factor"):
        fit_calibration(_with_collectives(fast), model, bench_host())
    skipped = copy.deepcopy(load_bench(BENCH))
    skipped["collectives"] = {"skipped": "one core: two ranks would share it"}
    assert fit_calibration(skipped, model, bench_host()).params.sp_collective_factor == 1.0


@pytest.mark.parametrize("sizes", [{}, {"2048": {"all_reduce": 0.0, "reduce_scatter": 1,
                                                  "all_gather": 1}},
                                   {"2048": {"all_reduce": 0.01}}])
def test_malformed_collectives_are_refused_by_name(sizes):
    with pytest.raises(CalibrationError, match=r"collectives\.sizes"):
        fit_calibration(_with_collectives(sizes), load_model_spec("default"), bench_host())
