"""Discovery parsers on recorded real command outputs (tests/data, sources in each file's header)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kthena_core.discovery import (
    ParseError,
    build_ascend_topology,
    build_nvidia_topology,
    cpu_topology,
    parse_cpulist,
    parse_lscpu,
    parse_npu_smi_info,
    parse_npu_topo,
    parse_numactl_hardware,
    parse_nvidia_query_csv,
    parse_nvidia_topo,
    read_cpu_facts,
)
from kthena_core.discovery.ascend import ascend_catalog_name
from kthena_core.discovery.cpu import numa_cpu_map
from kthena_core.discovery.nvidia import GpuInfo, nvidia_catalog_name, nvidia_spec

DATA = Path(__file__).parent / "data"


def probe(name: str) -> str:
    """A recorded output without its three '# source/hardware/note' header lines."""
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.startswith("# ")) + "\n"


def test_every_probe_keeps_its_source_note():
    for path in DATA.glob("*.txt"):
        head = path.read_text(encoding="utf-8").splitlines()[:3]
        assert [h.split(":")[0] for h in head] == ["# source", "# hardware", "# note"], path.name


# -- npu-smi info ----------------------------------------------------------------------------

A2_910B2 = "npu-smi-info.atlas800t-a2.910b2x8.vllm-ascend-975.txt"
A2_910B3 = "npu-smi-info.atlas800t-a2.910b3x8.ms-swift.txt"
A3 = "npu-smi-info.atlas-a3-8npu-16chip.vllm-ascend-2666.txt"
P310 = "npu-smi-info.atlas300i-310p3x6.vllm-ascend-2712.txt"
B1_PARTIAL = "npu-smi-info.910b1x8-kunpeng.arthurchiao.txt"
TOPO_B3 = "npu-smi-info-t-topo.atlas800t-a2.910b3x8.ms-swift.txt"
TOPO_B1 = "npu-smi-info-t-topo.910b1x8-kunpeng.arthurchiao.txt"
TOPO_SYS = "npu-smi-info-t-topo.atlas350-pcie-sys.huawei-doc-EXAMPLE.txt"
KUNPENG_LSCPU = "lscpu.kunpeng920-atlas800t-a2.vllm-ascend-975.txt"


def test_npu_smi_info_atlas_a2_910b2():
    info = parse_npu_smi_info(probe(A2_910B2))
    assert info.version == "24.1.0.3"
    assert [c.npu_id for c in info.chips] == list(range(8))
    assert {c.name for c in info.chips} == {"910B2"} and info.chips_per_npu == 1
    assert info.chips[0].bus_id == "0000:C1:00.0" and info.chips[7].bus_id == "0000:42:00.0"
    assert [c.memory_total_mb for c in info.chips] == [65536] * 8
    assert info.chips[0].memory_used_mb == 3385
    assert all(c.health == "OK" for c in info.chips) and not info.busy_npus


def test_npu_smi_info_910b3_without_process_table():
    info = parse_npu_smi_info(probe(A2_910B3))
    assert len(info.chips) == 8 and info.chips[5].name == "910B3" and info.version == "24.1.rc1.b030"


def test_npu_smi_info_a3_two_chips_per_npu():
    info = parse_npu_smi_info(probe(A3))
    assert len(info.chips) == 16 and info.chips_per_npu == 2
    assert [c.phy_id for c in info.chips] == list(range(16))
    assert [(c.npu_id, c.chip_id) for c in info.chips[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert info.chips[1].bus_id == "0000:9F:00.0" and info.chips[1].memory_total_mb == 65536


def test_npu_smi_info_310p_non_contiguous_ids_and_no_hbm_column():
    info = parse_npu_smi_info(probe(P310))
    assert [c.npu_id for c in info.chips] == [0, 32, 96, 32768, 32800, 32896]
    assert [c.phy_id for c in info.chips] == list(range(6))  # the "Device" column
    assert {c.memory_total_mb for c in info.chips} == {21527}
    assert info.chips[2].memory_used_mb == 1851


def test_npu_smi_info_tolerates_elided_rows():
    info = parse_npu_smi_info(probe(B1_PARTIAL))
    assert [c.npu_id for c in info.chips] == [0, 1, 7]  # NPUs 2-6 were cut to '...' by the author
    assert info.version == "23.0.rc2"


def test_npu_smi_info_marks_npus_with_processes_busy():
    # The recorded captures all say "No running processes found". This is a one-line edit of the
    # real 910B2 capture: a process row in npu-smi's table layout is appended to NPU 3.
    text = probe(A2_910B2).replace(
        "| No running processes found in NPU 3                                                            |",
        "| 3       0                 | 4242          | python3                  | 20000                   |",
    )
    info = parse_npu_smi_info(text)
    assert info.busy_npus == {3}
    topo = build_ascend_topology(info)
    assert [d.health for d in topo.devices] == ["ok"] * 3 + ["busy"] + ["ok"] * 4


def test_npu_smi_info_rejects_other_text():
    with pytest.raises(ParseError, match="not npu-smi output"):
        parse_npu_smi_info("hello\nworld\n")


# -- npu-smi info -t topo --------------------------------------------------------------------


def test_npu_topo_all_hccs_with_cpu_affinity():
    m = parse_npu_topo(probe(TOPO_B3))
    assert m.devices == tuple(f"NPU{i}" for i in range(8))
    assert all(m.relation(a, b) == "HCCS" for a in range(8) for b in range(8) if a != b)
    assert m.cpu_affinity[0] == "144-167" and m.cpu_affinity[4] == "0-23" and m.cpu_affinity[7] == "48-71"


def test_npu_topo_older_legend_interleaved_affinity():
    m = parse_npu_topo(probe(TOPO_B1))
    assert m.relation(3, 6) == "HCCS"
    assert m.cpu_affinity[:4] == ("144-167", "0-23", "144-167", "0-23")


def test_npu_topo_pcie_sys_doc_example():
    m = parse_npu_topo(probe(TOPO_SYS))
    assert {m.relation(a, b) for a in range(8) for b in range(8) if a != b} == {"SYS"}
    assert m.cpu_affinity[0] == "0-63,128-191" and m.cpu_affinity[7] == "64-127,192-255"


def test_ascend_topology_from_the_same_host_info_and_topo():
    # ms-swift published both outputs from one 8 x 910B3 machine.
    kunpeng = parse_lscpu(probe(KUNPENG_LSCPU))  # a Kunpeng-920 Atlas 800T A2 host's NUMA layout
    topo = build_ascend_topology(parse_npu_smi_info(probe(A2_910B3)), parse_npu_topo(probe(TOPO_B3)),
                                 numa_cpus=numa_cpu_map(kunpeng))
    assert topo.num_devices == 8 and {d.spec.name for d in topo.devices} == {"ascend-910b3"}
    assert topo.devices[0].spec.memory_bytes == 64 * 2**30
    assert len(topo.links) == 28 and {link.kind for link in topo.links} == {"hccs"}
    assert topo.link(2, 5).via == "HCCS"
    assert [d.numa_node for d in topo.devices] == [6, 6, 4, 4, 0, 0, 2, 2]  # 144-167 -> node6 ...
    assert topo.link_domains() == (tuple(range(8)),)
    assert topo.source == "discovered:npu-smi+topo"


def test_ascend_topology_sys_matrix_gives_sys_links():
    # The doc example's PCIe/SYS matrix, laid over an 8-NPU info table only to exercise the mapping.
    topo = build_ascend_topology(parse_npu_smi_info(probe(A2_910B3)), parse_npu_topo(probe(TOPO_SYS)),
                                 numa_cpus={0: range(0, 64), 1: range(64, 128)})
    assert {link.kind for link in topo.links} == {"sys"}
    assert topo.bandwidth(0, 1) < topo.devices[0].spec.pcie_bw
    assert [d.numa_node for d in topo.devices] == [0] * 4 + [1] * 4


def test_ascend_topology_a3_and_310p():
    a3 = build_ascend_topology(parse_npu_smi_info(probe(A3)))
    assert a3.num_devices == 16 and {d.spec.name for d in a3.devices} == {"ascend-910c-die"}
    p310 = build_ascend_topology(parse_npu_smi_info(probe(P310)))
    spec = p310.devices[0].spec
    assert spec.name == "ascend-310p3" and spec.memory_bytes == 21527 * 2**20 and spec.link_kind == "pcie"
    # a topo matrix of the wrong size is ignored rather than trusted
    assert build_ascend_topology(parse_npu_smi_info(probe(P310)), parse_npu_topo(probe(TOPO_B3))).links == ()


@pytest.mark.parametrize("name, per_npu, key", [
    ("910B1", 1, "ascend-910b1"), ("910B4", 1, "ascend-910b4"), ("Ascend910B2C", 1, "ascend-910b2"),
    ("Ascend910", 2, "ascend-910c-die"), ("Ascend910", 1, None), ("310P3", 1, "ascend-310p3"),
    ("Ascend950PR", 1, None),
])
def test_ascend_catalog_names(name, per_npu, key):
    assert ascend_catalog_name(name, per_npu) == key


# -- nvidia-smi topo -m ----------------------------------------------------------------------

P4D = "nvidia-smi-topo-m.aws-p4d-a100x8-nv12.training-on-eks.txt"
P5 = "nvidia-smi-topo-m.aws-p5-h100x8-nv18.training-on-eks.txt"
SGLANG = "nvidia-smi-topo-m.h100x8-nvlink-8nic.sglang-30401.txt"
L40S = "nvidia-smi-topo-m.aws-g6e-12xlarge-l40sx4-pcie.training-on-eks.txt"
RTX = "nvidia-smi-topo-m.rtx4090x8-pcie-2numa.go-gpuallocator-17.txt"


def test_nvidia_topo_a100_nv12():
    m = parse_nvidia_topo(probe(P4D))
    assert len(m.devices) == 8 and m.relation(0, 7) == "NV12" and m.relation(4, 4) == "X"
    assert m.numa_affinity == (0, 0, 0, 0, 1, 1, 1, 1)
    assert m.cpu_affinity[4] == "24-47,72-95" and m.nics == ()
    topo = build_nvidia_topology([GpuInfo("NVIDIA A100-SXM4-40GB", 40 * 2**30)] * 8, m)
    assert topo.bandwidth(0, 5) == 300e9  # 12 links x 25 GB/s, the A100's NVLink total
    assert topo.link_domains() == (tuple(range(8)),)
    assert topo.devices[6].numa_node == 1


def test_nvidia_topo_h100_nv18_with_nics():
    m = parse_nvidia_topo(probe(SGLANG))
    assert len(m.devices) == 8 and m.nics == tuple(f"NIC{i}" for i in range(8))
    assert m.nic_relations[0][0] == "PIX" and m.nic_relations[0][1] == "NODE" and m.nic_relations[0][4] == "SYS"
    assert m.nic_names["NIC7"] == "mlx5_7"
    topo = build_nvidia_topology([GpuInfo("NVIDIA H100 80GB HBM3", 81559 * 2**20)] * 8, m)
    assert {d.spec.name for d in topo.devices} == {"nvidia-h100-sxm"}
    assert topo.devices[0].spec.memory_bytes == 81559 * 2**20  # what the GPU reports wins
    assert topo.bandwidth(3, 4) == 450e9 and topo.link(3, 4).via == "NV18"
    assert parse_nvidia_topo(probe(P5)).relations == m.relations


def test_nvidia_topo_pcie_only_boxes():
    l40s = parse_nvidia_topo(probe(L40S))
    assert {l40s.relation(a, b) for a in range(4) for b in range(4) if a != b} == {"NODE"}
    topo = build_nvidia_topology([GpuInfo("NVIDIA L40S", 46068 * 2**20)] * 4, l40s)
    assert {link.kind for link in topo.links} == {"pcie"} and topo.link_domains() == ((0, 1, 2, 3),)

    rtx = parse_nvidia_topo(probe(RTX))  # tab-separated, ' X ' cells, an empty column before N/A
    assert len(rtx.devices) == 8 and rtx.nics == ("NIC0", "NIC1")
    assert rtx.nic_relations[6] == ("PHB", "PHB") and rtx.relation(0, 7) == "SYS"
    assert rtx.numa_affinity == (0, 0, 0, 0, 1, 1, 1, 1) and rtx.cpu_affinity[7] == "56-111,168-223"
    topo = build_nvidia_topology([GpuInfo("NVIDIA GeForce RTX 4090", 24 * 2**30)] * 8, rtx)
    assert {link.kind for link in topo.links} == {"sys"}
    assert topo.bandwidth(0, 1) == 0.5 * topo.devices[0].spec.pcie_bw


def test_nvidia_link_domains_split_by_nvlink_islands():
    # Not a recorded capture: a 4-GPU matrix in the topo -m layout, with two NVLink pairs split
    # across NUMA nodes. It checks that link_domains follows the fastest class.
    text = (
        "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV4\tSYS\tSYS\t0-15\t0\n"
        "GPU1\tNV4\t X \tSYS\tSYS\t0-15\t0\n"
        "GPU2\tSYS\tSYS\t X \tNV4\t16-31\t1\n"
        "GPU3\tSYS\tSYS\tNV4\t X \t16-31\t1\n"
    )
    topo = build_nvidia_topology([GpuInfo("NVIDIA H100 PCIe", 80 * 2**30)] * 4, parse_nvidia_topo(text))
    assert topo.link_domains() == ((0, 1), (2, 3))
    assert topo.bandwidth(0, 1) == 100e9 and topo.bandwidth(1, 2) == 32e9


def test_nvidia_topo_errors():
    with pytest.raises(ParseError, match="no header"):
        parse_nvidia_topo("nothing here")
    with pytest.raises(ParseError, match="do not match"):
        parse_nvidia_topo("\tGPU0\tGPU1\nGPU0\t X \tNV1\n")


def test_nvidia_query_csv_header_order_and_units():
    gpus = parse_nvidia_query_csv(probe("nvidia-smi-query-gpu-csv.tesla-p40.cloudpods-docs.txt"))
    assert gpus == (GpuInfo("Tesla P40", 23040 * 2**20, "00000000:00:06.0"),)
    spec = nvidia_spec("Tesla P40", 23040 * 2**20)  # not catalogued -> an explicit placeholder
    assert spec.name == "nvidia-generic:tesla-p40" and spec.source.startswith("placeholder")
    with pytest.raises(ParseError, match="memory.total"):
        parse_nvidia_query_csv("name, pci.bus_id\nX, 0\n")


@pytest.mark.parametrize("name, memory, key", [
    ("NVIDIA H100 80GB HBM3", 0, "nvidia-h100-sxm"), ("NVIDIA H100 PCIe", 0, "nvidia-h100-pcie"),
    ("NVIDIA H200", 0, "nvidia-h200-sxm"), ("NVIDIA A100-SXM4-80GB", 0, "nvidia-a100-sxm-80gb"),
    ("NVIDIA A100-SXM4-40GB", 40 * 2**30, "nvidia-a100-sxm-40gb"), ("NVIDIA L40S", 0, "nvidia-l40s"),
    ("NVIDIA GeForce RTX 4090", 0, "nvidia-rtx-4090"), ("NVIDIA A100-PCIE-40GB", 0, None),
])
def test_nvidia_catalog_names(name, memory, key):
    assert nvidia_catalog_name(name, memory) == key


# -- lscpu / numactl / sysfs -----------------------------------------------------------------


def test_lscpu_hierarchical_layout_with_wrapped_flags():
    facts = parse_lscpu(probe("lscpu.2socket-xeon-gold-6348.libai.txt"))
    assert facts.model_name == "Intel(R) Xeon(R) Gold 6348 CPU @ 2.60GHz" and facts.arch == "x86_64"
    assert (facts.num_cpus, facts.num_cores, facts.num_sockets, facts.threads_per_core) == (56, 56, 2, 1)
    assert [n.cpus for n in facts.numa_nodes] == [tuple(range(28)), tuple(range(28, 56))]
    assert facts.clock_hz == 3.5e9
    # words cut by terminal wrapping are re-joined; words split at a space stay apart
    assert {"avx512f", "avx512_vnni", "rep_good", "tsc_adjust", "clflushopt", "cqm_occup_llc",
            "avx512vbmi", "avx512_vpopcntdq", "tm2", "sse"} <= facts.flags
    assert not {"rep_go", "od", "avx51", "2vbmi"} & facts.flags


def test_lscpu_kunpeng_untrusted_socket_count():
    facts = parse_lscpu(probe(KUNPENG_LSCPU))
    assert facts.num_sockets is None and facts.threads_per_core is None  # "-" and "0"
    assert facts.num_cpus == 192 and len(facts.numa_nodes) == 8
    assert facts.numa_nodes[6].cpus == tuple(range(144, 168))
    assert "asimd" in facts.flags and facts.arch == "aarch64"


def test_lscpu_needs_a_cpu_count():
    with pytest.raises(ParseError, match="CPU"):
        parse_lscpu("Architecture: x86_64\n")


def test_numactl_hardware():
    hadoop = parse_numactl_hardware(probe("numactl-hardware.2socket-96cpu.apache-hadoop-usingnuma.txt"))
    assert [len(n.cpus) for n in hadoop.nodes] == [48, 48]
    assert hadoop.nodes[0].memory_bytes == 191297 * 2**20 and 48 in hadoop.nodes[0].cpus
    assert hadoop.distances == ((10, 21), (21, 10))
    c5n = parse_numactl_hardware(probe("numactl-hardware.aws-c5n-18xlarge-2socket.aws-c-s3-403.txt"))
    assert c5n.nodes[1].cpus[:2] == (18, 19) and 36 in c5n.nodes[0].cpus
    with pytest.raises(ParseError, match="available"):
        parse_numactl_hardware("node 0 cpus: 0 1\n")


def test_cpu_topology_whole_host_and_per_numa():
    facts = parse_lscpu(probe("lscpu.2socket-xeon-gold-6348.libai.txt"))
    whole = cpu_topology(facts)
    assert whole.num_devices == 1 and whole.devices[0].spec.kind == "cpu"
    assert whole.devices[0].spec.flops("fp32") == 56 * 3.5e9 * 64  # AVX-512, two FMA pipes
    split = cpu_topology(facts, per_numa=True)
    assert split.num_devices == 2 and [d.numa_node for d in split.devices] == [0, 1]
    assert split.link(0, 1).kind == "sys" and split.devices[0].spec.flops("fp32") == 28 * 3.5e9 * 64


def test_read_cpu_facts_from_a_fake_tree(tmp_path):
    (tmp_path / "proc").mkdir()
    cpuinfo = "".join(
        f"processor\t: {i}\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\nphysical id\t: {i // 2}\n"
        f"core id\t\t: {i % 2}\ncpu MHz\t\t: 2000.000\nflags\t\t: fpu avx2 fma avx512f amx_bf16\n\n"
        for i in range(4)
    )
    (tmp_path / "proc/cpuinfo").write_text(cpuinfo)
    (tmp_path / "proc/meminfo").write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    for node, cpus in ((0, "0-1"), (1, "2-3")):
        d = tmp_path / f"sys/devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       8192000 kB\n")
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/memory.max").write_text(str(4 * 2**30) + "\n")
    facts = read_cpu_facts(tmp_path, usable_cpus={0, 1, 2})
    assert (facts.num_cpus, facts.num_sockets, facts.threads_per_core) == (3, 2, 1)
    assert facts.memory_bytes == 4 * 2**30  # the cgroup limit is lower than MemTotal
    assert [n.cpus for n in facts.numa_nodes] == [(0, 1), (2,)]
    assert facts.clock_hz == 2e9 and "amx_bf16" in facts.flags
    assert cpu_topology(facts).devices[0].spec.flops("bf16") == 3 * 2e9 * 1024


@given(st.sets(st.integers(0, 300), min_size=1, max_size=40))
def test_parse_cpulist_round_trip(cpus):
    ordered = sorted(cpus)
    runs, start = [], ordered[0]
    for prev, cur in zip(ordered, [*ordered[1:], None], strict=True):
        if cur != prev + 1 if cur is not None else True:
            runs.append(f"{start}-{prev}" if prev != start else str(start))
            start = cur
    assert parse_cpulist(",".join(runs)) == tuple(ordered)


def test_parse_cpulist_errors():
    with pytest.raises(ParseError, match="CPU list"):
        parse_cpulist("0-3,x")
