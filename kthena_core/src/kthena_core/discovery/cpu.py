"""CPU discovery: sockets, cores, NUMA nodes, memory and ISA flags of this host.

Sources, in order: /proc/cpuinfo (flags, sockets, cores), /sys/devices/system/node (NUMA nodes,
their CPUs and memory), /proc/meminfo and the cgroup memory limit (usable RAM), and
``os.sched_getaffinity`` (the CPUs this process may use, which is what a container grants).
``parse_lscpu`` and ``parse_numactl_hardware`` read the same facts from recorded command output.

The host becomes **one cpu device** by default. The CPU backend runs one process per host that
uses every core through torch's intra-op threads, and splitting a small model across NUMA halves
with gloo costs more than it saves. ``per_numa=True`` gives one device per NUMA node, which
some experiments need. ``per_core=True`` gives one device per usable physical core, the way
``kthena serve --tp/--pp/--dp`` places one rank per core, joined by gloo over loopback.

The host's memory bandwidth and matmul peak come from ``host`` (the host probe's measurement,
``host_probe.measure_host``, cached per machine); without it they are estimates from the clock
and flags and a bandwidth placeholder, and the device's ``source`` says so.
"""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path

import attrs

from kthena_core.discovery._common import ParseError, parse_cpuinfo, parse_cpulist
from kthena_core.discovery.host_probe import HostFigures
from kthena_core.hardware import cpu_host_spec, get_node
from kthena_core.topology import Device, Link, Topology

__all__ = [
    "CpuFacts",
    "NumaNode",
    "NumactlInfo",
    "GLOO_LOOPBACK_BW",
    "GLOO_LOOPBACK_LATENCY",
    "cpu_topology",
    "discover_cpu",
    "parse_cpuinfo",
    "parse_lscpu",
    "parse_numactl_hardware",
    "read_cpu_facts",
]


@attrs.frozen
class NumaNode:
    """One NUMA node: its id, CPUs and memory (None when the source does not say)."""

    id: int
    cpus: tuple[int, ...]
    memory_bytes: int | None = None


@attrs.frozen
class CpuFacts:
    """What discovery learnt about the host CPU.

    Attributes:
        model_name: e.g. "Intel(R) Xeon(R) Gold 6348 CPU @ 2.60GHz", "Kunpeng-920".
        arch: "x86_64", "aarch64", ...
        vendor: "GenuineIntel", "HiSilicon", ...
        num_cpus: usable logical CPUs.
        num_cores: usable physical cores (logical CPUs / threads per core when known).
        num_sockets: None when the source cannot be trusted (lscpu prints "-" on some ARM hosts).
        threads_per_core: None when unknown.
        numa_nodes: NUMA nodes in id order (empty when unknown).
        memory_bytes: usable RAM (0 when unknown).
        flags: ISA feature flags (x86 "flags", aarch64 "Features").
        clock_hz: max or nominal clock, None when unknown.
    """

    model_name: str = ""
    arch: str = ""
    vendor: str = ""
    num_cpus: int = 1
    num_cores: int = 1
    num_sockets: int | None = None
    threads_per_core: int | None = None
    numa_nodes: tuple[NumaNode, ...] = ()
    memory_bytes: int = 0
    flags: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    clock_hz: float | None = None


@attrs.frozen
class NumactlInfo:
    """``numactl --hardware``: nodes (with memory) and the distance matrix."""

    nodes: tuple[NumaNode, ...]
    distances: tuple[tuple[int, ...], ...]


# -- lscpu ---------------------------------------------------------------------------------------


def _lscpu_fields(text: str) -> dict[str, str]:
    """Key -> value for flat and hierarchical lscpu output, joining a wrapped Flags value."""
    fields: dict[str, str] = {}
    last_key, value_col = None, 0
    for line in text.splitlines():
        m = re.match(r"^(\s*)([^:]+?):(\s*)(.*?)\s*$", line)
        if m and not (last_key == "Flags" and not re.match(r"^\s*[A-Z]", line)):
            key, value = m[2].strip(), m[4]
            fields[key] = value
            last_key, value_col = key, len(m[1]) + len(m[2]) + 1 + len(m[3])
            continue
        if last_key == "Flags" and line.strip():
            # Terminal wrapping cuts words anywhere: a continuation that starts exactly at the
            # value column continues the previous word ("rep_go" + "od"); one that starts after a
            # space begins a new word.
            glue = " " if len(line) > value_col and line[value_col] == " " else ""
            fields["Flags"] += glue + line.strip()
    return fields


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or int(value) == 0:
        return None  # lscpu prints "-" or "0" when it does not know
    return int(value)


def parse_lscpu(text: str) -> CpuFacts:
    """Parse ``lscpu`` output (flat layout, or the hierarchical one of util-linux >= 2.38).

    Socket(s) and Thread(s) per core of "-" or "0" (seen on Kunpeng hosts) become None, and NUMA
    comes from the "NUMA nodeN CPU(s)" lines. Memory is unknown to lscpu, so memory_bytes is 0.

    Raises:
        ParseError: no "CPU(s)" line.
    """
    fields = _lscpu_fields(text)
    if "CPU(s)" not in fields or not fields["CPU(s)"].strip().isdigit():
        raise ParseError("lscpu output has no 'CPU(s): <n>' line")
    num_cpus = int(fields["CPU(s)"])
    tpc = _int_or_none(fields.get("Thread(s) per core"))
    sockets = _int_or_none(fields.get("Socket(s)"))
    numa = []
    for key, value in fields.items():
        m = re.fullmatch(r"NUMA node(\d+) CPU\(s\)", key)
        if m:
            numa.append(NumaNode(id=int(m[1]), cpus=parse_cpulist(value)))
    clock = None
    for key in ("CPU max MHz", "CPU MHz"):
        if key in fields:
            try:
                clock = float(fields[key]) * 1e6
                break
            except ValueError:
                pass
    return CpuFacts(
        model_name=fields.get("Model name", ""), arch=fields.get("Architecture", ""),
        vendor=fields.get("Vendor ID", ""), num_cpus=num_cpus,
        num_cores=max(1, num_cpus // tpc) if tpc else num_cpus, num_sockets=sockets,
        threads_per_core=tpc, numa_nodes=tuple(sorted(numa, key=lambda n: n.id)),
        flags=frozenset(fields.get("Flags", "").split()), clock_hz=clock,
    )


# -- numactl --hardware -------------------------------------------------------------------------


def parse_numactl_hardware(text: str) -> NumactlInfo:
    """Parse ``numactl --hardware``: per-node CPUs and size, and the distance matrix.

    Raises:
        ParseError: no "available: N nodes" line, or a node count that does not match.
    """
    m = re.search(r"^available:\s*(\d+)\s+nodes?", text, re.M)
    if not m:
        raise ParseError("numactl output has no 'available: N nodes' line")
    count = int(m[1])
    cpus: dict[int, tuple[int, ...]] = {}
    sizes: dict[int, int] = {}
    for line in text.splitlines():
        if c := re.match(r"^node (\d+) cpus:\s*(.*)$", line):
            cpus[int(c[1])] = tuple(sorted(int(x) for x in c[2].split()))
        elif s := re.match(r"^node (\d+) size:\s*(\d+)\s*MB", line):
            sizes[int(s[1])] = int(s[2]) * 2**20
    if len(cpus) != count:
        raise ParseError(f"numactl says {count} nodes but lists cpus for {len(cpus)}")
    distances = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("node distances:"):
            for row in lines[i + 2:i + 2 + count]:
                distances.append(tuple(int(x) for x in row.split(":", 1)[1].split()))
            break
    nodes = tuple(NumaNode(id=n, cpus=cpus[n], memory_bytes=sizes.get(n)) for n in sorted(cpus))
    return NumactlInfo(nodes=nodes, distances=tuple(distances))


# -- /proc and /sys ---------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _meminfo_bytes(text: str | None, key: str = "MemTotal") -> int:
    if not text:
        return 0
    m = re.search(rf"{key}:\s*(\d+)\s*kB", text)
    return int(m[1]) * 1024 if m else 0


def _cgroup_limit(root: Path) -> int | None:
    for rel in ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = _read(root / rel)
        if text and text.strip().isdigit():
            limit = int(text.strip())
            if limit < 1 << 60:  # cgroup v1 prints a huge number for "no limit"
                return limit
    return None


def _sys_numa_nodes(root: Path) -> tuple[NumaNode, ...]:
    base = root / "sys/devices/system/node"
    nodes = []
    for entry in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpulist = _read(entry / "cpulist")
        if cpulist is None:
            continue
        try:
            cpus = parse_cpulist(cpulist)
        except ParseError:
            continue
        meminfo = _read(entry / "meminfo")
        nodes.append(NumaNode(id=int(entry.name[4:]), cpus=cpus,
                              memory_bytes=_meminfo_bytes(meminfo) or None))
    return tuple(nodes)


def read_cpu_facts(root: str | Path = "/", *, usable_cpus: set[int] | None = None) -> CpuFacts:
    """Read CpuFacts from /proc and /sys under ``root`` (tests pass a fake tree).

    Args:
        root: filesystem root.
        usable_cpus: CPUs this process may run on; default ``os.sched_getaffinity(0)`` when
            ``root`` is "/", else every CPU the tree lists.
    """
    root = Path(root)
    info = parse_cpuinfo(_read(root / "proc/cpuinfo") or "")
    numa = _sys_numa_nodes(root)
    all_cpus = {c for n in numa for c in n.cpus} or set(range(int(info["num_logical"]) or 1))
    if usable_cpus is None:
        usable_cpus = set(os.sched_getaffinity(0)) if str(root) == "/" and hasattr(os, "sched_getaffinity") else all_cpus
    num_cpus = len(usable_cpus) or 1
    logical = int(info["num_logical"]) or len(all_cpus)
    physical = info["num_physical_cores"]
    tpc = max(1, round(logical / physical)) if isinstance(physical, int) and physical else None
    memory = _meminfo_bytes(_read(root / "proc/meminfo")) or sum(n.memory_bytes or 0 for n in numa)
    limit = _cgroup_limit(root)
    if limit is not None and (memory == 0 or limit < memory):
        memory = limit
    numa = tuple(attrs.evolve(n, cpus=tuple(c for c in n.cpus if c in usable_cpus)) for n in numa)
    max_khz = _read(root / "sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    clock = int(max_khz) * 1e3 if max_khz and max_khz.strip().isdigit() else (
        info["mhz"] * 1e6 if isinstance(info["mhz"], float) else None)
    return CpuFacts(
        model_name=str(info["model_name"]), arch=platform.machine() if str(root) == "/" else "",
        vendor=str(info["vendor"]), num_cpus=num_cpus,
        num_cores=max(1, math.ceil(num_cpus / tpc)) if tpc else num_cpus,
        num_sockets=info["num_sockets"] if isinstance(info["num_sockets"], int) else None,
        threads_per_core=tpc, numa_nodes=tuple(n for n in numa if n.cpus), memory_bytes=memory,
        flags=info["flags"], clock_hz=clock,
    )


# -- topology -----------------------------------------------------------------------------------

# Two ranks of one host, each pinned to its own core with one torch thread, talk through gloo's
# TCP transport on the loopback interface (``kthena serve`` binds gloo to "lo"): every message
# is a syscall plus a kernel copy through memory. Measured with the probe in
# docs/bench_layouts.md ("Link figures"): 2 processes, torch 2.13 CPU, 6 runs on a 2-core
# AMD EPYC (Zen 4) KVM guest at load 0.6-1.1, medians of 5 x 50 operations:
#   all_reduce of one token's hidden state (576 x bf16)   1.44-2.06 ms
#   all_reduce of 16 MiB                                  14-18 ms (0.9-1.2 GB/s)
#   send, one way, 8 B                                    0.08-0.21 ms
#   send, one way, 16 MiB                                 1.9-3.3 GB/s
# The cost model charges a 2-rank all-reduce ``bytes / bw + 2 x latency`` and a pipeline hop
# ``bytes / bw + latency``, with one figure of each per link. They are fitted to the all-reduce
# (TP pays two per layer, 60 per decode step of a 30-layer model; a hop comes once or twice per
# step), so a PP hop is overcharged by ~0.7 ms and ~2x in bandwidth.
GLOO_LOOPBACK_LATENCY = 0.85e-3
GLOO_LOOPBACK_BW = 1.0e9


def cpu_topology(facts: CpuFacts, *, per_numa: bool = False, per_core: bool = False, name: str = "",
                 source: str = "discovered:cpu", host: HostFigures | None = None) -> Topology:
    """A single-node topology of the host: one cpu device, one per NUMA node, or one per core.

    ``host``: the host probe's measured bandwidth and matmul peak on its threads; None keeps
    the estimates. A device of N cores gets one thread's figures times N (`_host_spec`).

    With ``per_numa``, each NUMA node gets the share of cores and the memory it holds, and the
    nodes are joined by "sys" links at half a node's memory bandwidth. That is a rough stand-in for
    UPI/QPI or the Kunpeng die interconnect; lscpu and numactl give no bandwidth.

    With ``per_core``, see `_per_core_topology`. With ``host``, the topology's ``probe`` is its
    JSON form.

    Raises:
        ValueError: both ``per_numa`` and ``per_core``.
    """
    if per_numa and per_core:
        raise ValueError("cpu_topology: choose per_numa or per_core, not both")
    topology = _cpu_topology(facts, per_numa, per_core, name, source, host)
    return topology if host is None else attrs.evolve(
        topology, probe={**host.to_dict(), "source": host.source})


def _cpu_topology(facts: CpuFacts, per_numa: bool, per_core: bool, name: str, source: str,
                  host: HostFigures | None) -> Topology:
    label = name or (facts.model_name or "cpu host")
    nic = get_node("cpu-host")  # discovery cannot see the NIC speed; assume the catalog's host NIC
    net = {"inter_node_bw": nic.nic_bw, "inter_node_latency": nic.nic_latency}
    if per_core:
        return _per_core_topology(facts, label, source + ":per-core", net, host)
    if not per_numa or len(facts.numa_nodes) < 2:
        spec = _host_spec(facts, facts.num_cores, facts.memory_bytes, "cpu-host", host)
        numa = facts.numa_nodes[0].id if len(facts.numa_nodes) == 1 else None
        return Topology(devices=(Device(0, 0, 0, spec, numa_node=numa),), name=label, source=source, **net)
    devices, total_cpus = [], sum(len(n.cpus) for n in facts.numa_nodes)
    for i, node in enumerate(facts.numa_nodes):
        cores = max(1, round(facts.num_cores * len(node.cpus) / total_cpus))
        memory = node.memory_bytes or facts.memory_bytes // len(facts.numa_nodes)
        spec = _host_spec(facts, cores, memory, f"cpu-numa{node.id}", host)
        devices.append(Device(i, 0, i, spec, numa_node=node.id))
    links = tuple(
        Link(a=a.index, b=b.index, kind="sys", latency=2e-6, via="NUMA",
             bandwidth=min(a.spec.memory_bw, b.spec.memory_bw) / 2)
        for x, a in enumerate(devices) for b in devices[x + 1:]
    )
    return Topology(devices=tuple(devices), links=links, name=label, source=source + ":per-numa", **net)


def _host_spec(facts: CpuFacts, cores: int, memory: int, name: str, host: HostFigures | None):
    """``cores`` of this host as one device; with ``host``, its measured figures scaled by the
    threads the probe ran on: one thread's figures x ``cores`` (a probe on more threads than
    the host has cores measured the cores, not the threads)."""
    if host is None:
        return cpu_host_spec(cores, memory, flags=facts.flags, arch=facts.arch,
                             clock_hz=facts.clock_hz, name=name, vendor=facts.vendor or "generic")
    ran_on = min(host.threads, max(facts.num_cores, 1))
    share = cores / ran_on
    return cpu_host_spec(cores, memory, memory_bw=host.memory_bw * share,
                         peak_flops={k: v * share for k, v in host.peak_flops.items()},
                         name=name, vendor=facts.vendor or "generic",
                         source=host.describe(with_age=False) + ("" if share == 1 else
                                                   f"; scaled to {cores} core(s) from "
                                                   f"{ran_on} thread(s)"))


def _per_core_topology(facts: CpuFacts, label: str, source: str, net: dict[str, float],
                       host: HostFigures | None) -> Topology:
    """One device per usable physical core: the layout ``kthena serve`` runs with one rank per core.

    Each core gets the figures that are honestly its own when every core works at once, which
    is what a tp / pp / dp layout over all cores does:

    * FLOP/s: one core's peak (the host probe's measured peak / the threads it ran on; without
      a measurement, clock x FLOP/cycle), so the devices sum to the host's.
    * memory bandwidth: the host's figure divided by the cores. The cores share one memory bus,
      and a rank that is decoding is bandwidth-bound; one core alone can pull more than its
      share (a PP stage while the other stage waits), which this model does not credit; the
      memory efficiency a one-thread ``kthena bench serve --threads 1`` calibration fits may
      therefore approach 1.0 (docs/bench_layouts.md).
    * memory capacity: usable RAM divided by the cores (0, "unknown", stays 0).
    * fabric: gloo over loopback (``GLOO_LOOPBACK_BW`` / ``GLOO_LOOPBACK_LATENCY``, measured),
      as every core's ``link_bw`` / ``link_latency`` rather than n x (n - 1) / 2 explicit links:
      every pair of cores has the same path, through the kernel and memory.

    SMT siblings are one device: they share one core's FMA pipes. Cores are spread over the
    NUMA nodes in proportion to the usable CPUs each node holds.
    """
    n = facts.num_cores
    whole = _host_spec(facts, n, facts.memory_bytes, "cpu-host", host)
    core = _host_spec(facts, 1, facts.memory_bytes // n, "cpu-core", host)
    core = attrs.evolve(
        core, memory_bw=whole.memory_bw / n, pcie_bw=whole.memory_bw / n,
        link_bw=GLOO_LOOPBACK_BW, link_latency=GLOO_LOOPBACK_LATENCY,
        source=f"one of {n} cores: {core.source}; 1/{n} of the host's memory bandwidth and RAM; "
               "fabric gloo over loopback (measured, see discovery/cpu.py)")
    cpus = [(node.id, cpu) for node in facts.numa_nodes for cpu in node.cpus]
    numa = [cpus[i * len(cpus) // n][0] if cpus else None for i in range(n)]
    devices = tuple(Device(i, 0, i, core, numa_node=numa[i]) for i in range(n))
    return Topology(devices=devices, name=f"{label} ({n} cores)", source=source, **net)


def discover_cpu(*, per_numa: bool = False, per_core: bool = False, root: str | Path = "/",
                 usable_cpus: set[int] | None = None, host: HostFigures | None = None) -> Topology:
    """This host's CPU as a Topology (always succeeds; missing files just mean fewer facts).
    ``host``: the host probe's measurement (None: estimated figures)."""
    return cpu_topology(read_cpu_facts(root, usable_cpus=usable_cpus), per_numa=per_numa,
                        per_core=per_core, host=host)


def numa_cpu_map(facts: CpuFacts) -> Mapping[int, tuple[int, ...]]:
    """NUMA node id -> CPU ids, for mapping a device's CPU affinity to its NUMA node."""
    return {n.id: n.cpus for n in facts.numa_nodes}
