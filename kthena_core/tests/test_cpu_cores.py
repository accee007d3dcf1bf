"""The per-core CPU topology (``auto:cores``): one device per core, and what the planner does with it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import pytest

from kthena_core.cli import main
from kthena_core.config_plan import plan_config_file, resolve_topology
from kthena_core.discovery import (
    CpuFacts,
    NumaNode,
    cpu_topology,
    discover,
    parse_lscpu,
    read_cpu_facts,
)
from kthena_core.discovery.cpu import GLOO_LOOPBACK_BW, GLOO_LOOPBACK_LATENCY
from kthena_core.known_models import load_model_spec
from kthena_core.layout import Layout
from kthena_core.planner import Planner
from kthena_core.topology import Topology
from kthena_core.workload import Workload

DATA = Path(__file__).parent / "data"
GiB = 1 << 30


def probe(name: str) -> str:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.startswith("# ")) + "\n"


@pytest.fixture(scope="module")
def xeon() -> CpuFacts:
    """The recorded 2-socket Xeon Gold 6348 (56 cores, 2 NUMA nodes), with 256 GiB of RAM
    (lscpu does not say how much)."""
    return attrs.evolve(parse_lscpu(probe("lscpu.2socket-xeon-gold-6348.libai.txt")),
                        memory_bytes=256 * GiB)


def test_one_device_per_core_with_the_host_split_evenly(xeon):
    host = cpu_topology(xeon).devices[0].spec
    cores = cpu_topology(xeon, per_core=True)
    assert cores.num_devices == 56 and cores.num_nodes == 1
    assert cores.source == "discovered:cpu:per-core" and "56 cores" in cores.name
    spec = cores.devices[0].spec
    assert {d.spec for d in cores.devices} == {spec}
    assert spec.kind == "cpu" and spec.flops("fp32") == 3.5e9 * 64  # one core, AVX-512
    # The shares add up to the host: no layout can use more FLOPs, bandwidth or RAM than it has.
    for dtype in ("fp32", "bf16", "int8"):
        assert spec.flops(dtype) * 56 == pytest.approx(host.flops(dtype))
    assert spec.memory_bw * 56 == pytest.approx(host.memory_bw)
    assert spec.memory_bytes == 256 * GiB // 56
    assert [d.numa_node for d in cores.devices] == [0] * 28 + [1] * 28


def test_cores_are_joined_by_gloo_over_loopback(xeon):
    cores = cpu_topology(xeon, per_core=True)
    assert cores.bandwidth(0, 55) == GLOO_LOOPBACK_BW and cores.latency(3, 4) == GLOO_LOOPBACK_LATENCY
    assert cores.link_domains() == (tuple(range(56)),)
    assert "gloo over loopback" in cores.devices[0].spec.source
    assert Topology.from_dict(json.loads(json.dumps(cores.to_dict()))) == cores


def test_smt_siblings_are_one_device_and_unknown_memory_stays_unknown():
    facts = CpuFacts(num_cpus=8, num_cores=4, threads_per_core=2, flags={"avx2", "fma"},
                     numa_nodes=(NumaNode(0, tuple(range(8))),))
    cores = cpu_topology(facts, per_core=True)
    assert cores.num_devices == 4 and cores.devices[0].spec.memory_bytes == 0  # "host RAM"


def test_per_numa_and_per_core_are_exclusive(xeon):
    with pytest.raises(ValueError, match="per_numa or per_core"):
        cpu_topology(xeon, per_numa=True, per_core=True)


def test_auto_cores_on_this_machine_has_a_device_per_usable_core(tmp_path):
    from kthena_core.discovery import measure_host

    facts = read_cpu_facts()
    # measured once (tiny sizes) and recorded: every call below reads the same figures, however
    # busy the machine is (a probe under load is measured again, not read back)
    measured = measure_host(None, bandwidth_bytes=1 << 20, matmul_shape=(16, 32, 32), samples=3)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(measured.to_dict()))
    cores = resolve_topology("auto:cores", probe_file=probe)
    assert cores.num_devices == facts.num_cores
    if facts.threads_per_core in (None, 1):
        assert cores.num_devices == len(os.sched_getaffinity(0))
    if cores.source.startswith("discovered:cpu") and discover().source == "discovered:cpu":
        assert discover(per_core=True, host=measure_host(probe_file=probe)) == cores
        ran_on = min(measured.threads, facts.num_cores)
        assert measured.memory_bw / ran_on == pytest.approx(cores.devices[0].spec.memory_bw)
    host = resolve_topology("auto", probe_file=probe)
    if host.source == "discovered:cpu":  # a CPU-only machine: the same host, split
        assert sum(d.spec.flops("fp32") for d in cores.devices) == pytest.approx(
            host.devices[0].spec.flops("fp32"))


def test_kthena_topo_shows_the_cores(capsys):
    assert main(["topo", "--topology", "auto:cores"]) == 0
    text = capsys.readouterr().out
    assert "cpu-core" in text and "[discovered:cpu:per-core]" in text


@pytest.fixture(scope="module")
def two_cores() -> Topology:
    facts = CpuFacts(model_name="AMD EPYC", num_cpus=2, num_cores=2, threads_per_core=1,
                     flags={"avx512f", "avx512_bf16", "avx2", "fma"}, clock_hz=2.6e9,
                     memory_bytes=24 * GiB, numa_nodes=(NumaNode(0, (0, 1)),))
    return cpu_topology(facts, per_core=True)


@pytest.mark.parametrize("layout", [Layout(1, 2, 1), Layout(1, 1, 2)], ids=["tp1pp2", "dp2"])
def test_the_planner_places_pp2_and_dp2_on_two_cores(two_cores, layout):
    model = load_model_spec("default")
    judged = Planner().evaluate(model, two_cores, Workload(), layout)
    assert judged.feasible and judged.estimate is not None and judged.estimate.throughput_tok_s > 0
    plan = Planner().plan(model, two_cores, Workload())
    feasible = {e.layout for e in plan.evaluations if e.feasible}
    assert {Layout(1, 2, 1), Layout(1, 1, 2)} <= feasible


def test_a_config_pins_pp2_on_auto_cores(tmp_path):
    if read_cpu_facts().num_cores < 2:
        pytest.skip("needs 2 usable cores")
    path = tmp_path / "pp2.yaml"
    path.write_text("cluster: {topology: 'auto:cores', world_size: 2}\n"
                    "parallelism: {strategy: pp, pipeline_parallel_size: 2}\n"
                    "model: {checkpoint_path: default, dtype: bfloat16}\n", encoding="utf-8")
    _, topology, plan = plan_config_file(str(path))
    assert topology.source == "discovered:cpu:per-core"
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp) == (1, 2, 1) and plan.device_ids == (0, 1)
