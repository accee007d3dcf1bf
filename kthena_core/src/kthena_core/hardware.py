"""Hardware catalog: what one accelerator (or CPU host) and one server node can do.

Every figure below cites its public source in a comment. Conventions:

* Units are SI: bytes, bytes/s, FLOP/s, seconds. Device memory "GB" on vendor sheets is binary
  in practice (nvidia-smi and npu-smi report 81559 MiB for an "80GB" H100 and 65536 MB for a
  "64GB" 910B), so memory sizes use GiB.
* ``peak_flops`` are *dense* tensor/cube peaks. NVIDIA datasheets print sparse figures with an
  asterisk; those are halved here.
* ``link_bw`` is the per-device, *unidirectional*, aggregate intra-node bandwidth of the
  device's fabric (NVLink, HCCS, PCIe). Vendors quote bidirectional totals; those are halved.
* Ascend cube peaks are derived as ``cube cores x 16x16x16 MAC x 2 FLOP x cube clock``, the
  way CANN's ``platform_config/<SoC>.ini`` describes the core (``cube_m/n/k_size=16``); int8
  doubles K (``[DtypeMKN] DT_INT8=16,32,16``). Huawei publishes few per-variant figures, and
  third-party pages disagree (320-414 TFLOPS for "910B"), so these are marked as derived.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

import attrs

from kthena_core.dtypes import dtype_key

_Spec = TypeVar("_Spec")

__all__ = [
    "DEVICE_KINDS",
    "LINK_KINDS",
    "DeviceSpec",
    "NodeSpec",
    "UnknownHardwareError",
    "cpu_host_spec",
    "get_device",
    "get_node",
    "list_devices",
    "list_nodes",
]

DEVICE_KINDS = ("npu", "gpu", "cpu")
LINK_KINDS = ("hccs", "nvlink", "pcie", "memory")

GiB = 1 << 30
T = 1e12
G = 1e9

class UnknownHardwareError(KeyError):
    """A device or node name that is not in the catalog; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class FlopsTable(Mapping[str, float]):
    """An immutable, hashable ``dtype -> FLOP/s`` mapping (so specs can be dict keys)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, float]) -> None:
        self._items = {str(k): float(v) for k, v in items.items()}

    def __getitem__(self, key: str) -> float:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"FlopsTable({self._items!r})"


def _check_flops(instance: object, attribute: attrs.Attribute, value: FlopsTable) -> None:
    if not value:
        raise ValueError(f"{attribute.name}: at least one dtype is required")
    for key, flops in value.items():
        if not flops > 0:
            raise ValueError(f"{attribute.name}[{key!r}] must be > 0, got {flops}")


@attrs.frozen
class DeviceSpec:
    """Peak capabilities of one accelerator (or one CPU host seen as a single device).

    Attributes:
        name: catalog key, e.g. "ascend-910b3", "nvidia-h100-sxm", "cpu-generic".
        kind: "npu" | "gpu" | "cpu".
        vendor: "huawei", "nvidia", "intel", ...
        memory_bytes: device memory (HBM/GDDR); for a cpu, 0 means "use the host's RAM".
        memory_bw: device memory bandwidth, bytes/s.
        peak_flops: dense FLOP/s per dtype ("bf16", "fp16", "fp32", "int8", "fp8"); a missing
            key means unsupported.
        link_kind: intra-node fabric: "hccs" | "nvlink" | "pcie" | "memory".
        link_bw: per-device unidirectional aggregate intra-node bandwidth, bytes/s.
        link_latency: one-hop latency of that fabric, seconds.
        pcie_bw: unidirectional host-interface bandwidth (PCIe), bytes/s; the bandwidth of
            PCIe paths between devices when the fabric is not PCIe itself.
        link_p2p_bw: unidirectional bandwidth between one *pair* of devices when it is lower
            than ``link_bw`` (a point-to-point mesh such as HCCS on Atlas 800T A2 gives each pair
            one link; collectives use all links at once). None: same as ``link_bw``.
        source: short provenance note for ``kthena topo``.
    """

    name: str
    kind: str = attrs.field(validator=attrs.validators.in_(DEVICE_KINDS))
    vendor: str
    memory_bytes: int = attrs.field(validator=attrs.validators.ge(0))
    memory_bw: float = attrs.field(validator=attrs.validators.gt(0))
    peak_flops: Mapping[str, float] = attrs.field(converter=FlopsTable, validator=_check_flops)
    link_kind: str = attrs.field(validator=attrs.validators.in_(LINK_KINDS))
    link_bw: float = attrs.field(validator=attrs.validators.gt(0))
    link_latency: float = attrs.field(default=5e-6, validator=attrs.validators.ge(0))
    pcie_bw: float = attrs.field(default=32 * G, validator=attrs.validators.gt(0))
    link_p2p_bw: float | None = None
    source: str = ""

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` ("bf16", "bfloat16", "fp16", "fp32", "int8", ...).

        Raises:
            ValueError: the device has no figure for that dtype; the message lists the ones it has.
        """
        key = dtype_key(dtype)
        if key not in self.peak_flops:
            supported = ", ".join(sorted(self.peak_flops))
            raise ValueError(f"{self.name} has no peak figure for dtype {dtype!r}; supported: {supported}")
        return self.peak_flops[key]

    @property
    def pair_bw(self) -> float:
        """Unidirectional bandwidth between one pair of devices on the fabric, bytes/s."""
        return self.link_p2p_bw if self.link_p2p_bw is not None else self.link_bw


@attrs.frozen
class NodeSpec:
    """One server: ``num_devices`` identical devices plus the NICs that leave the node.

    Attributes:
        name: catalog key, e.g. "atlas-800t-a2", "dgx-h100", "cpu-host".
        device: DeviceSpec catalog name.
        num_devices: devices per node.
        nic_bw: inter-node bandwidth *per device*, bytes/s (e.g. one 200 Gb/s RoCE port per NPU).
        nic_latency: inter-node latency, seconds.
        source: short provenance note.
    """

    name: str
    device: str
    num_devices: int = attrs.field(validator=attrs.validators.gt(0))
    nic_bw: float = attrs.field(validator=attrs.validators.gt(0))
    nic_latency: float = attrs.field(default=10e-6, validator=attrs.validators.ge(0))
    source: str = ""


# ---------------------------------------------------------------------------------------------
# Huawei Ascend
# ---------------------------------------------------------------------------------------------

# HCCS on Atlas 800T A2: a point-to-point full mesh of 8 NPUs with no switch; each NPU has 7
# links, 56 GB/s per pair and 392 GB/s in total, both bidirectional. Source: ArthurChiao,
# "GPU Performance (Data Sheets) Quick Reference (2023)", section 3.1,
# https://arthurchiao.art/blog/gpu-data-sheets/ , which echoes "many sources say 392GB/s".
# Huawei has published no datasheet figure for it, and some pages quote 392 GB/s as the figure
# for one direction. Unidirectional here: 196 GB/s aggregate and 28 GB/s per pair.
_HCCS_A2_BW = 392 * G / 2
_HCCS_A2_PAIR_BW = 56 * G / 2

# A2-class HBM: 64 GB capacity and 1.6 TB/s ("Atlas A2: Memory容量 64 GB, Memory带宽 1.6TB/s").
# Source: CANN documentation issue gitcode.com/cann/ops-cv/issues/997, which checks the migration
# guide against the CANN platform_config INI files. Capacity is confirmed by real npu-smi
# captures (HBM 65536 MB; tests/data/npu-smi-info.*). Some third-party pages give 1.2 TB/s or
# less for the 910B.
_A2_HBM = 64 * GiB
_A2_HBM_BW = 1.6 * T


def _ascend_cube_flops(cube_cores: int, clock_hz: float) -> float:
    """cube cores x (16x16x16 MAC per cycle) x 2 FLOP/MAC x clock (CANN platform_config INI)."""
    return cube_cores * 16 * 16 * 16 * 2 * clock_hz


def _ascend_910b(name: str, cube_cores: int, clock_hz: float, memory: int, memory_bw: float,
                 source: str) -> DeviceSpec:
    half = _ascend_cube_flops(cube_cores, clock_hz)
    return DeviceSpec(
        name=name, kind="npu", vendor="huawei", memory_bytes=memory, memory_bw=memory_bw,
        # fp32: HF32 cube mode runs at half the fp16 rate (an assumption, documented in the guide);
        # int8 doubles K per cycle (INI [DtypeMKN] DT_INT8=16,32,16).
        peak_flops={"bf16": half, "fp16": half, "int8": 2 * half, "fp32": half / 2},
        link_kind="hccs", link_bw=_HCCS_A2_BW, link_p2p_bw=_HCCS_A2_PAIR_BW, link_latency=5e-6,
        # PCIe 4.0 x16 to the host CPU (Atlas 800T A2 host interface): 31.5 GB/s per direction.
        pcie_bw=31.5 * G,
        source=source,
    )


_DEVICES: dict[str, DeviceSpec] = {}


def _add(spec: DeviceSpec) -> None:
    _DEVICES[spec.name] = spec


# 910B1: 24 AI cores at 1800 MHz. A real `npu-smi info -t common` on a 910B1 host prints
# "Aicore Freq(MHZ): 1800" and "Aicore Count: 24" (ArthurChiao, "GPU 进阶笔记（二）：华为昇腾 910B
# GPU 相关（2023）", section 3.3). That gives 353.9 TFLOPS fp16 from the cube. Third-party pages
# quote 320-414 TFLOPS for 910B1; the figure is disputed.
_add(_ascend_910b("ascend-910b1", 24, 1.8e9, _A2_HBM, _A2_HBM_BW,
                  "derived: 24 cube cores @1.8 GHz (npu-smi capture); HBM per cann/ops-cv#997"))
# 910B2: 24 cube cores at 1800 MHz (CANN platform_config Ascend910B2C.ini: cube_core_cnt=24,
# cube_freq=1800). cann/ops-cv#997 states that 353.9T is the 910B2's pure cube peak and 376T the
# cube+vector total. Atlas 800T A2 ships it (vllm-ascend issue #975, 8x910B2 64 GB).
_add(_ascend_910b("ascend-910b2", 24, 1.8e9, _A2_HBM, _A2_HBM_BW,
                  "CANN Ascend910B2C.ini (24 cube cores @1.8 GHz); cann/ops-cv#997"))
# 910B3: 20 AI cores (HAMi vNPU templates and several vendor pages list 20). The 1800 MHz clock is
# assumed equal to the 910B2's and was not checked against Ascend910B3.ini. Third-party pages
# quote 313 TFLOPS; the figure is disputed. 64 GB is confirmed by real captures
# (ms-swift npu-smi, tests/data).
_add(_ascend_910b("ascend-910b3", 20, 1.8e9, _A2_HBM, _A2_HBM_BW,
                  "derived: 20 cube cores @1.8 GHz (clock assumed); capacity from npu-smi captures"))
# 910B4: 20 cube cores at 1500 MHz and memory_size=34359738368 (32 GiB), as a copy of CANN's
# Ascend910B4.ini quoted in an ascend-profile test suite shows. The HBM bandwidth of this
# 32 GB part is not published. 0.8 TB/s (half the 64 GB parts' stacks) is an assumption.
_add(_ascend_910b("ascend-910b4", 20, 1.5e9, 32 * GiB, 0.8 * T,
                  "derived: Ascend910B4.ini (20 cube cores @1.5 GHz, 32 GiB); bandwidth assumed"))

# 910C ("Ascend910" in npu-smi on Atlas A3 hosts): two 910B-class dies in one package. npu-smi
# lists each die as its own chip with 64 GB HBM (tests/data/npu-smi-info.atlas-a3-*). So the
# catalog device is one die. Huawei's CloudMatrix384 paper (arXiv:2506.12708, "Serving Large
# Language Models on Huawei CloudMatrix384", section 3) gives 752 TFLOPS dense BF16 and
# 128 GB / 3.2 TB/s HBM per package, i.e. 376 TFLOPS, 64 GB and 1.6 TB/s per die. The UB/HCCS
# scale-up bandwidth is quoted as 392 GB/s unidirectional per package in the paper. Other
# summaries say "196 GB/s per NPU". 196 GB/s per die is used, which is disputed.
_add(DeviceSpec(
    name="ascend-910c-die", kind="npu", vendor="huawei", memory_bytes=64 * GiB,
    memory_bw=1.6 * T,
    peak_flops={"bf16": 376 * T, "fp16": 376 * T, "int8": 752 * T, "fp32": 188 * T},
    link_kind="hccs", link_bw=196 * G, link_latency=2e-6, pcie_bw=31.5 * G,
    source="arXiv:2506.12708 (CloudMatrix384), per-die halves of the per-package figures",
))

# 310P3 (Atlas 300I Pro / 300V Pro class inference card): 70 TFLOPS fp16, 140 TOPS int8, 24 GB
# LPDDR4X at 204.8 GB/s. Source: Huawei "Atlas 300I Pro Inference Card" product page / datasheet
# (e.huawei.com). There is no HCCS, so cards talk over PCIe 4.0 x16. npu-smi shows 21527 MB
# usable (tests/data/npu-smi-info.atlas300i-*); discovery uses the reported figure.
_add(DeviceSpec(
    name="ascend-310p3", kind="npu", vendor="huawei", memory_bytes=24 * GiB, memory_bw=204.8 * G,
    peak_flops={"fp16": 70 * T, "int8": 140 * T},
    link_kind="pcie", link_bw=31.5 * G, link_latency=10e-6, pcie_bw=31.5 * G,
    source="Huawei Atlas 300I Pro datasheet (70 TFLOPS fp16 / 140 TOPS int8 / 204.8 GB/s)",
))

# ---------------------------------------------------------------------------------------------
# NVIDIA. Dense figures are the datasheet numbers without the sparsity asterisk.
# NVLink 3/4 carry 25 GB/s per direction per link (A100 has 12 links for 600 GB/s bidirectional,
# and H100 has 18 links for 900 GB/s bidirectional).
# ---------------------------------------------------------------------------------------------

_NV_LINK_LATENCY = 3e-6

# "NVIDIA A100 Tensor Core GPU" datasheet (nvidia.com/en-us/data-center/a100): BF16/FP16 tensor
# 312 TFLOPS, INT8 624 TOPS, FP32 19.5 TFLOPS, NVLink 600 GB/s. HBM2 40 GB at 1,555 GB/s and
# HBM2e 80 GB at 2,039 GB/s. PCIe Gen4 is 64 GB/s bidirectional.
_A100_FLOPS = {"bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T, "fp32": 19.5 * T, "tf32": 156 * T}
_add(DeviceSpec(
    name="nvidia-a100-sxm-40gb", kind="gpu", vendor="nvidia", memory_bytes=40 * GiB,
    memory_bw=1555 * G, peak_flops=_A100_FLOPS, link_kind="nvlink", link_bw=300 * G,
    link_latency=_NV_LINK_LATENCY, pcie_bw=32 * G, source="NVIDIA A100 datasheet",
))
_add(DeviceSpec(
    name="nvidia-a100-sxm-80gb", kind="gpu", vendor="nvidia", memory_bytes=80 * GiB,
    memory_bw=2039 * G, peak_flops=_A100_FLOPS, link_kind="nvlink", link_bw=300 * G,
    link_latency=_NV_LINK_LATENCY, pcie_bw=32 * G, source="NVIDIA A100 datasheet",
))

# "NVIDIA H100 Tensor Core GPU" datasheet, SXM column: BF16/FP16 1,979 TFLOPS with sparsity, so
# 989.5 dense; FP8/INT8 3,958 sparse, so 1,979 dense; FP32 67 TFLOPS; HBM3 80 GB at 3.35 TB/s;
# NVLink 900 GB/s; PCIe Gen5 128 GB/s.
_H100_SXM_FLOPS = {"bf16": 989.5 * T, "fp16": 989.5 * T, "fp8": 1979 * T, "int8": 1979 * T,
                   "fp32": 67 * T, "tf32": 494.5 * T}
_H100_SXM = DeviceSpec(
    name="nvidia-h100-sxm", kind="gpu", vendor="nvidia", memory_bytes=80 * GiB, memory_bw=3.35 * T,
    peak_flops=_H100_SXM_FLOPS, link_kind="nvlink", link_bw=450 * G,
    link_latency=_NV_LINK_LATENCY, pcie_bw=64 * G, source="NVIDIA H100 datasheet (SXM)",
)
_add(_H100_SXM)
# H100 PCIe: "NVIDIA H100 PCIe GPU" product brief PB-11133-001 and the datasheet's PCIe column:
# BF16/FP16 1,513 TFLOPS sparse, so 756 dense; FP32 51 TFLOPS; HBM2e 80 GB at 2.0 TB/s; PCIe Gen5
# x16 128 GB/s. The optional NVLink bridge joins only pairs, so PCIe is the node fabric here.
_add(DeviceSpec(
    name="nvidia-h100-pcie", kind="gpu", vendor="nvidia", memory_bytes=80 * GiB, memory_bw=2.0 * T,
    peak_flops={"bf16": 756 * T, "fp16": 756 * T, "fp8": 1513 * T, "int8": 1513 * T,
                "fp32": 51 * T, "tf32": 378 * T},
    link_kind="pcie", link_bw=64 * G, link_latency=10e-6, pcie_bw=64 * G,
    source="NVIDIA H100 PCIe product brief PB-11133-001 / datasheet",
))
# "NVIDIA H200 Tensor Core GPU" datasheet (SXM): 141 GB HBM3e at 4.8 TB/s. Compute is the same as
# H100 SXM (BF16 1,979 sparse, FP8 3,958 sparse). NVLink 900 GB/s. The 141 GB is decimal-ish
# (nvidia-smi reports 143771 MiB); 140 GiB is used.
_add(attrs.evolve(_H100_SXM, name="nvidia-h200-sxm", memory_bytes=140 * GiB, memory_bw=4.8 * T,
                  source="NVIDIA H200 datasheet (SXM)"))
# "NVIDIA L40S" datasheet: 48 GB GDDR6 at 864 GB/s. BF16/FP16 tensor 362.05 dense (733 sparse),
# FP8 733 dense, INT8 733 dense (1,466 sparse), FP32 91.6 TFLOPS. PCIe Gen4 x16 is 64 GB/s
# bidirectional, and there is no NVLink.
_add(DeviceSpec(
    name="nvidia-l40s", kind="gpu", vendor="nvidia", memory_bytes=48 * GiB, memory_bw=864 * G,
    peak_flops={"bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T, "int8": 733 * T,
                "fp32": 91.6 * T},
    link_kind="pcie", link_bw=32 * G, link_latency=10e-6, pcie_bw=32 * G,
    source="NVIDIA L40S datasheet",
))
# GeForce RTX 4090: "NVIDIA ADA GPU ARCHITECTURE" whitepaper v2.01, appendix table. 24 GB GDDR6X
# at 1,008 GB/s. FP16/BF16 tensor with FP32 accumulate is 165.2 TFLOPS dense (330.3 with FP16
# accumulate; GeForce halves FP32-accumulate). INT8 660.6 TOPS dense, FP32 82.6 TFLOPS.
# PCIe Gen4 x16; no NVLink, and the driver disables peer-to-peer, so copies go through the host.
_add(DeviceSpec(
    name="nvidia-rtx-4090", kind="gpu", vendor="nvidia", memory_bytes=24 * GiB, memory_bw=1008 * G,
    peak_flops={"bf16": 165.2 * T, "fp16": 165.2 * T, "fp8": 330.3 * T, "int8": 660.6 * T,
                "fp32": 82.6 * T},
    link_kind="pcie", link_bw=32 * G, link_latency=15e-6, pcie_bw=32 * G,
    source="NVIDIA Ada GPU architecture whitepaper v2.01",
))

# ---------------------------------------------------------------------------------------------
# CPU hosts
# ---------------------------------------------------------------------------------------------

# FLOP per cycle per core, by ISA. These are peaks that assume two FMA pipes (true for Xeon
# Gold/Platinum since Skylake-SP; Silver/Bronze have one) and are seldom reached:
#   AVX-512 FMA: 2 pipes x 16 fp32 lanes x 2 = 64 fp32 FLOP/cycle
#   AVX2 FMA: 2 x 8 x 2 = 32
#   aarch64 NEON (asimd): 2 pipes x 4 lanes x 2 = 16
#   avx512_bf16 (VDPBF16PS): 2 bf16 products per fp32 lane, so 2x fp32
#   avx512_fp16: 32 fp16 lanes, so 2x fp32
#   avx512_vnni (VPDPBUSD): 4 int8 products per 32-bit lane, so 4x fp32; avx_vnni on 256-bit is 2x
#   AMX (Sapphire Rapids and later): 1024 bf16/fp16 and 2048 int8 ops per cycle per core. Source:
#     Intel, "Intel Advanced Matrix Extensions (Intel AMX)" overview / Intel 64 and IA-32
#     Architectures Optimization Reference Manual, chapter "Intel AMX".
# Without a native bf16/fp16/int8 path, PyTorch converts to fp32, so those dtypes get the fp32 rate.
_DEFAULT_CPU_CLOCK_HZ = 2.5e9


def _fp32_per_cycle(flags: frozenset[str], arch: str) -> float:
    if "avx512f" in flags:
        return 64.0
    if "avx2" in flags and "fma" in flags:
        return 32.0
    if "avx2" in flags or "avx" in flags:
        return 16.0
    if "asimd" in flags or arch in ("aarch64", "arm64"):
        return 16.0
    return 8.0


def cpu_flops_per_cycle(flags: frozenset[str] | set[str], arch: str = "") -> dict[str, float]:
    """Peak FLOP (or int8 op) per cycle per core for each dtype, from CPU feature flags."""
    flags = frozenset(flags)
    fp32 = _fp32_per_cycle(flags, arch)
    bf16 = 1024.0 if "amx_bf16" in flags else 2 * fp32 if "avx512_bf16" in flags else fp32
    fp16 = 1024.0 if "amx_fp16" in flags else 2 * fp32 if "avx512_fp16" in flags else fp32
    if "amx_int8" in flags:
        int8 = 2048.0
    elif "avx512_vnni" in flags:
        int8 = 4 * fp32
    elif "avx_vnni" in flags or "asimddp" in flags:
        int8 = 2 * fp32 if "avx512f" in flags else 4 * fp32
    else:
        int8 = fp32
    return {"fp32": fp32, "bf16": bf16, "fp16": fp16, "int8": int8}


def cpu_host_spec(
    num_cores: int,
    memory_bytes: int,
    *,
    flags: frozenset[str] | set[str] = frozenset(),
    arch: str = "",
    clock_hz: float | None = None,
    memory_bw: float | None = None,
    peak_flops: Mapping[str, float] | None = None,
    name: str = "cpu-host",
    vendor: str = "generic",
    source: str = "",
) -> DeviceSpec:
    """A CPU host seen as one device, built from discovered facts.

    Args:
        num_cores: physical cores (or usable logical CPUs when the core count is unknown).
        memory_bytes: host RAM this device may use; 0 means "use the host's RAM".
        flags: /proc/cpuinfo flags (x86 "flags", aarch64 "Features").
        arch: "x86_64", "aarch64", ...
        clock_hz: sustained clock; unknown defaults to 2.5 GHz.
        memory_bw: measured (STREAM-like) bandwidth; unknown defaults to a rough 5 GB/s per
            core, clamped to [10, 300] GB/s. That is a placeholder; discovery passes the host
            probe's measurement (``kthena_core.discovery.host_probe``).
        peak_flops: measured FLOP/s per dtype for these cores; unknown: estimated as below.
        name, vendor: for display.
        source: where the figures come from (default: the estimate's description).

    Returns:
        A DeviceSpec of kind "cpu" whose peak_flops is ``cores x clock x FLOP/cycle`` from
        ``cpu_flops_per_cycle``, and whose fabric is shared memory at ``memory_bw``.

    Raises:
        ValueError: num_cores < 1 or memory_bytes < 0.
    """
    if num_cores < 1:
        raise ValueError(f"num_cores must be >= 1, got {num_cores}")
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
    clock = clock_hz if clock_hz and clock_hz > 0 else _DEFAULT_CPU_CLOCK_HZ
    per_cycle = cpu_flops_per_cycle(flags, arch)
    bw = memory_bw if memory_bw and memory_bw > 0 else min(max(5 * G * num_cores, 10 * G), 300 * G)
    peaks = dict(peak_flops) if peak_flops else {k: num_cores * clock * v for k, v in per_cycle.items()}
    return DeviceSpec(
        name=name, kind="cpu", vendor=vendor, memory_bytes=int(memory_bytes), memory_bw=bw,
        peak_flops=peaks, link_kind="memory", link_bw=bw, link_latency=1e-6, pcie_bw=bw,
        source=source or f"estimated: {num_cores} cores x {clock / 1e9:.2f} GHz x FLOP/cycle "
                         "from CPU flags; memory bandwidth a placeholder (not measured)",
    )


# A nominal 32-core AVX-512 server, used when nothing is discovered, e.g. in hand-written YAML.
# Memory 0 means "use the host's RAM". 8 channels of DDR4-3200 give 204.8 GB/s theoretical
# (JEDEC DDR4-3200: 25.6 GB/s per channel); ~100 GB/s sustained is used.
_add(attrs.evolve(
    cpu_host_spec(32, 0, flags={"avx512f", "avx2", "fma"}, clock_hz=2.5e9, memory_bw=100 * G,
                  name="cpu-generic"),
    source="nominal 32-core AVX-512 host, 2.5 GHz, ~100 GB/s DRAM (see hardware.py)",
))


# ---------------------------------------------------------------------------------------------
# Nodes
# ---------------------------------------------------------------------------------------------

_NODES: dict[str, NodeSpec] = {}


def _add_node(node: NodeSpec) -> None:
    if node.device not in _DEVICES:
        raise AssertionError(f"node {node.name} names unknown device {node.device}")
    _NODES[node.name] = node


# Atlas 800T A2: 8 x 910B over an HCCS full mesh, and one 200 GE RoCE port per NPU. The 910B2
# SKU is the one in vllm-ascend issue #975 ("Atlas 800T A2 8*910B(64G)"). A real 8 x 910B host
# shows 8 x 200G NICs, with `hccn_tool -i 3 -status -g` printing "Speed: 200000Mb/s"
# (ArthurChiao, "GPU 进阶笔记（二）", section 3.2).
_add_node(NodeSpec("atlas-800t-a2", "ascend-910b2", 8, nic_bw=200 * G / 8, nic_latency=10e-6,
                   source="vllm-ascend#975; ArthurChiao 910B notes (8x200G RoCE)"))
# Atlas 800T A3 / 800I A3: 8 x 910C = 16 dies (npu-smi lists 16 chips; hiascend MindCluster
# "A200T A3 Box8 SuperPoD/Atlas 800I A3 SuperPoD/Atlas 800T A3 SuperPoD" affinity page: 8 HiAM
# modules of 2 SIO-joined processors, HCCS between modules). Scale-out is RoCE. The
# CloudMatrix384 node has 8 x 400G parameter-plane ports for 8 packages (Architects' Tech
# Alliance, "Inside Huawei Atlas 900A3 SuperPoD (CM384)"), so 200 Gb/s per die.
_add_node(NodeSpec("atlas-800t-a3", "ascend-910c-die", 16, nic_bw=200 * G / 8, nic_latency=10e-6,
                   source="hiascend MindCluster A3 affinity docs; CM384 wiring (8x400G/node)"))
# A node inside an Atlas 900 A3 SuperPoD (CloudMatrix384): nodes are joined by the same UB/HCCS
# fabric (HCCS-L2) as inside the node, so the per-device bandwidth between nodes is the scale-up
# figure. Huawei claims about 0.2 us latency over UB (WAIC 2025 "Ascend 384 super node").
_add_node(NodeSpec("atlas-900-a3-superpod-node", "ascend-910c-die", 16, nic_bw=196 * G,
                   nic_latency=2e-6,
                   source="hiascend MindCluster Atlas 900 A3 SuperPoD docs; arXiv:2506.12708"))
# DGX A100 (640 GB): 8 x A100 80GB SXM on NVSwitch, and 8 x 200 Gb/s ConnectX-6 for compute.
# Source: "NVIDIA DGX A100 System Architecture" whitepaper / DGX A100 user guide.
_add_node(NodeSpec("dgx-a100", "nvidia-a100-sxm-80gb", 8, nic_bw=200 * G / 8,
                   source="NVIDIA DGX A100 system architecture (8x200Gb/s HDR)"))
# AWS p4d.24xlarge: 8 x A100 40GB with NVSwitch (NV12 in tests/data nvidia-smi topo), and
# 400 Gb/s EFA per instance, i.e. 50 Gb/s per GPU. Source: AWS EC2 P4 instance page.
_add_node(NodeSpec("aws-p4d", "nvidia-a100-sxm-40gb", 8, nic_bw=400 * G / 8 / 8,
                   source="AWS EC2 P4d (400 Gbps EFA per instance)"))
# DGX H100: 8 x H100 SXM on NVSwitch, and 8 x 400 Gb/s ConnectX-7 (one per GPU). Source: NVIDIA
# DGX H100 datasheet / user guide.
_add_node(NodeSpec("dgx-h100", "nvidia-h100-sxm", 8, nic_bw=400 * G / 8,
                   source="NVIDIA DGX H100 datasheet (8x400Gb/s ConnectX-7)"))
# DGX H200: the same system with H200 GPUs and the same 8 x 400 Gb/s. Source: NVIDIA DGX H200
# datasheet.
_add_node(NodeSpec("dgx-h200", "nvidia-h200-sxm", 8, nic_bw=400 * G / 8,
                   source="NVIDIA DGX H200 datasheet (8x400Gb/s ConnectX-7)"))
# A PCIe H100 server with 8 cards, and 1 x 200 Gb/s per GPU assumed (configurations vary).
_add_node(NodeSpec("pcie-h100x8", "nvidia-h100-pcie", 8, nic_bw=200 * G / 8,
                   source="generic 8-card PCIe server; NIC assumed 200 Gb/s per GPU"))
# AWS g6e.12xlarge: 4 x L40S on PCIe (all NODE in tests/data nvidia-smi topo) and 100 Gb/s per
# instance. Source: AWS EC2 G6e instance page.
_add_node(NodeSpec("aws-g6e-12xlarge", "nvidia-l40s", 4, nic_bw=100 * G / 8 / 4,
                   source="AWS EC2 G6e (100 Gbps per g6e.12xlarge)"))
# An 8 x RTX 4090 PCIe box with 2 NUMA nodes (tests/data: go-gpuallocator#17), and 100 GbE
# per node assumed.
_add_node(NodeSpec("rtx4090x8", "nvidia-rtx-4090", 8, nic_bw=100 * G / 8 / 8,
                   source="generic 8 x RTX 4090 PCIe server; NIC assumed 100 GbE per node"))
# A generic CPU host with one 10 GbE NIC (assumed).
_add_node(NodeSpec("cpu-host", "cpu-generic", 1, nic_bw=10 * G / 8, nic_latency=30e-6,
                   source="generic host, 10 GbE assumed"))


def get_device(name: str) -> DeviceSpec:
    """The catalog DeviceSpec called ``name``.

    Raises:
        UnknownHardwareError: (a KeyError) naming ``name`` and listing the known devices.
    """
    return _lookup(_DEVICES, "device", name)


def get_node(name: str) -> NodeSpec:
    """The catalog NodeSpec called ``name``.

    Raises:
        UnknownHardwareError: (a KeyError) naming ``name`` and listing the known nodes.
    """
    return _lookup(_NODES, "node", name)


def _lookup(table: dict[str, _Spec], kind: str, name: str) -> _Spec:
    try:
        return table[name]
    except KeyError:
        raise UnknownHardwareError(
            f"unknown {kind} {name!r}; known {kind}s: {', '.join(sorted(table))}") from None


def list_devices() -> list[str]:
    """Sorted names of the catalog devices."""
    return sorted(_DEVICES)


def list_nodes() -> list[str]:
    """Sorted names of the catalog nodes."""
    return sorted(_NODES)
