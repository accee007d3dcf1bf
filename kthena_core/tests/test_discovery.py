"""Discovery end to end: this machine (a CPU host) and replayed probes for absent hardware."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kthena_core.discovery import (
    Discovery,
    NotPresent,
    describe,
    discover,
    discover_all,
    discover_ascend,
    discover_cpu,
    discover_nvidia,
)
from kthena_core.discovery import _guard as guard
from kthena_core.topology import Topology, from_catalog

DATA = Path(__file__).parent / "data"
HAS_NPU = shutil.which("npu-smi") is not None
HAS_GPU = shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def probe(name: str) -> str:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.startswith("# ")) + "\n"


def replay(outputs: dict[str, str]):
    """A runner that answers probe commands from recorded outputs (NotPresent for the rest)."""
    def run(argv):
        key = " ".join(argv)
        return outputs[key] if key in outputs else NotPresent("?", f"{argv[0]} not found on PATH")
    return run


def test_discovery_on_this_machine():
    found = discover_all()
    assert isinstance(found.cpu, Topology) and found.cpu.devices[0].spec.kind == "cpu"
    assert found.cpu.source == "discovered:cpu"
    if not HAS_NPU:
        assert isinstance(found.npu, NotPresent) and not found.npu and "npu-smi" in found.npu.reason
    if not HAS_GPU:
        assert isinstance(found.gpu, NotPresent) and "NVIDIA" in found.gpu.reason
    if not HAS_NPU and not HAS_GPU:
        assert found.best is found.cpu
        assert discover().source == "discovered:cpu"
    text = found.describe()
    assert "cpu: 1 device(s)" in text and "link domains: [0]" in text
    data = json.loads(json.dumps(found.to_dict()))
    assert data["cpu"]["present"] and Topology.from_dict(data["cpu"]["topology"]) == found.cpu


def test_cpu_discovery_facts_are_plausible():
    topo = discover_cpu()
    spec = topo.devices[0].spec
    assert spec.memory_bytes > 0 and spec.flops("fp32") > 0 and topo.num_nodes == 1
    assert discover_cpu(per_numa=True).num_devices >= 1


def test_importing_kthena_core_never_imports_torch():
    code = ("import sys, kthena_core.discovery, kthena_core.topology, kthena_core.hardware; "
            "from kthena_core.discovery import discover_nvidia; discover_nvidia(use_torch=False); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ascend_discovery_replayed():
    run = replay({
        "npu-smi info": probe("npu-smi-info.atlas800t-a2.910b3x8.ms-swift.txt"),
        "npu-smi info -t topo": probe("npu-smi-info-t-topo.atlas800t-a2.910b3x8.ms-swift.txt"),
    })
    topo = discover_ascend(runner=run)
    assert isinstance(topo, Topology) and topo.num_devices == 8 and len(topo.links) == 28
    assert Topology.from_dict(topo.to_dict()) == topo


def test_ascend_discovery_degrades_to_not_present():
    missing = discover_ascend(runner=replay({}))
    assert missing == NotPresent("npu", "npu-smi not found on PATH")
    garbage = discover_ascend(runner=replay({"npu-smi info": "segmentation fault\n"}))
    assert isinstance(garbage, NotPresent) and "could not read npu-smi info" in garbage.reason
    # info without topo still works, with the spec's fabric as the fallback
    only_info = discover_ascend(runner=replay({
        "npu-smi info": probe("npu-smi-info.atlas-a3-8npu-16chip.vllm-ascend-2666.txt")}))
    assert only_info.num_devices == 16 and only_info.links == () and only_info.source == "discovered:npu-smi"


H100_CSV = "name, memory.total [MiB], pci.bus_id\n" + "".join(
    f"NVIDIA H100 80GB HBM3, 81559 MiB, 00000000:{0x18 + i:02X}:00.0\n" for i in range(8)
)  # built for this test in nvidia-smi's CSV layout; the topo matrix below is a real capture


def test_nvidia_discovery_replayed_without_torch():
    run = replay({
        "nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv": H100_CSV,
        "nvidia-smi topo -m": probe("nvidia-smi-topo-m.h100x8-nvlink-8nic.sglang-30401.txt"),
    })
    topo = discover_nvidia(runner=run, use_torch=False, check_driver=False)
    assert isinstance(topo, Topology) and topo.num_devices == 8
    assert topo.source == "discovered:nvidia-smi+topo" and topo.bandwidth(0, 7) == 450e9
    assert describe(topo).count("nvidia-h100-sxm") == 1


def test_nvidia_discovery_through_a_stub_torch(monkeypatch):
    props = types.SimpleNamespace(name="NVIDIA A100-SXM4-80GB", total_memory=80 * 2**30)
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2,
                                 get_device_properties=lambda i: props)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    topo = discover_nvidia(runner=replay({}), check_driver=False)
    assert topo.num_devices == 2 and topo.source == "discovered:torch.cuda"
    assert topo.devices[0].spec.name == "nvidia-a100-sxm-80gb"


def test_nvidia_discovery_degrades_to_not_present(monkeypatch):
    if not HAS_GPU:
        assert discover_nvidia() == NotPresent(
            "gpu", "no NVIDIA driver (nvidia-smi not on PATH, /dev/nvidia0 absent)")
    cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    result = discover_nvidia(runner=replay({}), check_driver=False)
    assert isinstance(result, NotPresent) and result.kind == "gpu"
    assert "is_available() is False" in result.reason and "nvidia-smi not found" in result.reason


def test_a_crashing_probe_becomes_not_present():
    def boom():
        raise RuntimeError("driver exploded")
    result = guard("gpu", boom)
    assert result == NotPresent("gpu", "probe failed: RuntimeError: driver exploded")
    assert str(result) == "gpu: not present (probe failed: RuntimeError: driver exploded)"


def test_discovery_prefers_npu_then_gpu():
    cpu = discover_cpu()
    npu, gpu = from_catalog("atlas-800t-a2"), from_catalog("dgx-h100")
    assert Discovery(npu=npu, gpu=gpu, cpu=cpu).best is npu
    assert Discovery(npu=NotPresent("npu", "x"), gpu=gpu, cpu=cpu).best is gpu
    assert Discovery(npu=NotPresent("npu", "x"), gpu=NotPresent("gpu", "y"), cpu=cpu).best is cpu


def test_describe_catalog_topology():
    text = describe(from_catalog("atlas-800t-a2", 2))
    assert "2 node(s), 16 device(s)" in text
    assert "ascend-910b2" in text and "hccs 196 GB/s" in text
    assert "link domains: [0-7] [8-15]" in text


@pytest.mark.parametrize("runner_output", ["", "npu-smi 24.1\n"])
def test_npu_smi_without_npus(runner_output):
    result = discover_ascend(runner=replay({"npu-smi info": runner_output}))
    assert isinstance(result, NotPresent)
