"""Human-readable tables of a Topology (what ``kthena topo`` prints)."""

from __future__ import annotations

from kthena_core.topology import Topology

__all__ = ["describe", "format_bandwidth", "format_bytes", "format_flops"]


def format_bytes(n: float) -> str:
    """Binary units: 64 GiB, 512 MiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def format_bandwidth(bps: float) -> str:
    """Decimal units of bytes/s: 196 GB/s, 1.6 TB/s."""
    if bps == float("inf"):
        return "inf"
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6)):
        if bps >= size:
            return f"{bps / size:.3g} {unit}"
    return f"{bps:.0f} B/s"


def format_flops(flops: float) -> str:
    for unit, size in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops:.3g} FLOP/s"


def _ranges(indices: tuple[int, ...]) -> str:
    if len(indices) > 1 and indices == tuple(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}"
    return ",".join(str(i) for i in indices)


def describe(topology: Topology) -> str:
    """A table of devices (one row per distinct device kind per node) plus links and domains."""
    t = topology
    lines = [
        f"topology {t.name or '(unnamed)'}  [{t.source or 'unknown source'}]",
        f"  {t.num_nodes} node(s), {t.num_devices} device(s); between nodes "
        f"{format_bandwidth(t.inter_node_bw)} per device, {t.inter_node_latency * 1e6:.3g} us",
    ]
    header = ("node", "devices", "spec", "kind", "memory", "mem bw", "bf16/fp16", "fabric", "numa", "health")
    rows = []
    for node in range(t.num_nodes):
        members = t.devices_on_node(node)
        groups: dict[object, list] = {}
        for d in members:
            groups.setdefault(d.spec, []).append(d)
        for spec, devs in groups.items():
            peak = spec.peak_flops.get("bf16") or spec.peak_flops.get("fp16") or spec.peak_flops.get("fp32", 0)
            numa = sorted({d.numa_node for d in devs if d.numa_node is not None})
            health = sorted({d.health for d in devs})
            rows.append((
                str(node), _ranges(tuple(d.index for d in devs)), spec.name, spec.kind,
                format_bytes(spec.memory_bytes) if spec.memory_bytes else "host RAM",
                format_bandwidth(spec.memory_bw), format_flops(peak),
                f"{spec.link_kind} {format_bandwidth(spec.link_bw)}",
                ",".join(map(str, numa)) or "-", ",".join(health),
            ))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if t.links:
        kinds: dict[tuple[str, str, float], int] = {}
        for link in t.links:
            key = (link.kind, link.via, link.bandwidth)
            kinds[key] = kinds.get(key, 0) + 1
        summary = ", ".join(f"{n} x {kind}{f' ({via})' if via else ''} {format_bandwidth(bw)}"
                            for (kind, via, bw), n in sorted(kinds.items(), key=lambda kv: -kv[0][2]))
        lines.append(f"  explicit links: {summary}")
    lines.append("  link domains: " + " ".join(f"[{_ranges(d)}]" for d in t.link_domains()))
    placeholders = sorted({d.spec.name for d in t.devices if d.spec.source.startswith("placeholder")})
    if placeholders:
        lines.append(f"  note: {', '.join(placeholders)} not in the catalog; figures are placeholders")
    return "\n".join(lines)
