"""Topology discovery for this machine: Ascend NPUs, NVIDIA GPUs, then the CPU.

``discover()`` returns the best topology found (npu > gpu > cpu). ``discover_all()`` also says
why the others were not used. Probes for absent hardware return ``NotPresent(kind, reason)``
and never raise. The parsers are pure functions of recorded command output, so they are tested
on real captures (kthena_core/tests/data).
"""

from __future__ import annotations

from typing import Any

import attrs

from kthena_core.discovery._common import (
    NotPresent,
    ParseError,
    TopoMatrix,
    parse_cpulist,
    run_command,
)
from kthena_core.discovery.ascend import (
    NpuChip,
    NpuSmiInfo,
    build_ascend_topology,
    discover_ascend,
    parse_npu_smi_info,
    parse_npu_topo,
)
from kthena_core.discovery.cpu import (
    CpuFacts,
    NumactlInfo,
    NumaNode,
    cpu_topology,
    discover_cpu,
    numa_cpu_map,
    parse_lscpu,
    parse_numactl_hardware,
    read_cpu_facts,
)
from kthena_core.discovery.describe import describe
from kthena_core.discovery.host_probe import HostFigures, measure_host
from kthena_core.discovery.nvidia import (
    GpuInfo,
    build_nvidia_topology,
    discover_nvidia,
    parse_nvidia_query_csv,
    parse_nvidia_topo,
)
from kthena_core.topology import Topology

__all__ = [
    "CpuFacts",
    "Discovery",
    "GpuInfo",
    "HostFigures",
    "NotPresent",
    "NpuChip",
    "NpuSmiInfo",
    "NumaNode",
    "NumactlInfo",
    "ParseError",
    "TopoMatrix",
    "build_ascend_topology",
    "build_nvidia_topology",
    "cpu_topology",
    "describe",
    "discover",
    "discover_all",
    "discover_ascend",
    "discover_cpu",
    "discover_nvidia",
    "measure_host",
    "parse_cpulist",
    "parse_lscpu",
    "parse_npu_smi_info",
    "parse_npu_topo",
    "parse_numactl_hardware",
    "parse_nvidia_query_csv",
    "parse_nvidia_topo",
    "read_cpu_facts",
    "run_command",
]


@attrs.frozen
class Discovery:
    """What each probe found: a Topology, or NotPresent with the reason."""

    npu: Topology | NotPresent
    gpu: Topology | NotPresent
    cpu: Topology

    @property
    def best(self) -> Topology:
        """npu > gpu > cpu."""
        for found in (self.npu, self.gpu):
            if isinstance(found, Topology):
                return found
        return self.cpu

    def describe(self) -> str:
        lines = []
        for kind in ("npu", "gpu", "cpu"):
            found = getattr(self, kind)
            status = f"not present ({found.reason})" if isinstance(found, NotPresent) else \
                f"{found.num_devices} device(s)"
            lines.append(f"{kind}: {status}")
        lines.append(f"using: {self.best.source}")
        lines.append(describe(self.best))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        def one(found: Topology | NotPresent) -> dict[str, Any]:
            if isinstance(found, NotPresent):
                return {"present": False, "reason": found.reason}
            return {"present": True, "topology": found.to_dict()}

        return {"npu": one(self.npu), "gpu": one(self.gpu), "cpu": one(self.cpu),
                "using": self.best.source}


def discover_all(*, per_numa: bool = False, per_core: bool = False,
                 use_torch: bool = True, host: HostFigures | None = None) -> Discovery:
    """Run every probe (never raises except for per_numa with per_core). Ascend devices get NUMA
    affinities from the CPU facts. ``per_numa`` / ``per_core`` split the CPU host (cpu.py);
    ``host`` is its measured bandwidth and matmul peak (``measure_host``; None: estimates)."""
    facts = read_cpu_facts()
    cpu = cpu_topology(facts, per_numa=per_numa, per_core=per_core, host=host)
    npu = _guard("npu", lambda: discover_ascend(numa_cpus=numa_cpu_map(facts)))
    gpu = _guard("gpu", lambda: discover_nvidia(use_torch=use_torch))
    return Discovery(npu=npu, gpu=gpu, cpu=cpu)


def discover(*, per_numa: bool = False, per_core: bool = False, use_torch: bool = True,
             host: HostFigures | None = None) -> Topology:
    """The best topology on this machine: Ascend NPUs, else NVIDIA GPUs, else the CPU host (one
    device, one per NUMA node with ``per_numa``, one per core with ``per_core``; its figures
    measured when ``host`` is given)."""
    return discover_all(per_numa=per_numa, per_core=per_core, use_torch=use_torch, host=host).best


def _guard(kind: str, probe: Any) -> Topology | NotPresent:
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001 - a probe bug must degrade to "not present"
        return NotPresent(kind, f"probe failed: {type(exc).__name__}: {exc}")
