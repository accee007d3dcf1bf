"""Topology: the devices a plan can use, how they are grouped into nodes, and the links between them.

A Topology is a frozen value. Discovery (``kthena_core.discovery``), the catalog
(``from_catalog``) and hand-written YAML (``Topology.from_yaml``) all produce one.

Bandwidth model (all figures unidirectional, bytes/s):

* same device: ``inf``;
* same node, with an explicit ``Link``: the link's bandwidth;
* same node, without one: the smaller ``link_bw`` of the two device specs (the fabric's
  per-device aggregate, e.g. HCCS 196 GB/s on a 910B; see hardware.py);
* different nodes: ``inter_node_bw`` (per device, e.g. one 200 Gb/s RoCE port per NPU).

``link_domains()`` groups each node's devices into the connected components of its fastest links:
one 8-NPU HCCS mesh per Atlas 800T A2, one NVLink island per NVSwitch board, or the GPUs under one
PCIe switch on a PCIe box that ``nvidia-smi topo -m`` shows as PIX/PXB vs SYS.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kthena_core._topology_io import (
    topology_fields_from_dict,
    topology_fields_from_yaml,
    topology_to_dict,
)
from kthena_core._topology_parts import HEALTH_STATES, Device, Link, TopologyError
from kthena_core.hardware import (
    UnknownHardwareError,
    get_device,
    get_node,
    list_devices,
    list_nodes,
)

__all__ = [
    "HEALTH_STATES",
    "Device",
    "Link",
    "Topology",
    "TopologyError",
    "from_catalog",
]

# Two bandwidths closer than this (relative) belong to the same fabric class in link_domains().
_SAME_CLASS_RTOL = 1e-6


def _index_links(devices: tuple[Device, ...], links: tuple[Link, ...]) -> dict[tuple[int, int], Link]:
    table: dict[tuple[int, int], Link] = {}
    n = len(devices)
    for i, link in enumerate(links):
        where = f"links[{i}]"
        if not (0 <= link.a < n and 0 <= link.b < n):
            raise TopologyError(f"{where}: device index out of range ({link.a}, {link.b}); allowed 0..{n - 1}")
        if link.a >= link.b:
            raise TopologyError(f"{where}: needs a < b, got a={link.a}, b={link.b}")
        if devices[link.a].node != devices[link.b].node:
            raise TopologyError(
                f"{where}: devices {link.a} and {link.b} are on different nodes; explicit links are "
                "intra-node only (inter-node traffic uses inter_node_bw)"
            )
        if not link.bandwidth > 0 or not link.latency >= 0:
            raise TopologyError(f"{where}: bandwidth must be > 0 and latency >= 0, got {link}")
        if (link.a, link.b) in table:
            raise TopologyError(f"{where}: duplicate link between {link.a} and {link.b}")
        table[(link.a, link.b)] = link
    return table


def _check_devices(devices: tuple[Device, ...]) -> None:
    if not devices:
        raise TopologyError("devices: a topology needs at least one device")
    expected_node, expected_local = 0, 0
    for i, dev in enumerate(devices):
        where = f"devices[{i}]"
        if dev.index != i:
            raise TopologyError(f"{where}: index must equal its position {i}, got {dev.index}")
        if dev.health not in HEALTH_STATES:
            raise TopologyError(f"{where}.health: got {dev.health!r}; allowed: {', '.join(HEALTH_STATES)}")
        if dev.node == expected_node and dev.local_index == expected_local:
            expected_local += 1
        elif dev.node == expected_node + 1 and dev.local_index == 0 and i > 0:
            expected_node, expected_local = dev.node, 1
        else:
            raise TopologyError(
                f"{where}: devices must be grouped by node 0..M-1 with local indices 0..k-1 in order; "
                f"got node={dev.node}, local_index={dev.local_index}"
            )


@attrs.frozen
class Topology:
    """Nodes, devices and links, with the bandwidth/latency queries the planner needs.

    Attributes:
        devices: all devices, ordered by (node, local_index); ``devices[i].index == i``.
        links: explicit intra-node links; pairs on one node without a link fall back to the
            device specs' ``link_bw``.
        inter_node_bw: per-device bytes/s between nodes.
        inter_node_latency: seconds.
        name: display name.
        source: where it came from: "discovered:cpu", "yaml:/path", "catalog:atlas-800t-a2x2", ...
        probe: the host probe a discovered CPU topology's figures come from, in its JSON form
            (``HostFigures.to_dict`` with its ``source``; None otherwise): which CPU the figures
            are of, for the calibration a plan takes (not part of ``to_dict`` or equality).
    """

    devices: tuple[Device, ...] = attrs.field(converter=tuple)
    links: tuple[Link, ...] = attrs.field(default=(), converter=tuple)
    inter_node_bw: float = 25e9
    inter_node_latency: float = 10e-6
    name: str = ""
    source: str = ""
    probe: Mapping[str, Any] | None = attrs.field(default=None, eq=False, repr=False)
    _link_table: dict[tuple[int, int], Link] = attrs.field(init=False, repr=False, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        _check_devices(self.devices)
        if not self.inter_node_bw > 0:
            raise TopologyError(f"inter_node_bw: must be > 0 bytes/s, got {self.inter_node_bw}")
        if not self.inter_node_latency >= 0:
            raise TopologyError(f"inter_node_latency: must be >= 0 s, got {self.inter_node_latency}")
        object.__setattr__(self, "_link_table", _index_links(self.devices, self.links))

    # -- shape ---------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self.devices[-1].node + 1

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def devices_on_node(self, node: int) -> tuple[Device, ...]:
        """The devices of node ``node``, in local order.

        Raises:
            TopologyError: no such node.
        """
        if not 0 <= node < self.num_nodes:
            raise TopologyError(f"node {node} out of range; this topology has nodes 0..{self.num_nodes - 1}")
        return tuple(d for d in self.devices if d.node == node)

    def _device(self, index: int) -> Device:
        if not 0 <= index < len(self.devices):
            raise TopologyError(f"device {index} out of range; allowed 0..{len(self.devices) - 1}")
        return self.devices[index]

    def link(self, a: int, b: int) -> Link | None:
        """The explicit link between ``a`` and ``b`` (in either order), if any."""
        return self._link_table.get((min(a, b), max(a, b)))

    # -- queries -------------------------------------------------------------------------------

    def bandwidth(self, a: int, b: int) -> float:
        """Effective unidirectional bytes/s between devices ``a`` and ``b`` (inf when a == b)."""
        return self._between(a, b, "bandwidth", math.inf, self.inter_node_bw, "link_bw", min)

    def latency(self, a: int, b: int) -> float:
        """One-hop latency between devices ``a`` and ``b`` in seconds (0 when a == b)."""
        return self._between(a, b, "latency", 0.0, self.inter_node_latency, "link_latency", max)

    def _between(self, a: int, b: int, link_field: str, same: float, inter_node: float,
                 spec_field: str, combine: Callable[[float, float], float]) -> float:
        """One figure of the path a -> b: ``same`` for one device, ``inter_node`` across
        nodes, the explicit link's ``link_field``, else ``combine`` of both devices' own
        ``spec_field`` (the slower side's)."""
        da, db = self._device(a), self._device(b)
        if a == b:
            return same
        if da.node != db.node:
            return inter_node
        link = self.link(a, b)
        if link is not None:
            return getattr(link, link_field)
        return combine(getattr(da.spec, spec_field), getattr(db.spec, spec_field))

    def group_bandwidth(self, indices: Sequence[int]) -> float:
        """Bottleneck (minimum pairwise) bandwidth of a device group; inf for a single device.

        Raises:
            TopologyError: an empty group, a repeated or out-of-range index.
        """
        group = list(indices)
        if not group:
            raise TopologyError("group_bandwidth: the group is empty")
        if len(set(group)) != len(group):
            raise TopologyError(f"group_bandwidth: repeated device index in {group}")
        for i in group:
            self._device(i)
        best = math.inf
        if len({self.devices[i].node for i in group}) > 1:
            best = self.inter_node_bw
        for x, a in enumerate(group):
            for b in group[x + 1:]:
                if self.devices[a].node == self.devices[b].node:
                    best = min(best, self.bandwidth(a, b))
        return best

    def link_domains(self) -> tuple[tuple[int, ...], ...]:
        """Groups of devices joined by their node's fastest intra-node fabric.

        For each node, take the pairs whose bandwidth equals the node's best pairwise bandwidth
        and return the connected components of that graph, in device order (a device with no
        such pair is a domain of its own). Domains never span nodes.
        """
        domains: list[tuple[int, ...]] = []
        for node in range(self.num_nodes):
            domains.extend(self._node_domains([d.index for d in self.devices_on_node(node)]))
        return tuple(domains)

    def _node_domains(self, members: list[int]) -> list[tuple[int, ...]]:
        if len(members) == 1:
            return [(members[0],)]
        pairs = [(a, b, self.bandwidth(a, b)) for x, a in enumerate(members) for b in members[x + 1:]]
        fastest = max(bw for _, _, bw in pairs)
        parent = {m: m for m in members}

        def find(m: int) -> int:
            while parent[m] != m:
                parent[m] = parent[parent[m]]
                m = parent[m]
            return m

        for a, b, bw in pairs:
            if bw >= fastest * (1 - _SAME_CLASS_RTOL):
                parent[find(a)] = find(b)
        groups: dict[int, list[int]] = {}
        for m in members:
            groups.setdefault(find(m), []).append(m)
        return sorted(tuple(g) for g in groups.values())

    # -- serialisation -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, origin: str = "topology") -> Topology:
        """Build a topology from the YAML/dict format documented in docs (kthena_core guide).

        Raises:
            TopologyError: naming the key path, the value and what is allowed.
        """
        return cls(**topology_fields_from_dict(data, origin=origin))

    @classmethod
    def from_yaml(cls, path: str | Path) -> Topology:
        """Load a hand-written topology file.

        Raises:
            TopologyError: unreadable file, invalid YAML, or any schema problem (key path named).
        """
        return cls(**topology_fields_from_yaml(path))

    def to_dict(self) -> dict[str, Any]:
        """A plain dict in the same format ``from_dict`` reads (round-trips exactly)."""
        return topology_to_dict(self)


def from_catalog(node_name: str, num_nodes: int = 1, *, device: str | None = None) -> Topology:
    """``num_nodes`` identical catalog nodes, e.g. ``from_catalog("atlas-800t-a2", 2)`` = 16 x 910B.

    Args:
        node_name: a catalog node (``hardware.list_nodes()``), or a catalog device name
            (``hardware.list_devices()``), which means one such device per node, with the default
            inter-node network (25 GB/s per device, 10 us).
        num_nodes: how many such nodes.
        device: optionally replace the node's device with another catalog device (same count).

    Raises:
        UnknownHardwareError: the name is neither a catalog node nor a catalog device, or
            ``device`` is unknown (a KeyError listing the known names).
        TopologyError: num_nodes < 1.
    """
    if num_nodes < 1:
        raise TopologyError(f"num_nodes: must be >= 1, got {num_nodes}")
    if node_name in list_nodes():
        node = get_node(node_name)
        per_node, nic_bw, nic_latency = node.num_devices, node.nic_bw, node.nic_latency
        spec = get_device(device if device is not None else node.device)
    elif node_name in list_devices():
        per_node, nic_bw, nic_latency = 1, 25e9, 10e-6
        spec = get_device(device if device is not None else node_name)
    else:
        raise UnknownHardwareError(
            f"unknown node or device {node_name!r}; known nodes: {', '.join(list_nodes())}; "
            f"known devices: {', '.join(list_devices())}"
        )
    devices = tuple(
        Device(index=n * per_node + i, node=n, local_index=i, spec=spec)
        for n in range(num_nodes)
        for i in range(per_node)
    )
    return Topology(
        devices=devices,
        inter_node_bw=nic_bw,
        inter_node_latency=nic_latency,
        name=f"{num_nodes}x{node_name}" if num_nodes > 1 else node_name,
        source=f"catalog:{node_name}x{num_nodes}",
    )
