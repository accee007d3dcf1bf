"""What the planner reads from a topology: the usable devices in rank order, the device figures,
and the bottleneck links and node spans of a layout's groups. Import from `kthena_core.planner`.

Ranks are laid onto the usable devices link domain by link domain (``_device_order``), so
consecutive ranks share the fastest fabric and a TP group stays in one HCCS mesh / NVLink island
whenever it fits.
"""

from __future__ import annotations

import math

from kthena_core.cost_model import CostParams, DeviceFigures, Links
from kthena_core.hardware import DeviceSpec
from kthena_core.plan import ExcludedDevice
from kthena_core.topology import Topology

# Health states whose devices never get a rank. "busy" (another process holds the device) stays
# usable: memory is still checked, and the operator may have started that process on purpose.
EXCLUDED_HEALTH = ("unhealthy",)


class NoFeasiblePlanError(ValueError):
    """No layout fits; the message lists the most common reasons."""


def excluded_devices(topology: Topology) -> tuple[ExcludedDevice, ...]:
    """The devices of `topology` that get no rank, in device order."""
    where = topology.source or topology.name or "topology"
    return tuple(ExcludedDevice(d.index, f"{d.health} ({where})")
                 for d in topology.devices if d.health in EXCLUDED_HEALTH)


def usable_device_ids(topology: Topology) -> tuple[int, ...]:
    """The devices a plan may place ranks on, in device order."""
    return tuple(d.index for d in topology.devices if d.health not in EXCLUDED_HEALTH)


def excluded_text(excluded: tuple[ExcludedDevice, ...]) -> str:
    return ", ".join(f"device {x.device_id} {x.reason}" for x in excluded) or "none"


class _TopologyView:
    """What the cost model reads from a topology, computed once per plan() call."""

    def __init__(self, topology: Topology, params: CostParams) -> None:
        self.topology = topology
        self.eff = params.link_efficiency
        self.excluded = excluded_devices(topology)
        usable = set(usable_device_ids(topology))
        if not usable:
            raise NoFeasiblePlanError(
                f"topology {topology.name or topology.source!r}: 0 of {topology.num_devices} devices "
                f"are healthy; excluded: {excluded_text(self.excluded)}")
        # Homogeneous devices are assumed; otherwise the slowest device sets the pace.
        specs = [topology.devices[i].spec for i in sorted(usable)]
        self.figures = DeviceFigures(
            flops=min(_dense_flops(s) for s in specs) * params.compute_efficiency,
            memory_bw=min(s.memory_bw for s in specs) * params.memory_efficiency,
            # memory_bytes == 0 means "the host's RAM, size unknown": no memory limit is applied.
            capacity=min(s.memory_bytes or math.inf for s in specs) * params.memory_utilization,
            step_overhead=params.step_overhead_s,
        )
        self.order = [i for i in _device_order(topology) if i in usable]
        self._node = {d.index: d.node for d in topology.devices}
        self._links: dict[tuple[int, int, int, int, int], Links] = {}
        self._group_bw: dict[tuple[int, ...], float] = {}
        self._pair_bw: dict[tuple[int, int], float] = {}
        self._spans: dict[tuple[int, int, int], int] = {}

    def links(self, tp: int, pp: int, dp: int, ep: int = 1, first_rank: int = 0) -> Links:
        """The links of `dp` instances of tp x pp ranks from rank `first_rank` on (a PD
        role's instances start after the other role's)."""
        key = (tp, pp, dp, ep, first_rank)
        if key not in self._links:
            self._links[key] = self._compute_links(tp, pp, dp, ep, first_rank)
        return self._links[key]

    def group_bandwidth(self, group: tuple[int, ...]) -> float:
        """`Topology.group_bandwidth`, remembered: PD planning prices many placements that
        share their groups."""
        if group not in self._group_bw:
            self._group_bw[group] = self.topology.group_bandwidth(group)
        return self._group_bw[group]

    def bandwidth(self, a: int, b: int) -> float:
        """`Topology.bandwidth`, remembered."""
        if (a, b) not in self._pair_bw:
            self._pair_bw[(a, b)] = self.topology.bandwidth(a, b)
        return self._pair_bw[(a, b)]

    def _compute_links(self, tp: int, pp: int, dp: int, ep: int, first_rank: int) -> Links:
        """Bottleneck bandwidths of the TP groups, the first replica's pipeline, the PD hop and
        the first EP group (its instances' first ranks).

        Every TP group is checked, not only the first: with devices excluded, a later group may
        straddle two link domains, and the slowest group sets the pace of the collective.
        """
        topo, order = self.topology, self.order[first_rank:]
        groups = [tuple(order[s:s + tp]) for s in range(0, tp * pp * dp, tp)]
        tp_bw = min(self.group_bandwidth(g) for g in groups) if tp > 1 else math.inf
        tp_lat = max((topo.latency(g[0], b) for g in groups for b in g[1:]), default=0.0)
        hops = [(order[p * tp], order[(p + 1) * tp]) for p in range(pp - 1)]
        pp_bw = min((self.bandwidth(a, b) for a, b in hops), default=math.inf)
        pp_lat = max((topo.latency(a, b) for a, b in hops), default=0.0)
        last = order[(dp - 1) * tp * pp]
        pd_bw = self.bandwidth(order[0], last) if last != order[0] else math.inf
        firsts = [order[i * tp * pp] for i in range(ep)]
        ep_bw = topo.group_bandwidth(firsts) if ep > 1 else math.inf
        ep_lat = max((topo.latency(firsts[0], b) for b in firsts[1:]), default=0.0)
        return Links(tp_bw * self.eff, tp_lat, pp_bw * self.eff, pp_lat, pd_bw * self.eff,
                     ep_bw * self.eff, ep_lat)

    def nodes_per_tp_group(self, tp: int, num_devices: int, first_rank: int = 0) -> int:
        """The most nodes one TP group of the `num_devices` ranks from `first_rank` on spans
        (1: none spans)."""
        key = (tp, num_devices, first_rank)
        if key not in self._spans:
            order = self.order
            self._spans[key] = max(len({self._node[i] for i in order[s:s + tp]})
                                   for s in range(first_rank, first_rank + num_devices, tp))
        return self._spans[key]

    def devices_per_node(self) -> int:
        """Usable devices on the smallest node that has any: the largest TP group that can
        stay on one node everywhere."""
        counts: dict[int, int] = {}
        for i in self.order:
            counts[self._node[i]] = counts.get(self._node[i], 0) + 1
        return min(counts.values())


def _dense_flops(spec: DeviceSpec) -> float:
    for key in ("bf16", "fp16", "fp32"):
        if spec.peak_flops.get(key):
            return float(spec.peak_flops[key])
    raise NoFeasiblePlanError(f"device {spec.name} lists no bf16/fp16/fp32 peak FLOP/s")


def _device_order(topology: Topology) -> list[int]:
    """Devices listed link domain by link domain, so consecutive ranks share the fastest fabric."""
    order: list[int] = []
    seen: set[int] = set()
    for domain in topology.link_domains():
        for i in sorted(domain):
            if i not in seen:
                order.append(i)
                seen.add(i)
    order.extend(d.index for d in topology.devices if d.index not in seen)
    return order
