"""Hardware catalog: sanity of every figure, lookups, dtype handling, CPU host estimates."""

from __future__ import annotations

import math

import pytest

from kthena_core import hardware
from kthena_core.hardware import (
    DeviceSpec,
    UnknownHardwareError,
    cpu_flops_per_cycle,
    cpu_host_spec,
    get_device,
    get_node,
    list_devices,
    list_nodes,
)

REQUIRED_DEVICES = [
    "ascend-910b1", "ascend-910b2", "ascend-910b3", "ascend-910b4", "ascend-910c-die",
    "nvidia-a100-sxm-40gb", "nvidia-a100-sxm-80gb", "nvidia-h100-sxm", "nvidia-h100-pcie",
    "nvidia-h200-sxm", "nvidia-l40s", "nvidia-rtx-4090", "cpu-generic",
]
REQUIRED_NODES = ["atlas-800t-a2", "atlas-800t-a3", "atlas-900-a3-superpod-node", "dgx-a100",
                  "dgx-h100", "dgx-h200", "cpu-host"]


def test_catalog_has_the_required_entries():
    assert set(REQUIRED_DEVICES) <= set(list_devices())
    assert set(REQUIRED_NODES) <= set(list_nodes())
    assert list_devices() == sorted(list_devices())


@pytest.mark.parametrize("name", list_devices())
def test_every_device_has_positive_figures(name):
    spec = get_device(name)
    assert spec.name == name
    assert spec.memory_bw > 0 and spec.link_bw > 0 and spec.pcie_bw > 0 and spec.link_latency >= 0
    assert spec.peak_flops and all(v > 0 and math.isfinite(v) for v in spec.peak_flops.values())
    assert spec.memory_bytes > 0 or spec.kind == "cpu"
    assert spec.source, "every catalog entry says where its figures come from"
    assert spec.flops("fp16") > 0 or spec.flops("bf16") > 0
    if spec.kind != "cpu":
        # decode is memory-bound: an accelerator's memory is far faster than its fabric
        assert spec.memory_bw > spec.link_bw


@pytest.mark.parametrize("name", list_nodes())
def test_every_node_points_at_a_known_device(name):
    node = get_node(name)
    assert get_device(node.device).name == node.device
    assert node.num_devices >= 1 and node.nic_bw > 0 and node.nic_latency >= 0 and node.source


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(KeyError) as info:
        get_device("ascend-999")
    assert isinstance(info.value, UnknownHardwareError)
    message = str(info.value)
    assert message.startswith("unknown device 'ascend-999'")  # no KeyError quoting around it
    for name in list_devices():
        assert name in message


def test_unknown_node_lists_the_known_ones():
    with pytest.raises(UnknownHardwareError, match="known nodes: .*atlas-800t-a2"):
        get_node("atlas-9000")


def test_flops_accepts_aliases_and_names_unsupported_dtypes():
    h100 = get_device("nvidia-h100-sxm")
    assert h100.flops("bf16") == h100.flops("bfloat16") == h100.flops("torch.bfloat16") == 989.5e12
    assert get_device("nvidia-a100-sxm-80gb").flops("float16") == 312e12
    with pytest.raises(ValueError, match=r"'fp64'.*supported: .*bf16"):
        h100.flops("fp64")
    with pytest.raises(ValueError, match="ascend-310p3 has no peak figure for dtype 'bf16'"):
        get_device("ascend-310p3").flops("bf16")


def test_ascend_cube_peaks_follow_the_core_formula():
    # cube cores x 16x16x16 MAC x 2 FLOP x clock (CANN platform_config INI)
    assert get_device("ascend-910b2").flops("bf16") == pytest.approx(24 * 4096 * 2 * 1.8e9)
    assert get_device("ascend-910b4").flops("fp16") == pytest.approx(20 * 4096 * 2 * 1.5e9)
    for name in ("ascend-910b1", "ascend-910b2", "ascend-910b3", "ascend-910b4"):
        spec = get_device(name)
        assert spec.flops("int8") == 2 * spec.flops("fp16")
        assert spec.link_kind == "hccs" and spec.pair_bw < spec.link_bw  # p2p mesh, 1 link a pair
    assert get_device("ascend-910b3").memory_bytes == 64 * 2**30  # npu-smi: 65536 MB


def test_known_nvidia_figures():
    assert get_device("nvidia-h200-sxm").memory_bw == 4.8e12
    assert get_device("nvidia-h100-sxm").link_bw == 450e9  # 900 GB/s bidirectional
    assert get_device("nvidia-a100-sxm-40gb").memory_bw == 1555e9
    assert get_device("nvidia-l40s").link_kind == "pcie"


def test_node_fabrics_are_faster_inside_than_between_nodes():
    for name in ("atlas-800t-a2", "atlas-800t-a3", "dgx-h100", "dgx-a100"):
        node = get_node(name)
        assert get_device(node.device).link_bw > node.nic_bw
    assert get_node("atlas-800t-a2").num_devices == 8
    assert get_node("atlas-800t-a2").nic_bw == 25e9  # one 200 Gb/s RoCE port per NPU
    assert get_node("atlas-800t-a3").num_devices == 16  # 8 x 910C = 16 dies


def test_specs_are_hashable_values():
    a, b = get_device("nvidia-h100-sxm"), get_device("nvidia-h100-sxm")
    assert a == b and hash(a) == hash(b)
    assert len({get_device(n) for n in list_devices()}) == len(list_devices())


def test_spec_validation():
    with pytest.raises(ValueError):
        DeviceSpec(name="x", kind="tpu", vendor="v", memory_bytes=1, memory_bw=1, peak_flops={"bf16": 1},
                   link_kind="pcie", link_bw=1)
    with pytest.raises(ValueError, match="at least one dtype"):
        DeviceSpec(name="x", kind="gpu", vendor="v", memory_bytes=1, memory_bw=1, peak_flops={},
                   link_kind="pcie", link_bw=1)
    with pytest.raises(ValueError, match="must be > 0"):
        DeviceSpec(name="x", kind="gpu", vendor="v", memory_bytes=1, memory_bw=1,
                   peak_flops={"bf16": 0}, link_kind="pcie", link_bw=1)


def test_cpu_flops_per_cycle_by_isa():
    amx = cpu_flops_per_cycle({"avx512f", "amx_bf16", "amx_int8", "avx512_vnni"})
    assert amx == {"fp32": 64, "bf16": 1024, "fp16": 64, "int8": 2048}
    avx2 = cpu_flops_per_cycle({"avx2", "fma"})
    assert avx2 == {"fp32": 32, "bf16": 32, "fp16": 32, "int8": 32}
    assert cpu_flops_per_cycle({"asimd", "asimddp"}, "aarch64")["int8"] == 64
    assert cpu_flops_per_cycle(set())["fp32"] == 8


def test_cpu_host_spec():
    spec = cpu_host_spec(4, 8 * 2**30, flags={"avx512f", "amx_bf16"}, clock_hz=2e9, memory_bw=40e9)
    assert spec.kind == "cpu" and spec.link_kind == "memory" and spec.memory_bw == 40e9
    assert spec.flops("bf16") == 4 * 2e9 * 1024
    assert spec.flops("fp32") == 4 * 2e9 * 64
    default = cpu_host_spec(2, 0)
    assert default.memory_bw == 10e9 and default.flops("fp32") == 2 * 2.5e9 * 8
    with pytest.raises(ValueError, match="num_cores"):
        cpu_host_spec(0, 0)
    with pytest.raises(ValueError, match="memory_bytes"):
        cpu_host_spec(1, -1)


def test_module_exports():
    assert {"DeviceSpec", "NodeSpec", "get_device", "get_node", "cpu_host_spec"} <= set(hardware.__all__)
