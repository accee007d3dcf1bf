"""Topology: catalog topologies, bandwidth queries, link domains, YAML loading and its errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kthena_core.hardware import UnknownHardwareError, get_device, list_nodes
from kthena_core.topology import Device, Link, Topology, TopologyError, from_catalog

DATA = Path(__file__).parent / "data"


def _load(text: str) -> Topology:
    return Topology.from_dict(yaml.safe_load(text), origin="t.yaml")


# -- catalog topologies ----------------------------------------------------------------------


def test_two_atlas_a2_nodes():
    topo = from_catalog("atlas-800t-a2", 2)
    assert topo.num_nodes == 2 and topo.num_devices == 16
    assert topo.source == "catalog:atlas-800t-a2x2"
    assert topo.link_domains() == (tuple(range(8)), tuple(range(8, 16)))
    intra, inter = topo.bandwidth(0, 7), topo.bandwidth(0, 8)
    assert intra == get_device("ascend-910b2").link_bw and inter == 25e9 and intra > inter
    assert topo.group_bandwidth(range(8)) == intra
    assert topo.group_bandwidth([0, 1, 8]) == inter
    assert topo.group_bandwidth([5]) == math.inf
    assert topo.latency(0, 8) > topo.latency(0, 1) > topo.latency(3, 3) == 0
    assert [d.local_index for d in topo.devices_on_node(1)] == list(range(8))


def test_from_catalog_device_override_and_errors():
    topo = from_catalog("atlas-800t-a2", device="ascend-910b3")
    assert {d.spec.name for d in topo.devices} == {"ascend-910b3"}
    with pytest.raises(UnknownHardwareError, match="known nodes: .*known devices: .*ascend-910b1"):
        from_catalog("atlas-1000")
    single = from_catalog("nvidia-rtx-4090", 2)  # a device name: one device per node
    assert single.num_nodes == 2 and single.num_devices == 2 and single.link_domains() == ((0,), (1,))
    with pytest.raises(TopologyError, match="num_nodes"):
        from_catalog("atlas-800t-a2", 0)


def test_a3_node_is_one_hccs_domain_of_16_dies():
    topo = from_catalog("atlas-800t-a3", 2)
    assert topo.num_devices == 32
    assert [len(d) for d in topo.link_domains()] == [16, 16]


def test_queries_reject_bad_indices():
    topo = from_catalog("dgx-h100")
    with pytest.raises(TopologyError, match="out of range"):
        topo.bandwidth(0, 8)
    with pytest.raises(TopologyError, match="empty"):
        topo.group_bandwidth([])
    with pytest.raises(TopologyError, match="repeated"):
        topo.group_bandwidth([1, 1])
    with pytest.raises(TopologyError, match="node 3"):
        topo.devices_on_node(3)


def test_explicit_links_split_link_domains():
    spec = get_device("nvidia-h100-pcie")
    devices = [Device(i, 0, i, spec) for i in range(4)]
    links = [Link(0, 1, "nvlink", 300e9, 3e-6), Link(2, 3, "nvlink", 300e9, 3e-6)]
    topo = Topology(devices=devices, links=links)
    assert topo.link_domains() == ((0, 1), (2, 3))
    assert topo.bandwidth(1, 0) == 300e9 and topo.bandwidth(1, 2) == spec.link_bw
    assert topo.group_bandwidth([0, 1, 2]) == spec.link_bw


def test_constructor_validation():
    spec = get_device("ascend-910b2")
    with pytest.raises(TopologyError, match="at least one device"):
        Topology(devices=())
    with pytest.raises(TopologyError, match="index must equal"):
        Topology(devices=[Device(1, 0, 0, spec)])
    with pytest.raises(TopologyError, match="grouped by node"):
        Topology(devices=[Device(0, 1, 0, spec)])
    with pytest.raises(TopologyError, match="health"):
        Topology(devices=[Device(0, 0, 0, spec, health="sleepy")])
    two_nodes = [Device(0, 0, 0, spec), Device(1, 1, 0, spec)]
    with pytest.raises(TopologyError, match="different nodes"):
        Topology(devices=two_nodes, links=[Link(0, 1, "hccs", 1e9, 1e-6)])
    with pytest.raises(TopologyError, match="a < b"):
        Topology(devices=[Device(0, 0, 0, spec), Device(1, 0, 1, spec)], links=[Link(1, 0, "hccs", 1e9, 0)])


# -- YAML ------------------------------------------------------------------------------------


def test_yaml_example_from_the_guide():
    topo = Topology.from_yaml(DATA / "topology-2xa2-plus-custom.yaml")
    assert topo.name == "my-cluster" and topo.num_nodes == 3 and topo.num_devices == 24
    assert topo.source.startswith("yaml:") and topo.source.endswith("topology-2xa2-plus-custom.yaml")
    assert topo.inter_node_bw == 25e9 and topo.inter_node_latency == pytest.approx(10e-6)
    assert topo.bandwidth(16, 17) == 196e9 and topo.link(16, 23).kind == "hccs"
    assert [d.numa_node for d in topo.devices_on_node(2)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert topo.devices[22].health == "busy" and topo.devices[23].health == "unhealthy"
    assert len(topo.link_domains()) == 3


def test_yaml_custom_device_and_pair_links():
    topo = Topology.from_yaml(DATA / "topology-custom-device.yaml")
    spec = topo.devices[0].spec
    assert spec.name == "acme-x1" and spec.memory_bytes == 96 * 2**30 and spec.flops("int8") == 800e12
    assert topo.inter_node_bw == 100e9 / 8  # bandwidth_gbps is gigabits
    assert topo.link_domains() == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.bandwidth(4, 6) == 32e9


def test_yaml_8x910b():
    topo = Topology.from_yaml(DATA / "topology-8x910b.yaml")
    assert topo.num_devices == 8 and topo.devices[0].spec.name == "ascend-910b3"


@pytest.mark.parametrize(
    "path, expected",
    [
        ("topology.bad-unknown-device.yaml", r"nodes\[0\]\.device: unknown device 'ascend-999z'; allowed: .*ascend-910b3"),
        ("topology.bad-negative-count.yaml", r"nodes\[0\]\.count: got -2; allowed: a positive integer"),
        ("topology.bad-bandwidth.yaml", r"inter_node\.bandwidth: got 'very fast'; allowed: .*GB/s"),
        ("topology.bad-unknown-key.yaml", r"interconnect: unknown key 'interconnect'; allowed: name, .*nodes"),
        ("topology.bad-missing-nodes.yaml", r"nodes: missing section"),
    ],
)
def test_bad_files(path, expected):
    with pytest.raises(TopologyError, match=expected) as info:
        Topology.from_yaml(DATA / path)
    assert path in str(info.value)  # the message names the file


@pytest.mark.parametrize(
    "text, expected",
    [
        ("nodes: []", r"nodes: got \[\]; allowed: a non-empty list"),
        ("nodes: [{node: atlas-9000}]", r"nodes\[0\]\.node: unknown node 'atlas-9000'; allowed: .*dgx-h100"),
        ("nodes: [{device: ascend-910b3}]", r"nodes\[0\]\.devices: missing"),
        ("nodes: [{devices: 8}]", r"nodes\[0\]\.device: missing"),
        ("nodes: [{devices: 0, device: ascend-910b3}]", r"nodes\[0\]\.devices: got 0"),
        ("nodes: [{devices: eight, device: ascend-910b3}]", r"nodes\[0\]\.devices: got 'eight'"),
        ("nodes: [{devices: 2, device: ascend-910b3, link: {bandwidth: -5}}]",
         r"nodes\[0\]\.link\.bandwidth: got -5"),
        ("nodes: [{devices: 2, device: ascend-910b3, link: {bandwdith: 5}}]",
         r"nodes\[0\]\.link\.bandwdith: unknown key"),
        ("nodes: [{devices: 2, device: ascend-910b3, link: {bandwidth: 1, bandwidth_gbps: 1}}]",
         r"nodes\[0\]\.link: give one of"),
        ("nodes: [{devices: 2, device: ascend-910b3, numa: [0]}]", r"nodes\[0\]\.numa: got \[0\]; allowed: a list of 2"),
        ("nodes: [{devices: 2, device: ascend-910b3, health: [ok, dead]}]", r"nodes\[0\]\.health\[1\]: got 'dead'"),
        ("nodes: [{devices: 2, device: ascend-910b3, links: [{a: 0, b: 0}]}]", r"nodes\[0\]\.links\[0\]: a and b must differ"),
        ("nodes: [{devices: 2, device: ascend-910b3, links: [{a: 0, b: 5}]}]", r"nodes\[0\]\.links\[0\]\.b: got 5"),
        ("nodes: [{node: dgx-h100}]\ninter_node: {latency: soon}", r"inter_node\.latency: got 'soon'"),
        ("nodes: [{node: dgx-h100}]\ninter_node: {latency: 1, latency_us: 1}", r"inter_node: give latency or latency_us"),
        ("nodes: [{node: dgx-h100}]\ninter_node: [1, 2]", r"inter_node: expected a mapping"),
        ("nodes: [{node: dgx-h100, count: true}]", r"nodes\[0\]\.count: got True"),
        ("- node: dgx-h100", r"\(top level\): expected a mapping"),
        ("name: [x]\nnodes: [{node: dgx-h100}]", r"name: got \['x'\]; allowed: a string"),
        ("device_specs: {x: {kind: gpu}}\nnodes: [{device: x, devices: 1}]", r"device_specs\.x\.memory_bw: missing"),
        ("device_specs: {x: {kind: tpu, memory: 1 GB, memory_bw: 1 GB/s, peak_flops: {bf16: 1}, "
         "link: {kind: pcie, bandwidth: 1}}}\nnodes: [{device: x, devices: 1}]", r"device_specs\.x\.kind: got 'tpu'"),
        ("device_specs: {x: {kind: gpu, memory: lots, memory_bw: 1 GB/s, peak_flops: {bf16: 1}, "
         "link: {kind: pcie, bandwidth: 1}}}\nnodes: [{device: x, devices: 1}]", r"device_specs\.x\.memory: got 'lots'"),
        ("device_specs: {x: {kind: gpu, memory: 1 GB, memory_bw: 1 GB/s, peak_flops: {bf16: fast}, "
         "link: {kind: pcie, bandwidth: 1}}}\nnodes: [{device: x, devices: 1}]", r"device_specs\.x\.peak_flops\.bf16: got 'fast'"),
        ("device_specs: {x: {kind: gpu, memory: 1 GB, memory_bw: 1 GB/s, peak_flops: {bf16: 1}, "
         "link: {kind: warp, bandwidth: 1}}}\nnodes: [{device: x, devices: 1}]", r"device_specs\.x: invalid device spec: .*link_kind"),
    ],
)
def test_bad_dicts(text, expected):
    with pytest.raises(TopologyError, match=expected):
        _load(text)


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(TopologyError, match="cannot read"):
        Topology.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [{node: dgx-h100}\n")
    with pytest.raises(TopologyError, match=r"invalid YAML at line \d+"):
        Topology.from_yaml(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(TopologyError, match="empty"):
        Topology.from_yaml(empty)


@pytest.mark.parametrize("text, expected", [
    ("392 GB/s", 392e9), ("200 Gb/s", 25e9), ("200Gbps", 25e9), ("25GBps", 25e9),
    ("1.6 TB/s", 1.6e12), ("100 MB/s", 100e6), (12.5e9, 12.5e9), ("3e9", 3e9),
])
def test_bandwidth_units(text, expected):
    topo = Topology.from_dict({"nodes": [{"node": "dgx-h100"}], "inter_node": {"bandwidth": text}})
    assert topo.inter_node_bw == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [("10 us", 10e-6), ("2 ms", 2e-3), ("500 ns", 5e-7), (1e-5, 1e-5)])
def test_latency_units(text, expected):
    topo = Topology.from_dict({"nodes": [{"node": "dgx-h100"}], "inter_node": {"latency": text}})
    assert topo.inter_node_latency == pytest.approx(expected)


@pytest.mark.parametrize("path", sorted(p.name for p in DATA.glob("topology-*.yaml")))
def test_yaml_round_trip(path):
    topo = Topology.from_yaml(DATA / path)
    data = topo.to_dict()
    json.dumps(data)  # plain data only
    assert Topology.from_dict(data) == topo
    assert Topology.from_dict(yaml.safe_load(yaml.safe_dump(data))) == topo


# -- properties over catalog topologies ------------------------------------------------------

catalog_topologies = st.builds(from_catalog, st.sampled_from(list_nodes()), st.integers(1, 3))


@settings(deadline=None, max_examples=30)
@given(catalog_topologies, st.data())
def test_catalog_topology_properties(topo, data):
    domains = topo.link_domains()
    assert sorted(i for d in domains for i in d) == list(range(topo.num_devices))
    for dom in domains:
        assert len({topo.devices[i].node for i in dom}) == 1
        assert topo.group_bandwidth(dom) >= topo.inter_node_bw
    group = data.draw(st.lists(st.integers(0, topo.num_devices - 1), min_size=1, max_size=6, unique=True))
    sub = group[: max(1, len(group) // 2)]
    assert topo.group_bandwidth(sub) >= topo.group_bandwidth(group)
    a, b = group[0], group[-1]
    assert topo.bandwidth(a, b) == topo.bandwidth(b, a)
    assert Topology.from_dict(topo.to_dict()) == topo
