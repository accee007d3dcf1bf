"""Reading and writing the hand-written topology format (YAML or a plain dict).

Format (every key optional unless marked required)::

    name: my-cluster
    device_specs:                  # hardware the catalog lacks (entries shadow catalog names)
      my-npu:
        kind: npu                  # npu | gpu | cpu                               (required)
        vendor: acme
        memory: 64 GiB             # or memory_bytes: <int>                        (required)
        memory_bw: 1.6 TB/s                                                        (required)
        peak_flops: {bf16: 350 TFLOP/s, int8: 700 TOPS}                            (required)
        link: {kind: hccs, bandwidth: 196 GB/s, latency_us: 5}                     (required)
        pcie_bw: 32 GB/s
    nodes:                                                                         (required)
      - {node: atlas-800t-a2, count: 2}            # a catalog node (device: overrides its device)
      - device: ascend-910b3                       # or a node described by hand:
        devices: 8                                 #   devices per node               (required)
        count: 1                                   #   how many such nodes
        link: {kind: hccs, bandwidth: 196 GB/s}    #   every pair on the node gets this link
        links: [{a: 0, b: 1, kind: sio, bandwidth: 224 GB/s}]   # or per pair (local indices)
        nic: {bandwidth: 200 Gb/s, latency_us: 10} #   per-device NIC
        numa: [0, 0, 0, 0, 1, 1, 1, 1]             #   NUMA node per device
        health: [ok, ok, busy, ok, ok, ok, ok, ok] #   ok | busy | unhealthy
    inter_node: {bandwidth: 200 Gb/s, latency_us: 10}   # default: the slowest node NIC

Bandwidths are a number of bytes/s or a string with a unit: "392 GB/s", "200 Gb/s", "200Gbps",
"25GBps", "1.6 TB/s" (B = bytes, b = bits, decimal prefixes). Latencies are ``latency`` (a number of
seconds or "10 us", "2 ms") or ``latency_us``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import yaml

from kthena_core._topology_parts import HEALTH_STATES, Device, Link, TopologyError
from kthena_core.hardware import (
    DEVICE_KINDS,
    DeviceSpec,
    UnknownHardwareError,
    get_device,
    get_node,
    list_devices,
    list_nodes,
)

_TOP_KEYS = ("name", "source", "device_specs", "nodes", "inter_node")
_CATALOG_NODE_KEYS = ("node", "count", "device", "nic", "numa", "health")
_HAND_NODE_KEYS = ("device", "devices", "count", "link", "links", "nic", "numa", "health")
_LINK_KEYS = ("kind", "bandwidth", "bandwidth_gbps", "bandwidth_GBps", "latency", "latency_us", "via")
_PAIR_KEYS = ("a", "b", *_LINK_KEYS)
_NIC_KEYS = ("bandwidth", "bandwidth_gbps", "bandwidth_GBps", "latency", "latency_us")
_SPEC_KEYS = ("kind", "vendor", "memory", "memory_bytes", "memory_bw", "peak_flops", "link",
              "pcie_bw", "link_p2p_bw", "source")

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BW_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKMGTP]?)(B/s|Bps|b/s|bps|bit/s)\s*$")
_NUM_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")
_LAT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|ms|us|µs|ns)\s*$")
_LAT_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_MEM_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$")
_MEM_UNIT = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_FLOPS_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKMGTP]?)(FLOP/s|FLOPS|OPS|OP/s)\s*$")

_BW_HELP = "a positive number of bytes/s or a string like '392 GB/s', '200 Gb/s', '200Gbps'"


class _Ctx:
    """Carries the origin (file name) so every error names where it came from."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def error(self, path: str, problem: str) -> TopologyError:
        return TopologyError(f"{self.origin}: {path}: {problem}")

    def mapping(self, value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(path, f"expected a mapping, got {type(value).__name__} {value!r}")
        return value

    def keys(self, value: Mapping[str, Any], path: str, allowed: tuple[str, ...]) -> None:
        for key in value:
            if key not in allowed:
                raise self.error(f"{path}.{key}" if path else str(key),
                                 f"unknown key {key!r}; allowed: {', '.join(allowed)}")

    def positive_int(self, value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(path, f"got {value!r}; allowed: a positive integer")
        return value

    def number(self, value: Any, path: str, *, allow_zero: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(path, f"got {value!r}; allowed: a number")
        ok = value >= 0 if allow_zero else value > 0
        if not ok or not math.isfinite(value):
            bound = ">= 0" if allow_zero else "> 0"
            raise self.error(path, f"got {value!r}; allowed: a finite number {bound}")
        return float(value)

    def bandwidth(self, section: Mapping[str, Any], path: str, *, required: bool = True) -> float | None:
        given = [k for k in ("bandwidth", "bandwidth_gbps", "bandwidth_GBps") if k in section]
        if not given:
            if required:
                raise self.error(f"{path}.bandwidth", f"missing; allowed: {_BW_HELP}")
            return None
        if len(given) > 1:
            raise self.error(path, f"give one of bandwidth / bandwidth_gbps / bandwidth_GBps, got {given}")
        key = given[0]
        value = section[key]
        if key == "bandwidth_gbps":
            return self.number(value, f"{path}.{key}") * 1e9 / 8
        if key == "bandwidth_GBps":
            return self.number(value, f"{path}.{key}") * 1e9
        return self.rate(value, f"{path}.{key}")

    def rate(self, value: Any, path: str) -> float:
        if isinstance(value, str):
            m = _BW_RE.match(value)
            if m:
                bytes_per_s = float(m[1]) * _PREFIX[m[2]] / (1 if m[3].startswith("B") else 8)
                return self.number(bytes_per_s, path)
            if _NUM_RE.match(value):
                return self.number(float(value), path)
            raise self.error(path, f"got {value!r}; allowed: {_BW_HELP}")
        try:
            return self.number(value, path)
        except TopologyError:
            raise self.error(path, f"got {value!r}; allowed: {_BW_HELP}") from None

    def latency(self, section: Mapping[str, Any], path: str, default: float) -> float:
        if "latency" in section and "latency_us" in section:
            raise self.error(path, "give latency or latency_us, not both")
        if "latency_us" in section:
            return self.number(section["latency_us"], f"{path}.latency_us", allow_zero=True) * 1e-6
        if "latency" not in section:
            return default
        value = section["latency"]
        if isinstance(value, str):
            m = _LAT_RE.match(value)
            if not m:
                raise self.error(f"{path}.latency", f"got {value!r}; allowed: seconds or '10 us', '2 ms'")
            return float(m[1]) * _LAT_UNIT[m[2]]
        return self.number(value, f"{path}.latency", allow_zero=True)

    def memory(self, value: Any, path: str) -> int:
        if isinstance(value, str):
            m = _MEM_RE.match(value)
            if not m:
                raise self.error(path, f"got {value!r}; allowed: bytes or a string like '64 GiB', '80 GB'")
            return int(float(m[1]) * _MEM_UNIT[m[2]])
        return int(self.number(value, path, allow_zero=True))

    def flops(self, value: Any, path: str) -> float:
        if isinstance(value, str):
            m = _FLOPS_RE.match(value)
            if m:
                return self.number(float(m[1]) * _PREFIX[m[2]], path)
            if _NUM_RE.match(value):
                return self.number(float(value), path)
            raise self.error(path, f"got {value!r}; allowed: FLOP/s or a string like '350 TFLOP/s', '700 TOPS'")
        return self.number(value, path)


class TopologyView(Protocol):
    """What `topology_to_dict` reads of a `Topology` (which imports this module, not the reverse)."""

    @property
    def devices(self) -> tuple[Device, ...]: ...
    @property
    def links(self) -> tuple[Link, ...]: ...
    @property
    def inter_node_bw(self) -> float: ...
    @property
    def inter_node_latency(self) -> float: ...
    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def num_nodes(self) -> int: ...

    def devices_on_node(self, node: int) -> tuple[Device, ...]: ...


def topology_fields_from_yaml(path: str | Path) -> dict[str, Any]:
    """The `Topology` constructor arguments a hand-written topology file describes.

    Raises:
        TopologyError: unreadable file, invalid YAML, or any schema problem (key path named).
    """
    path = Path(path)
    origin = f"topology file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError(f"{origin}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TopologyError(f"{origin}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        raise TopologyError(f"{origin}: the file is empty; it needs at least a 'nodes' section")
    fields = topology_fields_from_dict(data, origin=origin)
    if "source" not in data:
        fields["source"] = f"yaml:{path}"
    return fields


def topology_fields_from_dict(data: Any, *, origin: str = "topology") -> dict[str, Any]:
    """The `Topology` constructor arguments a topology dict (the format above) describes.

    Raises:
        TopologyError: naming the key path, the value and what is allowed.
    """
    ctx = _Ctx(origin)
    data = ctx.mapping(data, "(top level)")
    ctx.keys(data, "", _TOP_KEYS)
    specs = _read_specs(ctx, data.get("device_specs", {}))
    if "nodes" not in data:
        raise ctx.error("nodes", "missing section; it lists the nodes, e.g. [{node: atlas-800t-a2, count: 2}]")
    nodes = data["nodes"]
    if not isinstance(nodes, list) or not nodes:
        raise ctx.error("nodes", f"got {nodes!r}; allowed: a non-empty list of node entries")
    devices: list[Device] = []
    links: list[Link] = []
    nic_bws: list[float] = []
    nic_lats: list[float] = []
    for i, entry in enumerate(nodes):
        _read_node_entry(ctx, entry, f"nodes[{i}]", specs, devices, links, nic_bws, nic_lats)
    inter_bw = min(nic_bws) if nic_bws else 25e9
    inter_lat = max(nic_lats) if nic_lats else 10e-6
    if "inter_node" in data:
        section = ctx.mapping(data["inter_node"], "inter_node")
        ctx.keys(section, "inter_node", _NIC_KEYS)
        inter_bw = ctx.bandwidth(section, "inter_node", required=False) or inter_bw
        inter_lat = ctx.latency(section, "inter_node", inter_lat)
    name = data.get("name", "")
    if not isinstance(name, str):
        raise ctx.error("name", f"got {name!r}; allowed: a string")
    source = data.get("source", f"dict:{origin}")
    return {"devices": tuple(devices), "links": tuple(links), "inter_node_bw": inter_bw,
            "inter_node_latency": inter_lat, "name": name, "source": str(source)}


def _lookup_device(ctx: _Ctx, name: Any, path: str, specs: Mapping[str, DeviceSpec]) -> DeviceSpec:
    if not isinstance(name, str):
        raise ctx.error(path, f"got {name!r}; allowed: a device name")
    if name in specs:
        return specs[name]
    try:
        return get_device(name)
    except UnknownHardwareError:
        known = sorted(set(list_devices()) | set(specs))
        raise ctx.error(path, f"unknown device {name!r}; allowed: {', '.join(known)} "
                              "(or define it under device_specs)") from None


def _read_node_entry(ctx: _Ctx, entry: Any, path: str, specs: Mapping[str, DeviceSpec],
                     devices: list[Device], links: list[Link], nic_bws: list[float],
                     nic_lats: list[float]) -> None:
    entry = ctx.mapping(entry, path)
    count = ctx.positive_int(entry.get("count", 1), f"{path}.count")
    if "node" in entry:
        ctx.keys(entry, path, _CATALOG_NODE_KEYS)
        try:
            node = get_node(entry["node"]) if isinstance(entry["node"], str) else None
        except UnknownHardwareError:
            node = None
        if node is None:
            raise ctx.error(f"{path}.node", f"unknown node {entry['node']!r}; allowed: {', '.join(list_nodes())}")
        spec = _lookup_device(ctx, entry.get("device", node.device), f"{path}.device", specs)
        per_node, nic_bw, nic_lat = node.num_devices, node.nic_bw, node.nic_latency
        pair_link = None
        pair_links: list[Link] = []
    else:
        ctx.keys(entry, path, _HAND_NODE_KEYS)
        if "device" not in entry:
            raise ctx.error(f"{path}.device", "missing; give a catalog node (node: ...) or a device name")
        if "devices" not in entry:
            raise ctx.error(f"{path}.devices", "missing; allowed: a positive integer (devices per node)")
        spec = _lookup_device(ctx, entry["device"], f"{path}.device", specs)
        per_node = ctx.positive_int(entry["devices"], f"{path}.devices")
        nic_bw, nic_lat = None, 10e-6
        pair_link = _read_link(ctx, entry["link"], f"{path}.link", spec) if "link" in entry else None
        pair_links = _read_pair_links(ctx, entry.get("links", []), f"{path}.links", spec, per_node)
    if "nic" in entry:
        nic = ctx.mapping(entry["nic"], f"{path}.nic")
        ctx.keys(nic, f"{path}.nic", _NIC_KEYS)
        nic_bw = ctx.bandwidth(nic, f"{path}.nic")
        nic_lat = ctx.latency(nic, f"{path}.nic", nic_lat)
    if nic_bw is not None:
        nic_bws.append(nic_bw)
        nic_lats.append(nic_lat)
    numa = _per_device_list(ctx, entry, "numa", path, per_node)
    health = _per_device_list(ctx, entry, "health", path, per_node)
    for _ in range(count):
        node_index = devices[-1].node + 1 if devices else 0
        base = len(devices)
        for i in range(per_node):
            devices.append(Device(index=base + i, node=node_index, local_index=i, spec=spec,
                                  numa_node=numa[i], health=health[i] or "ok"))
        if pair_link is not None:
            links.extend(attrs.evolve(pair_link, a=base + a, b=base + b)
                         for a in range(per_node) for b in range(a + 1, per_node))
        links.extend(attrs.evolve(link, a=base + link.a, b=base + link.b) for link in pair_links)


def _per_device_list(ctx: _Ctx, entry: Mapping[str, Any], key: str, path: str, n: int) -> list[Any]:
    if key not in entry:
        return [None] * n
    values = entry[key]
    where = f"{path}.{key}"
    if not isinstance(values, list) or len(values) != n:
        raise ctx.error(where, f"got {values!r}; allowed: a list of {n} entries (one per device)")
    for i, v in enumerate(values):
        if key == "numa" and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ctx.error(f"{where}[{i}]", f"got {v!r}; allowed: a NUMA node id >= 0 or null")
        if key == "health" and v not in HEALTH_STATES:
            raise ctx.error(f"{where}[{i}]", f"got {v!r}; allowed: {', '.join(HEALTH_STATES)}")
    return list(values)


def _read_link(ctx: _Ctx, value: Any, path: str, spec: DeviceSpec, allowed: tuple[str, ...] = _LINK_KEYS) -> Link:
    section = ctx.mapping(value, path)
    ctx.keys(section, path, allowed)
    kind = section.get("kind", spec.link_kind)
    if not isinstance(kind, str) or not kind:
        raise ctx.error(f"{path}.kind", f"got {kind!r}; allowed: a link kind such as hccs, nvlink, pcie, sys")
    bw = ctx.bandwidth(section, path, required=False) or spec.link_bw
    lat = ctx.latency(section, path, spec.link_latency)
    return Link(a=0, b=1, kind=kind, bandwidth=bw, latency=lat, via=str(section.get("via", "")))


def _read_pair_links(ctx: _Ctx, values: Any, path: str, spec: DeviceSpec, n: int) -> list[Link]:
    if not isinstance(values, list):
        raise ctx.error(path, f"got {values!r}; allowed: a list of {{a, b, kind, bandwidth}} entries")
    out = []
    for i, value in enumerate(values):
        where = f"{path}[{i}]"
        section = ctx.mapping(value, where)
        ends = []
        for key in ("a", "b"):
            if key not in section:
                raise ctx.error(f"{where}.{key}", f"missing; allowed: a local device index 0..{n - 1}")
            v = section[key]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
                raise ctx.error(f"{where}.{key}", f"got {v!r}; allowed: a local device index 0..{n - 1}")
            ends.append(v)
        if ends[0] == ends[1]:
            raise ctx.error(where, f"a and b must differ, got {ends[0]} twice")
        link = _read_link(ctx, {k: v for k, v in section.items() if k not in ("a", "b")}, where, spec)
        out.append(attrs.evolve(link, a=min(ends), b=max(ends)))
    return out


def _read_specs(ctx: _Ctx, value: Any) -> dict[str, DeviceSpec]:
    section = ctx.mapping(value, "device_specs")
    specs = {}
    for name, raw in section.items():
        path = f"device_specs.{name}"
        body = ctx.mapping(raw, path)
        ctx.keys(body, path, _SPEC_KEYS)
        for key in ("kind", "memory_bw", "peak_flops", "link"):
            if key not in body:
                raise ctx.error(f"{path}.{key}", "missing")
        if body["kind"] not in DEVICE_KINDS:
            raise ctx.error(f"{path}.kind", f"got {body['kind']!r}; allowed: {', '.join(DEVICE_KINDS)}")
        if ("memory" in body) == ("memory_bytes" in body):
            raise ctx.error(path, "give exactly one of memory ('64 GiB') or memory_bytes")
        memory_key = "memory" if "memory" in body else "memory_bytes"
        flops_raw = ctx.mapping(body["peak_flops"], f"{path}.peak_flops")
        if not flops_raw:
            raise ctx.error(f"{path}.peak_flops", "empty; allowed: {dtype: FLOP/s} with bf16/fp16/fp32/int8 keys")
        flops = {str(k): ctx.flops(v, f"{path}.peak_flops.{k}") for k, v in flops_raw.items()}
        link = ctx.mapping(body["link"], f"{path}.link")
        ctx.keys(link, f"{path}.link", ("kind", "bandwidth", "bandwidth_gbps", "bandwidth_GBps",
                                        "latency", "latency_us"))
        link_kind = link.get("kind")
        try:
            specs[str(name)] = DeviceSpec(
                name=str(name), kind=body["kind"], vendor=str(body.get("vendor", "unknown")),
                memory_bytes=ctx.memory(body[memory_key], f"{path}.{memory_key}"),
                memory_bw=ctx.rate(body["memory_bw"], f"{path}.memory_bw"),
                peak_flops=flops, link_kind=link_kind,
                link_bw=ctx.bandwidth(link, f"{path}.link"),
                link_latency=ctx.latency(link, f"{path}.link", 5e-6),
                pcie_bw=ctx.rate(body.get("pcie_bw", 32e9), f"{path}.pcie_bw"),
                link_p2p_bw=(ctx.rate(body["link_p2p_bw"], f"{path}.link_p2p_bw")
                             if body.get("link_p2p_bw") is not None else None),
                source=str(body.get("source", "yaml")),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, TopologyError):
                raise
            raise ctx.error(path, f"invalid device spec: {exc}") from None
    return specs


# -- writing ---------------------------------------------------------------------------------


def _spec_to_dict(spec: DeviceSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": spec.kind, "vendor": spec.vendor, "memory_bytes": spec.memory_bytes,
        "memory_bw": spec.memory_bw, "peak_flops": dict(spec.peak_flops),
        "link": {"kind": spec.link_kind, "bandwidth": spec.link_bw, "latency": spec.link_latency},
        "pcie_bw": spec.pcie_bw, "source": spec.source,
    }
    if spec.link_p2p_bw is not None:
        out["link_p2p_bw"] = spec.link_p2p_bw
    return out


def _is_catalog(spec: DeviceSpec) -> bool:
    try:
        return get_device(spec.name) == spec
    except UnknownHardwareError:
        return False


def _link_to_dict(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": link.kind, "bandwidth": link.bandwidth, "latency": link.latency}
    if link.via:
        out["via"] = link.via
    return out


def _node_to_dict(topo: TopologyView, node: int) -> dict[str, Any]:
    members = topo.devices_on_node(node)
    specs = {d.spec for d in members}
    if len(specs) > 1:
        raise TopologyError(f"node {node}: mixes device specs {sorted(s.name for s in specs)}; "
                            "the file format has one device type per node")
    entry: dict[str, Any] = {"device": members[0].spec.name, "devices": len(members)}
    if any(d.numa_node is not None for d in members):
        entry["numa"] = [d.numa_node for d in members]
    if any(d.health != "ok" for d in members):
        entry["health"] = [d.health for d in members]
    base = members[0].index
    node_links = [link for link in topo.links if topo.devices[link.a].node == node]
    n = len(members)
    shapes = {(link.kind, link.bandwidth, link.latency, link.via) for link in node_links}
    if n > 1 and len(node_links) == n * (n - 1) // 2 and len(shapes) == 1:
        entry["link"] = _link_to_dict(node_links[0])
    elif node_links:
        entry["links"] = [{"a": link.a - base, "b": link.b - base, **_link_to_dict(link)} for link in node_links]
    return entry


def topology_to_dict(topo: TopologyView) -> dict[str, Any]:
    custom: dict[str, DeviceSpec] = {}
    for d in topo.devices:
        if not _is_catalog(d.spec):
            seen = custom.setdefault(d.spec.name, d.spec)
            if seen != d.spec:
                raise TopologyError(f"device spec name {d.spec.name!r} is used for two different specs")
    nodes: list[dict[str, Any]] = []
    for node in range(topo.num_nodes):
        entry = _node_to_dict(topo, node)
        if nodes and {k: v for k, v in nodes[-1].items() if k != "count"} == entry:
            nodes[-1]["count"] = nodes[-1].get("count", 1) + 1
        else:
            nodes.append(entry)
    out: dict[str, Any] = {"name": topo.name, "source": topo.source}
    if custom:
        out["device_specs"] = {name: _spec_to_dict(spec) for name, spec in custom.items()}
    out["nodes"] = nodes
    out["inter_node"] = {"bandwidth": topo.inter_node_bw, "latency": topo.inter_node_latency}
    return out
