"""The host probe: this CPU's memory bandwidth and matmul peak as the median of short samples,
flagged provisional when taken under load (and measured again), scaled by the threads it ran on,
and replaceable by a recorded probe (``KTHENA_HOST_PROBE``)."""

from __future__ import annotations

import json
import logging

import attrs
import pytest

from kthena_core.cli import main
from kthena_core.discovery import CpuFacts, NumaNode, cpu_topology, measure_host, read_cpu_facts
from kthena_core.discovery import host_probe as hp
from kthena_core.discovery.host_probe import HostFigures, HostProbeError, host_key, load_host_probe

pytest.importorskip("torch")
TINY = {"bandwidth_bytes": 1 << 20, "matmul_shape": (16, 32, 32), "samples": 3}
FACTS = CpuFacts(model_name="AMD EPYC", num_cpus=2, num_cores=2, threads_per_core=1,
                 flags={"avx512f", "avx2", "fma"}, clock_hz=2.6e9, memory_bytes=8 << 30,
                 numa_nodes=(NumaNode(0, (0, 1)),))


def idle() -> float:
    return 0.0


def busy() -> float:
    return 64.0  # above any machine's cores / 2


@pytest.fixture
def steady(monkeypatch):
    """Samples that agree (spread 0), so only the load decides whether a probe is provisional."""
    monkeypatch.setattr(hp, "_bandwidth_samples", lambda n, k: {"bfloat16": [20e9] * k,
                                                                  "float32": [25e9] * k})
    monkeypatch.setattr(hp, "_matmul_samples", lambda r, i, o, k: {"bfloat16": [90e9] * k,
                                                                     "float32": [60e9] * k})


def test_an_idle_probe_is_cached_for_good_under_its_key(tmp_path, steady):
    first = measure_host(tmp_path, **TINY, load=idle)
    assert first.source == "measured" and not first.provisional and first.load_avg == 0.0
    assert first.memory_bw == 25e9 and first.peak_flops == {"bf16": 90e9, "fp32": 60e9}
    assert first.cores >= 1 and first.measured_at > 0 and first.cpu["model_name"]
    assert [f.stem for f in (tmp_path / "host").glob("*.json")] == [first.key]
    again = measure_host(tmp_path, **TINY, load=busy)  # read back: the load now does not matter
    assert again.source == "cached" and not again.provisional
    assert (again.memory_bw, again.peak_flops, again.key) == (first.memory_bw, first.peak_flops,
                                                              first.key)
    other = measure_host(tmp_path, **{**TINY, "samples": 4}, load=idle)
    assert other.key != first.key and other.source == "measured"
    assert len(list((tmp_path / "host").glob("*.json"))) == 2


def test_a_probe_under_load_is_provisional_and_measured_again(tmp_path, steady):
    first = measure_host(tmp_path, **TINY, load=busy)
    assert first.provisional and first.load_avg == 64.0
    assert "provisional: taken under load" in first.describe()
    record = json.loads((tmp_path / "host" / f"{first.key}.json").read_text())
    assert record["provisional"] is True and record["load_avg_1m"] == 64.0
    again = measure_host(tmp_path, **TINY, load=idle)  # not read back: measured again
    assert again.source == "measured" and not again.provisional
    third = measure_host(tmp_path, **TINY, load=busy)
    assert third.source == "cached" and not third.provisional  # the idle one is kept for good


def test_samples_far_apart_make_a_probe_provisional(tmp_path, monkeypatch):
    monkeypatch.setattr(hp, "_bandwidth_samples", lambda n, k: {"bfloat16": [10e9, 20e9, 30e9,
                                                                             40e9, 50e9],
                                                                  "float32": [1e9] * 5})
    monkeypatch.setattr(hp, "_matmul_samples", lambda r, i, o, k: {"bfloat16": [90e9] * 5,
                                                                     "float32": [60e9] * 5})
    figures = measure_host(tmp_path, **TINY, load=idle)
    assert figures.memory_bw == 30e9  # the median, not the best
    assert figures.spread == pytest.approx((40 - 20) / 30, abs=1e-4) and figures.provisional


def test_one_outlier_sample_is_not_noise():
    assert hp._spread([10.0, 10.0, 10.1, 10.0, 30.0]) == pytest.approx(0.1 / 10.0)
    assert hp._spread([10.0, 10.0, 13.0, 14.0, 30.0]) > hp.SPREAD_LIMIT


def test_the_real_probe_measures_positive_figures(tmp_path):
    figures = measure_host(tmp_path, **TINY)
    assert figures.memory_bw > 0 and figures.peak_flops["bf16"] >= figures.peak_flops["fp32"] > 0
    assert figures.details["bandwidth_probe"].endswith("median of 3")


def test_the_key_names_threads_torch_and_sizes():
    keys = {host_key(1, "2.5", [1]), host_key(2, "2.5", [1]), host_key(1, "2.6", [1]),
            host_key(1, "2.5", [2])}
    assert len(keys) == 4


def test_a_damaged_cache_file_is_measured_again(tmp_path, steady):
    first = measure_host(tmp_path, **TINY, load=idle)
    (tmp_path / "host" / f"{first.key}.json").write_text("{not json")
    assert measure_host(tmp_path, **TINY, load=idle).source == "measured"
    assert json.loads((tmp_path / "host" / f"{first.key}.json").read_text())["key"] == first.key


def test_an_unwritable_cache_folder_warns_and_uses_the_figures(tmp_path, steady, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="kthena_core"):
        figures = measure_host(blocker, **TINY, load=idle)
    assert figures.memory_bw == 25e9 and figures.source == "measured"
    assert "cannot cache the measurement" in caplog.text


def test_discovery_scales_the_probe_by_the_threads_it_ran_on():
    two = HostFigures(40e9, {"bf16": 300e9, "fp32": 120e9}, threads=2, key="k")
    device = cpu_topology(FACTS, host=two).devices[0].spec
    assert device.memory_bw == 40e9 and device.flops("bf16") == 300e9
    assert device.source.startswith("measured: 40.0 GB/s")
    cores = cpu_topology(FACTS, per_core=True, host=two).devices
    assert [d.spec.memory_bw for d in cores] == [20e9, 20e9]
    assert sum(d.spec.flops("fp32") for d in cores) == pytest.approx(120e9)
    # the same figures measured on one thread are one core's: the host has twice as much
    one = HostFigures(40e9, {"bf16": 300e9, "fp32": 120e9}, threads=1, key="k")
    assert cpu_topology(FACTS, host=one).devices[0].spec.flops("bf16") == 600e9
    per_core = cpu_topology(FACTS, per_core=True, host=one).devices[0].spec
    assert per_core.flops("fp32") == 120e9 and per_core.memory_bw == 40e9
    assert "scaled to 2 core(s) from 1 thread(s)" in cpu_topology(FACTS, host=one).devices[0].spec.source
    # a probe on more threads than cores measured the cores
    four = HostFigures(40e9, {"bf16": 300e9, "fp32": 120e9}, threads=4, key="k")
    assert cpu_topology(FACTS, host=four).devices[0].spec.flops("bf16") == 300e9
    # without a measurement the figures are estimates, and say so
    assert "placeholder (not measured)" in cpu_topology(FACTS).devices[0].spec.source


def test_a_recorded_probe_stands_in_for_the_measurement(tmp_path, steady):
    figures = measure_host(None, **TINY, load=busy)
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(figures.to_dict()))
    read = measure_host(tmp_path / "cache", probe_file=path)
    assert read.source == f"file {path}" and read.provisional
    assert attrs.evolve(read, source="measured") == figures
    assert read.load_avg == 64.0 and read.cpu == figures.cpu
    assert not (tmp_path / "cache").exists()  # nothing measured, nothing cached


@pytest.mark.parametrize(("content", "field"), [
    (None, "cannot read it"),
    ("{oops", "not JSON"),
    ("[1]", "expected a JSON object"),
    ('{"peak_flops": {"bf16": 1e9}, "threads": 1}', "missing field 'memory_bw'"),
    ('{"memory_bw": -1, "peak_flops": {"bf16": 1e9}, "threads": 1}', "field 'memory_bw'"),
    ('{"memory_bw": 1e9, "peak_flops": {"fp32": 1e9}, "threads": 1}', "field 'peak_flops'"),
    ('{"memory_bw": 1e9, "peak_flops": {"bf16": 1e9}, "threads": 0}', "field 'threads'"),
])
def test_a_bad_probe_file_is_named_with_its_field(tmp_path, content, field):
    path = tmp_path / "probe.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(HostProbeError) as error:
        load_host_probe(path)
    assert str(error.value).startswith(f"KTHENA_HOST_PROBE={path}: ") and field in str(error.value)


def test_kthena_plan_refuses_a_bad_probe_file_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KTHENA_HOST_PROBE", str(tmp_path / "missing.json"))
    assert main(["plan", "--model", "default", "--topology", "auto:cores"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kthena plan: error: KTHENA_HOST_PROBE=") and "\n" not in err


def test_kthena_plan_plans_with_the_recorded_figures_and_prints_them(cpu_profile, monkeypatch,
                                                                    capsys, tmp_path):
    record, probe = cpu_profile
    monkeypatch.setenv("KTHENA_HOST_PROBE", str(probe))
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path / "cache"))
    figures = load_host_probe(probe)
    assert main(["plan", "--model", "default", "--topology", "auto:cores"]) == 0
    text = capsys.readouterr().out
    assert f"from one of {read_cpu_facts().num_cores} cores: file {probe}: " in text
    assert f"{figures.memory_bw / 1e9:.1f} GB/s read" in text
    assert main(["plan", "--model", "default", "--topology", "auto:cores", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["figures"]["source"].startswith("one of") and str(probe) in out["figures"]["source"]
    ran_on = min(figures.threads, read_cpu_facts().num_cores)
    assert out["figures"]["memory_bw"] == pytest.approx(figures.memory_bw / ran_on)
    assert out["factors"]["origin"] == "class default"
    assert out["factors"]["records"] == [record.name]  # this record's CPU: its own fit
    assert not (tmp_path / "cache" / "host").exists()  # the machine was not probed


def test_kthena_plan_with_an_unwritable_cache_warns_and_plans(tmp_path, monkeypatch, capsys,
                                                              caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(blocker))
    monkeypatch.delenv("KTHENA_HOST_PROBE", raising=False)  # measure this machine (figures unused)
    with caplog.at_level(logging.WARNING, logger="kthena_core"):
        assert main(["plan", "--model", "default", "--topology", "auto:cores", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["figures"]["source"].startswith("one of")
    assert "cannot cache the measurement" in caplog.text and "Traceback" not in captured.err
