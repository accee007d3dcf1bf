"""NVIDIA GPU discovery: torch.cuda when it is importable and sees GPUs, else ``nvidia-smi``.

``nvidia-smi topo -m`` gives the relation of every GPU pair, and each relation becomes a Link:

======  =========================================================  ===========================
cell    meaning (nvidia-smi legend)                                link built here
======  =========================================================  ===========================
NV#     a bonded set of # NVLinks                                  nvlink, # x 25 GB/s per
                                                                   direction (NVLink 3/4), capped
                                                                   at the spec's NVLink total
PIX     at most one PCIe bridge                                    pcie, spec.pcie_bw
PXB     several PCIe bridges, no host bridge                       pcie, spec.pcie_bw
PHB     through a PCIe host bridge (the CPU)                       pcie, 0.75 x spec.pcie_bw
NODE    between host bridges inside one NUMA node                  pcie, 0.75 x spec.pcie_bw
SYS     across the SMP interconnect between NUMA nodes (QPI/UPI)   sys, 0.5 x spec.pcie_bw
======  =========================================================  ===========================

The 0.75 and 0.5 factors are a ranking heuristic, not measurements. They make the planner prefer
fewer hops, and ``link_domains`` groups GPUs by the best class present.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
from collections.abc import Sequence

import attrs

from kthena_core.discovery._common import (
    NotPresent,
    ParseError,
    Runner,
    TopoMatrix,
    parse_topo_matrix,
    pcie_link,
    run_command,
    run_parsed,
)
from kthena_core.hardware import DeviceSpec, get_device
from kthena_core.topology import Device, Link, Topology

__all__ = [
    "GpuInfo",
    "build_nvidia_topology",
    "discover_nvidia",
    "nvidia_catalog_name",
    "nvidia_spec",
    "parse_nvidia_query_csv",
    "parse_nvidia_topo",
]

NVLINK_BW_PER_LINK = 25e9  # bytes/s per direction per NVLink 3/4 link (600 GB/s / 12 / 2 on A100)

@attrs.frozen
class GpuInfo:
    """One GPU as a probe reports it."""

    name: str
    memory_bytes: int
    bus_id: str = ""


def parse_nvidia_topo(text: str) -> TopoMatrix:
    """Parse ``nvidia-smi topo -m`` (tab- or space-separated, with or without legends).

    Raises:
        ParseError: no GPU header, or rows that do not match it.
    """
    return parse_topo_matrix(text, "GPU")


def parse_nvidia_query_csv(text: str) -> tuple[GpuInfo, ...]:
    """Parse ``nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv`` in any column order.

    The header names the columns ("name", "memory.total [MiB]", "pci.bus_id"); aliases such as
    gpu_name are printed under their canonical names.

    Raises:
        ParseError: no header, or no name / memory.total column.
    """
    rows = [r for r in csv.reader(io.StringIO(text.strip()), skipinitialspace=True) if r]
    if not rows:
        raise ParseError("empty nvidia-smi CSV output")
    header = [h.strip().split(" [")[0] for h in rows[0]]
    for required in ("name", "memory.total"):
        if required not in header:
            raise ParseError(f"nvidia-smi CSV header {rows[0]} has no {required!r} column")
    i_name, i_mem = header.index("name"), header.index("memory.total")
    i_bus = header.index("pci.bus_id") if "pci.bus_id" in header else None
    gpus = []
    for row in rows[1:]:
        m = re.match(r"(\d+)\s*MiB", row[i_mem].strip())
        if not m:
            raise ParseError(f"memory.total {row[i_mem]!r} is not '<n> MiB'")
        gpus.append(GpuInfo(name=row[i_name].strip(), memory_bytes=int(m[1]) * 2**20,
                            bus_id=row[i_bus].strip() if i_bus is not None else ""))
    return tuple(gpus)


def nvidia_catalog_name(name: str, memory_bytes: int = 0) -> str | None:
    """Catalog key for a GPU name as torch / nvidia-smi print it, or None when not catalogued."""
    n = name.lower()
    if "h200" in n:
        return "nvidia-h200-sxm"
    if "h100" in n:
        return "nvidia-h100-pcie" if ("pcie" in n or "nvl" in n) else "nvidia-h100-sxm"
    if "a100" in n and "pcie" not in n:
        big = "80gb" in n or memory_bytes > 50 * 2**30
        return "nvidia-a100-sxm-80gb" if big else "nvidia-a100-sxm-40gb"
    if "l40s" in n:
        return "nvidia-l40s"
    if "4090" in n:
        return "nvidia-rtx-4090"
    return None


def nvidia_spec(name: str, memory_bytes: int) -> DeviceSpec:
    """The catalog spec for ``name`` with the memory the probe saw. GPUs missing from the catalog
    get a placeholder spec named "nvidia-generic:<name>"; describe() flags it."""
    key = nvidia_catalog_name(name, memory_bytes)
    if key is not None:
        spec = get_device(key)
        return attrs.evolve(spec, memory_bytes=memory_bytes) if memory_bytes else spec
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"
    return DeviceSpec(
        name=f"nvidia-generic:{slug}", kind="gpu", vendor="nvidia", memory_bytes=memory_bytes,
        memory_bw=500e9, peak_flops={"fp32": 10e12, "fp16": 50e12, "bf16": 50e12},
        link_kind="pcie", link_bw=16e9, pcie_bw=16e9,
        source=f"placeholder: {name!r} is not in the catalog; figures are rough guesses",
    )


def _link_from_relation(rel: str, a: int, b: int, spec_a: DeviceSpec, spec_b: DeviceSpec) -> Link | None:
    if m := re.fullmatch(r"NV(\d+)", rel):
        bw = int(m[1]) * NVLINK_BW_PER_LINK
        caps = [s.link_bw for s in (spec_a, spec_b) if s.link_kind == "nvlink"]
        return Link(a, b, "nvlink", min([bw, *caps]), 3e-6, via=rel)
    return pcie_link(rel, a, b, spec_a, spec_b)  # None for X, N/A, unknown: the spec applies


def build_nvidia_topology(gpus: Sequence[GpuInfo], matrix: TopoMatrix | None = None, *,
                          source: str = "discovered:nvidia") -> Topology:
    """A single-node topology from GPU facts and, optionally, the ``topo -m`` matrix.

    Raises:
        ParseError: the matrix lists a different number of GPUs than ``gpus``.
    """
    if not gpus:
        raise ParseError("no GPUs to build a topology from")
    specs = [nvidia_spec(g.name, g.memory_bytes) for g in gpus]
    if matrix is not None and len(matrix.devices) != len(gpus):
        raise ParseError(f"topo -m lists {len(matrix.devices)} GPUs but the probe found {len(gpus)}")
    devices = tuple(
        Device(i, 0, i, spec, numa_node=matrix.numa_affinity[i] if matrix else None)
        for i, spec in enumerate(specs)
    )
    links = matrix.links(specs, _link_from_relation) if matrix is not None else []
    name = f"{len(gpus)}x {gpus[0].name}" if len({g.name for g in gpus}) == 1 else f"{len(gpus)} GPUs"
    return Topology(devices=devices, links=tuple(links), name=name, source=source)


def _gpus_from_torch() -> tuple[GpuInfo, ...] | NotPresent:
    try:
        import torch  # lazy: kthena_core never imports torch at module import time
    except Exception as exc:  # noqa: BLE001 - any import failure means "no torch here"
        return NotPresent("gpu", f"torch not importable ({type(exc).__name__})")
    try:
        if not torch.cuda.is_available():
            return NotPresent("gpu", "torch.cuda.is_available() is False")
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # noqa: BLE001 - a broken driver must not crash discovery
        return NotPresent("gpu", f"torch.cuda failed: {exc}")
    return tuple(GpuInfo(name=p.name, memory_bytes=int(p.total_memory)) for p in props)


def _gpus_from_smi(runner: Runner) -> tuple[GpuInfo, ...] | NotPresent:
    gpus = run_parsed(runner, ["nvidia-smi", "--query-gpu=name,memory.total,pci.bus_id",
                               "--format=csv"], parse_nvidia_query_csv, "gpu",
                      "nvidia-smi output")
    if isinstance(gpus, NotPresent):  # falsy, like an empty list: say why, not "no GPUs"
        return gpus
    return gpus or NotPresent("gpu", "nvidia-smi lists no GPUs")


def _driver_present() -> bool:
    return bool(shutil.which("nvidia-smi")) or os.path.exists("/dev/nvidia0") or \
        os.path.exists("/proc/driver/nvidia/version")


def discover_nvidia(*, runner: Runner | None = None, use_torch: bool = True,
                    check_driver: bool = True) -> Topology | NotPresent:
    """This machine's NVIDIA GPUs as a Topology, or NotPresent with the reason. Never raises.

    Args:
        runner: runs probe commands (default: subprocess); tests replay recorded outputs.
        use_torch: try torch.cuda first (imported lazily, only when a driver is present).
        check_driver: skip everything, importing torch included, when there is neither
            nvidia-smi nor /dev/nvidia0.
    """
    runner = runner or run_command
    if check_driver and not _driver_present():
        return NotPresent("gpu", "no NVIDIA driver (nvidia-smi not on PATH, /dev/nvidia0 absent)")
    gpus: tuple[GpuInfo, ...] | NotPresent = NotPresent("gpu", "torch not tried")
    source = "discovered:nvidia-smi"
    if use_torch:
        gpus = _gpus_from_torch()
        source = "discovered:torch.cuda"
    if isinstance(gpus, NotPresent):
        reason = gpus.reason
        gpus = _gpus_from_smi(runner)
        source = "discovered:nvidia-smi"
        if isinstance(gpus, NotPresent):
            return NotPresent("gpu", f"{reason}; {gpus.reason}")
    matrix = None
    topo_out = runner(["nvidia-smi", "topo", "-m"])
    if not isinstance(topo_out, NotPresent):
        try:
            matrix = parse_nvidia_topo(topo_out)
        except ParseError:
            matrix = None
    if matrix is not None and len(matrix.devices) != len(gpus):
        matrix = None  # e.g. CUDA_VISIBLE_DEVICES hides some GPUs from torch
    try:
        return build_nvidia_topology(gpus, matrix, source=source + ("+topo" if matrix else ""))
    except (ParseError, ValueError) as exc:
        return NotPresent("gpu", f"could not build a topology: {exc}")
