"""The parts a `Topology` is made of: `Device`, `Link`, the health states, and `TopologyError`.

Their own module so that both `topology` (the `Topology` value and its queries) and `_topology_io`
(the file format) can import them without importing each other. Import them from
`kthena_core.topology`.
"""

from __future__ import annotations

import attrs

from kthena_core.hardware import DeviceSpec

__all__ = ["HEALTH_STATES", "Device", "Link", "TopologyError"]

HEALTH_STATES = ("ok", "busy", "unhealthy")


class TopologyError(ValueError):
    """A malformed topology (file, dict or constructor arguments).

    Messages name the key path, the offending value and what is allowed.
    """


@attrs.frozen
class Device:
    """One device of a topology.

    Attributes:
        index: global index 0..N-1 across the topology.
        node: node index.
        local_index: index within its node (the local rank / ASCEND_RT_VISIBLE_DEVICES slot).
        spec: hardware figures.
        numa_node: host NUMA node the device is attached to, when known.
        health: "ok" | "busy" | "unhealthy".
    """

    index: int
    node: int
    local_index: int
    spec: DeviceSpec
    numa_node: int | None = None
    health: str = "ok"


@attrs.frozen
class Link:
    """An explicit intra-node link between two devices (global indices, ``a < b``).

    Attributes:
        kind: "hccs" | "nvlink" | "pcie" | "sys" | "sio" | "memory" | ...
        bandwidth: unidirectional bytes/s.
        latency: seconds.
        via: the raw relation the link was built from ("NV18", "PIX", "HCCS"), for display.
    """

    a: int
    b: int
    kind: str
    bandwidth: float
    latency: float
    via: str = ""
