"""The host probe: this CPU's memory bandwidth and matmul peak, measured once and cached by key;
discovery builds the CPU device from it instead of a placeholder."""

from __future__ import annotations

import json

import pytest

from kthena_core.discovery import CpuFacts, NumaNode, cpu_topology, measure_host
from kthena_core.discovery.host_probe import HostFigures, host_key

pytest.importorskip("torch")
TINY = {"bandwidth_bytes": 1 << 20, "matmul_shape": (16, 32, 32), "repeats": 1}
FACTS = CpuFacts(model_name="AMD EPYC", num_cpus=2, num_cores=2, threads_per_core=1,
                 flags={"avx512f", "avx2", "fma"}, clock_hz=2.6e9, memory_bytes=8 << 30,
                 numa_nodes=(NumaNode(0, (0, 1)),))


def test_the_probe_measures_and_caches_under_its_key(tmp_path):
    first = measure_host(tmp_path, **TINY)
    assert first is not None and first.source == "measured"
    assert first.memory_bw > 0 and first.peak_flops["bf16"] >= first.peak_flops["fp32"] > 0
    files = list((tmp_path / "host").glob("*.json"))
    assert [f.stem for f in files] == [first.key]
    again = measure_host(tmp_path, **TINY)
    assert again.source == "cached"  # read back, not measured again
    assert (again.memory_bw, again.peak_flops, again.key) == (first.memory_bw, first.peak_flops, first.key)
    # another probe size is another measurement under another key
    other = measure_host(tmp_path, **{**TINY, "repeats": 2})
    assert other.key != first.key and other.source == "measured"
    assert len(list((tmp_path / "host").glob("*.json"))) == 2


def test_the_key_names_threads_torch_and_sizes():
    keys = {host_key(1, "2.5", [1]), host_key(2, "2.5", [1]), host_key(1, "2.6", [1]),
            host_key(1, "2.5", [2])}
    assert len(keys) == 4


def test_a_damaged_cache_file_is_measured_again(tmp_path):
    first = measure_host(tmp_path, **TINY)
    (tmp_path / "host" / f"{first.key}.json").write_text("{not json")
    assert measure_host(tmp_path, **TINY).source == "measured"
    assert json.loads((tmp_path / "host" / f"{first.key}.json").read_text())["key"] == first.key


def test_discovery_uses_the_measured_figures_and_splits_them_per_core():
    host = HostFigures(40e9, {"bf16": 300e9, "fp32": 120e9}, threads=2, key="k")
    device = cpu_topology(FACTS, host=host).devices[0].spec
    assert device.memory_bw == 40e9 and device.flops("bf16") == 300e9
    assert device.source.startswith("measured: 40.0 GB/s")
    cores = cpu_topology(FACTS, per_core=True, host=host).devices
    assert [d.spec.memory_bw for d in cores] == [20e9, 20e9]
    assert sum(d.spec.flops("fp32") for d in cores) == pytest.approx(120e9)
    # without a measurement the figures are estimates, and say so
    assert "placeholder (not measured)" in cpu_topology(FACTS).devices[0].spec.source
