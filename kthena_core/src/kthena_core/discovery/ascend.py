"""Ascend NPU discovery by parsing ``npu-smi info`` and ``npu-smi info -t topo``.

torch_npu is never imported here. Without CANN it breaks ``import torch`` itself (DESIGN.md),
and npu-smi already reports what planning needs.

``npu-smi info`` layouts handled (see tests/data):

* Atlas 800T A2 (910B1/B2/B3): two table lines per NPU, header ``Chip`` then ``Bus-Id``, and an
  HBM column "used / total" in MB.
* Atlas A3 (910C, name "Ascend910"): two chips (dies) per NPU, header ``Chip  Phy-ID``; each
  chip is one logical device with its own 64 GB.
* Atlas 300I (310P3): header ``Chip  Device``, no HBM column (memory is "used / total"), and
  non-contiguous NPU ids (0, 32, 96, 32768, ...).

Every chip becomes one device, in print order. An NPU with a process in the process table is
"busy", and health other than OK is "unhealthy".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import attrs

from kthena_core.discovery._common import (
    NotPresent,
    ParseError,
    Runner,
    TopoMatrix,
    numa_of_cpus,
    parse_cpulist,
    parse_topo_matrix,
    pcie_link,
    run_command,
    run_parsed,
)
from kthena_core.hardware import DeviceSpec, UnknownHardwareError, get_device
from kthena_core.topology import Device, Link, Topology

__all__ = [
    "NpuChip",
    "NpuSmiInfo",
    "ascend_catalog_name",
    "build_ascend_topology",
    "discover_ascend",
    "parse_npu_smi_info",
    "parse_npu_topo",
]

_BUS_RE = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
@attrs.frozen
class NpuChip:
    """One chip (logical device) from ``npu-smi info``.

    Attributes:
        npu_id: the NPU (card) id, not necessarily contiguous (310P: 0, 32, 96, ...).
        name: "910B2", "Ascend910", "310P3", ...
        health: "OK", "Warning", "Alarm", "Critical", ...
        chip_id: chip index within the NPU.
        phy_id: the second number on the chip line ("Phy-ID" on A3, "Device" on 310P), if printed.
        bus_id: PCIe bus id.
        memory_used_mb / memory_total_mb: the HBM column (or the memory column on 310P).
    """

    npu_id: int
    name: str
    health: str
    chip_id: int
    phy_id: int | None
    bus_id: str
    memory_used_mb: int | None
    memory_total_mb: int | None


@attrs.frozen
class NpuSmiInfo:
    """Parsed ``npu-smi info``."""

    version: str
    chips: tuple[NpuChip, ...]
    busy_npus: frozenset[int] = frozenset()

    @property
    def chips_per_npu(self) -> int:
        counts: dict[int, int] = {}
        for chip in self.chips:
            counts[chip.npu_id] = counts.get(chip.npu_id, 0) + 1
        return max(counts.values(), default=0)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """Parse ``npu-smi info``. Lines it does not recognise (borders, '...') are skipped.

    Raises:
        ParseError: the text is not npu-smi output (no version banner and no NPU lines).
    """
    m = re.search(r"npu-smi\s+(\S+)", text)
    version = m[1] if m else ""
    chips: list[NpuChip] = []
    busy: set[int] = set()
    pending: tuple[int, str, str] | None = None
    in_processes = False
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = _cells(line)
        if "Process id" in line:
            in_processes = True
            continue
        if in_processes:
            head = re.fullmatch(r"(\d+)\s+\d+", cells[0])
            if head and len(cells) > 1 and cells[1].isdigit():
                busy.add(int(head[1]))
            continue
        if len(cells) < 3:
            continue
        first = re.fullmatch(r"(\d+)\s+(\S+)", cells[0])
        second = re.fullmatch(r"(\d+)(?:\s+(\d+))?", cells[0])
        if second and _BUS_RE.match(cells[1]) and pending is not None:
            pairs = re.findall(r"(\d+)\s*/\s*(\d+)", cells[2])
            used, total = (int(pairs[-1][0]), int(pairs[-1][1])) if pairs else (None, None)
            npu_id, name, health = pending
            chips.append(NpuChip(npu_id=npu_id, name=name, health=health, chip_id=int(second[1]),
                                 phy_id=int(second[2]) if second[2] else None, bus_id=cells[1],
                                 memory_used_mb=used, memory_total_mb=total))
            pending = None
        elif first and re.fullmatch(r"[A-Za-z]+", cells[1]):
            pending = (int(first[1]), first[2], cells[1])
    if not chips and not version:
        raise ParseError("not npu-smi output: no 'npu-smi <version>' banner and no NPU lines")
    return NpuSmiInfo(version=version, chips=tuple(chips), busy_npus=frozenset(busy))


def parse_npu_topo(text: str) -> TopoMatrix:
    """Parse ``npu-smi info -t topo`` (NPU x NPU relations plus CPU Affinity).

    Raises:
        ParseError: no NPU header, or rows that do not match it.
    """
    return parse_topo_matrix(text, "NPU")


def ascend_catalog_name(name: str, chips_per_npu: int = 1) -> str | None:
    """Catalog key for an npu-smi chip name ("910B3" -> "ascend-910b3"), or None."""
    if m := re.fullmatch(r"(?:Ascend)?(910B[1-4])\w*", name, re.I):
        return f"ascend-{m[1].lower()}"
    if re.fullmatch(r"(?:Ascend)?910(?:_93\d*|C)?", name, re.I) and chips_per_npu == 2:
        return "ascend-910c-die"
    if re.fullmatch(r"(?:Ascend)?310P3", name, re.I):
        return "ascend-310p3"
    return None


def _spec_for(chip: NpuChip, chips_per_npu: int) -> DeviceSpec:
    key = ascend_catalog_name(chip.name, chips_per_npu)
    memory = (chip.memory_total_mb or 0) * 2**20
    try:
        spec = get_device(key) if key else None
    except UnknownHardwareError:
        spec = None
    if spec is not None:
        return attrs.evolve(spec, memory_bytes=memory) if memory else spec
    slug = re.sub(r"[^a-z0-9]+", "-", chip.name.lower()).strip("-") or "unknown"
    return DeviceSpec(
        name=f"ascend-generic:{slug}", kind="npu", vendor="huawei", memory_bytes=memory,
        memory_bw=400e9, peak_flops={"fp16": 100e12, "int8": 200e12}, link_kind="pcie",
        link_bw=16e9, pcie_bw=16e9,
        source=f"placeholder: {chip.name!r} is not in the catalog; figures are rough guesses",
    )


def _link(rel: str, a: int, b: int, sa: DeviceSpec, sb: DeviceSpec) -> Link | None:
    if rel.startswith("HCCS") or rel in ("SIO", "UB"):
        kind = "hccs" if rel.startswith("HCCS") else rel.lower()
        return Link(a, b, kind, min(sa.link_bw, sb.link_bw), max(sa.link_latency, sb.link_latency), via=rel)
    return pcie_link(rel, a, b, sa, sb)  # None for X, N/A, unknown: the spec applies


def build_ascend_topology(info: NpuSmiInfo, matrix: TopoMatrix | None = None, *,
                          numa_cpus: Mapping[int, Sequence[int]] | None = None,
                          source: str = "discovered:npu-smi") -> Topology:
    """A single-node topology from parsed npu-smi output.

    Args:
        info: ``parse_npu_smi_info`` result.
        matrix: ``parse_npu_topo`` result; ignored when its size differs from the chip count.
        numa_cpus: NUMA node -> CPUs, to turn each NPU's CPU affinity into a NUMA node.

    Raises:
        ParseError: no chips.
    """
    if not info.chips:
        raise ParseError("npu-smi lists no NPUs")
    per_npu = info.chips_per_npu
    specs = [_spec_for(chip, per_npu) for chip in info.chips]
    if matrix is not None and len(matrix.devices) != len(specs):
        matrix = None
    devices = []
    for i, (chip, spec) in enumerate(zip(info.chips, specs, strict=True)):
        numa = None
        if matrix is not None and numa_cpus and matrix.cpu_affinity[i]:
            try:
                numa = numa_of_cpus(parse_cpulist(matrix.cpu_affinity[i]), numa_cpus)
            except ParseError:
                numa = None
        health = "ok" if chip.health.upper() == "OK" else "unhealthy"
        if health == "ok" and chip.npu_id in info.busy_npus:
            health = "busy"
        devices.append(Device(i, 0, i, spec, numa_node=numa, health=health))
    links = matrix.links(specs, _link) if matrix is not None else []
    names = {c.name for c in info.chips}
    name = f"{len(specs)}x {info.chips[0].name}" if len(names) == 1 else f"{len(specs)} NPUs"
    return Topology(devices=tuple(devices), links=tuple(links), name=name,
                    source=source + ("+topo" if matrix is not None else ""))


def discover_ascend(*, runner: Runner | None = None,
                    numa_cpus: Mapping[int, Sequence[int]] | None = None) -> Topology | NotPresent:
    """This machine's Ascend NPUs as a Topology, or NotPresent with the reason. Never raises."""
    runner = runner or run_command
    info = run_parsed(runner, ["npu-smi", "info"], parse_npu_smi_info, "npu", "npu-smi info")
    if isinstance(info, NotPresent):
        return info
    if not info.chips:
        return NotPresent("npu", "npu-smi info lists no NPUs")
    matrix = None
    topo_out = runner(["npu-smi", "info", "-t", "topo"])
    if not isinstance(topo_out, NotPresent):
        try:
            matrix = parse_npu_topo(topo_out)
        except ParseError:
            matrix = None
    try:
        return build_ascend_topology(info, matrix, numa_cpus=numa_cpus)
    except (ParseError, ValueError) as exc:
        return NotPresent("npu", f"could not build a topology: {exc}")
