"""``kthena bench layouts``: layouts, summaries, predictions, the JSON and table, and one tiny run.

Timings are never asserted; the end-to-end run checks the shape of what it reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from kthena_core.bench_record import load_bench
from kthena_core.cost_model import CostParams
from kthena_core.discovery import CpuFacts, HostFigures, NumaNode, cpu_topology
from kthena_core.known_models import load_model_spec
from kthena_core.layout import Layout
from kthena_serve.bench.layouts import (
    MEASURES,
    LayoutBenchOptions,
    LayoutSpec,
    assemble,
    calibrate,
    format_table,
    parse_layouts,
    predict_layout,
    predictions,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "kthena_core/tests/data/bench_cpu_smollm2.json"
GiB = 1 << 30
# The host the recorded bench ran on: 2 AMD EPYC (Zen 4) cores, AVX-512 with bf16, 24 GiB.
FACTS = CpuFacts(model_name="AMD EPYC", num_cpus=2, num_cores=2, threads_per_core=1,
                 flags={"avx512f", "avx512_bf16", "avx2", "fma"}, clock_hz=2.6e9,
                 memory_bytes=24 * GiB, numa_nodes=(NumaNode(0, (0, 1)),))
# Its host probe, as `kthena bench serve`'s limits measured such a host (docs/bench_serve.json):
# the peaks the fitted efficiencies are fractions of.
HOST = HostFigures(50.48e9, {"bf16": 348.9e9, "fp32": 145.4e9}, threads=2)


def test_parse_layouts():
    assert parse_layouts("tp1,pp2,dp2") == (LayoutSpec("tp1"), LayoutSpec("pp2", Layout(1, pp=2)),
                                            LayoutSpec("dp2", Layout(1, dp=2)))
    assert parse_layouts(" tp2 , tp1pp2 ") == (LayoutSpec("tp2", Layout(2)),
                                               LayoutSpec("tp1pp2", Layout(1, pp=2)))
    assert parse_layouts("tp2pp2dp2")[0].layout.num_devices == 8


@pytest.mark.parametrize("text, pattern", [
    ("", "at least one"), ("pp", "not a layout"), ("tp2x", "not a layout"),
    ("tp1tp2", "not a layout"), ("pp0", ">= 1"), ("tp1,pp1", "repeats"),
])
def test_parse_layouts_refuses(text, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_layouts(text)


def test_summarize_takes_medians_and_keeps_the_runs():
    runs = [{"tpot_s": 3.0, "ttft_s": None}, {"tpot_s": 1.0, "ttft_s": 2.0}, {"tpot_s": 2.0, "ttft_s": 4.0}]
    out = summarize(runs)
    assert out["tpot_s"] == 2.0 and out["ttft_s"] == 3.0
    assert out["per_run"] == {"tpot_s": [3.0, 1.0, 2.0], "ttft_s": [None, 2.0, 4.0]}


@pytest.fixture(scope="module")
def setup():
    model = load_model_spec("default")
    cal = calibrate(load_bench(BENCH), model, FACTS, str(BENCH), HOST)
    return model, cal, cpu_topology(FACTS, host=HOST), cpu_topology(FACTS, per_core=True, host=HOST)


def test_predictions_use_the_host_for_one_rank_and_the_cores_for_several(setup):
    model, cal, host, cores = setup
    options = LayoutBenchOptions()
    out = {lay.name: predict_layout(model, lay, options, cal.params, host, cores)
           for lay in options.layouts}
    assert out["tp1"]["topology"] == "discovered:cpu"
    assert out["pp2"]["topology"] == out["dp2"]["topology"] == "discovered:cpu:per-core"
    for figures in out.values():
        assert figures["feasible"] and all(figures[k] > 0 for k in MEASURES)
    # Two replicas of one core each: the same work per token as tp1 on two cores, in parallel.
    assert out["dp2"]["throughput_tok_s"] > out["pp2"]["throughput_tok_s"]


def test_calibrated_tp1_batch1_reproduces_the_bench_it_was_fitted_to(setup):
    model, cal, host, cores = setup
    # Prompt 128 as the bench's case a: its TTFT is one of the fitted points.
    options = LayoutBenchOptions(output_len=64)
    tp1 = predict_layout(model, LayoutSpec("tp1"), options, cal.params, host, cores)
    fitted = {(p.case, p.quantity): c for p, c in zip(cal.points, cal.calibrated, strict=True)}
    assert tp1["batch1_ttft_s"] == pytest.approx(fitted[("a_batch1", "ttft_s")])
    assert tp1["batch1_tpot_s"] == pytest.approx(fitted[("a_batch1", "decode_step_s")])
    default = predict_layout(model, LayoutSpec("tp1"), options, CostParams(), host, cores)
    assert default["batch1_tpot_s"] != pytest.approx(tp1["batch1_tpot_s"])


def test_the_calibration_uses_the_bench_thread_count(setup):
    model, cal, *_ = setup
    one_thread = json.loads(BENCH.read_text())
    one_thread["machine"]["torch_threads"] = 1
    slower_device = calibrate(one_thread, model, FACTS, "one thread", HOST)
    # The same measurements on one core's figures (half the host's): efficiencies twice as high.
    assert slower_device.params.compute_efficiency == pytest.approx(2 * cal.params.compute_efficiency)
    assert slower_device.params.memory_efficiency == pytest.approx(2 * cal.params.memory_efficiency)
    assert slower_device.params.step_overhead_s == pytest.approx(cal.params.step_overhead_s)


def test_one_rank_is_calibrated_on_the_host_bench_several_on_the_one_thread_bench(setup):
    model, cal, host, cores = setup
    one_thread = json.loads(BENCH.read_text())
    one_thread["machine"]["torch_threads"] = 1
    cals = {"host": cal, "cores": calibrate(one_thread, model, FACTS, "one thread", HOST)}
    options = LayoutBenchOptions()
    tp1 = predictions(model, LayoutSpec("tp1"), options, cals, host, cores)
    pp2 = predictions(model, LayoutSpec("pp2", Layout(1, pp=2)), options, cals, host, cores)
    assert tp1["predicted_calibrated"]["calibration"] == str(BENCH)
    assert pp2["predicted_calibrated"]["calibration"] == "one thread"
    assert tp1["predicted_default"] == predict_layout(model, LayoutSpec("tp1"), options,
                                                      CostParams(), host, cores)
    # The same figures measured on one core instead of two: a core is predicted twice as fast.
    as_host = predict_layout(model, LayoutSpec("pp2", Layout(1, pp=2)), options, cal.params, host, cores)
    assert pp2["predicted_calibrated"]["throughput_tok_s"] > 1.5 * as_host["throughput_tok_s"]


def test_a_layout_larger_than_the_host_is_predicted_infeasible(setup):
    model, cal, host, cores = setup
    out = predict_layout(model, LayoutSpec("pp4", Layout(1, pp=4)), LayoutBenchOptions(), cal.params, host, cores)
    assert out == {"topology": "discovered:cpu:per-core", "feasible": False,
                   "reasons": ["4 ranks > 2 devices"]}


def _figures(scale: float) -> dict:
    return {"batch1_ttft_s": 0.2 * scale, "batch1_tpot_s": 0.03 * scale,
            "throughput_tok_s": 100.0 / scale, "tpot_s": 0.08 * scale}


def test_assemble_and_table_from_given_measurements():
    rows = {
        "tp1": {"layout": {"tp": 1, "pp": 1, "dp": 1}, "measured": _figures(1.0),
                "predicted_default": {"topology": "discovered:cpu", **_figures(0.5)},
                "predicted_calibrated": {"topology": "discovered:cpu", **_figures(1.25)}},
        "pp2": {"layout": {"tp": 1, "pp": 2, "dp": 1}, "measured": _figures(2.0),
                "predicted_default": {"topology": "discovered:cpu:per-core", "feasible": False},
                "predicted_calibrated": {"topology": "discovered:cpu:per-core", **_figures(2.0)}},
    }
    machine = {"cpu": "Test CPU", "cores": 2, "loadavg_before": [0.5, 0.5, 0.5],
               "loadavg_after": [0.7, 0.6, 0.5]}
    result = assemble(machine, {"prompt_len": 128}, None, rows)
    assert json.loads(json.dumps(result)) == result
    tp1, pp2 = result["layouts"]["tp1"], result["layouts"]["pp2"]
    assert tp1["ratio"]["default"]["batch1_tpot_s"] == pytest.approx(2.0)
    assert tp1["ratio"]["calibrated"]["throughput_tok_s"] == pytest.approx(1.25)
    assert pp2["ratio"]["default"] == dict.fromkeys(MEASURES)  # nothing predicted
    assert pp2["ratio"]["calibrated"]["tpot_s"] == pytest.approx(1.0)
    assert pp2["vs_tp1"]["measured"]["throughput_tok_s"] == pytest.approx(0.5)
    assert pp2["vs_tp1"]["predicted_calibrated"]["throughput_tok_s"] == pytest.approx(1.25 / 2)
    table = format_table(result)
    assert "| tp1 | host | 200.0 / 100.0 / 250.0 | 30.0 / 15.0 / 37.5 | 100.0 / 200.0 / 80.0 |" in table
    assert "| pp2 | auto:cores | 400.0 / - / 400.0 |" in table
    assert "0.50x / - / 0.62x |" in table and "Test CPU, 2 cores" in table


DOCS_BENCH = ROOT / "docs" / "examples" / "bench_cpu_smollm2.json"


def test_tiny_run_end_to_end(tmp_path, cpu_profile):
    """The docs' tiny run, with each recorded CPU's probe as this machine's: the bench carries
    its own probe, so the fit is physical whatever the machine (a Zen 3's one-thread probe made
    it unphysical before)."""
    record, probe = cpu_profile
    out = tmp_path / "layouts.json"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "KTHENA_HOST_PROBE": str(probe)}
    done = subprocess.run(
        [sys.executable, "-m", "kthena_core.cli", "bench", "layouts", "--layouts", "tp1",
         "--requests", "2", "--output-len", "4", "--runs", "1", "--calibrate", str(DOCS_BENCH),
         "--out", str(out)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    ran_here = record.name == "zen4"  # the docs bench is the zen4 record's run
    assert ("ran on AMD EPYC (family 25 model 17), this machine is" in done.stderr) != ran_here
    result = json.loads(out.read_text())
    assert "| tp1 |" in done.stdout
    row = result["layouts"]["tp1"]
    assert row["measured"]["exit_code"] == 0 and row["measured"]["leftover_processes"] == 0
    assert all(row["measured"][k] > 0 for k in MEASURES)
    for kind in ("default", "calibrated"):
        assert row[f"predicted_{kind}"]["feasible"] and set(row["ratio"][kind]) == set(MEASURES)
    assert result["calibration"]["host"]["source"] == str(DOCS_BENCH)
    assert result["machine"]["host_probe"]["memory_bw"] == json.loads(probe.read_text())["memory_bw"]
    assert result["calibration"]["cores"]["bench"] == "as host"  # --calibrate alone serves both
    assert result["workload"]["output_len"] == 4 and result["machine"]["cores"] >= 1
    assert attrs.asdict(LayoutSpec("tp1")) == {"name": "tp1",
                                               "layout": {"tp": 1, "pp": 1, "dp": 1, "sp": 1}}
