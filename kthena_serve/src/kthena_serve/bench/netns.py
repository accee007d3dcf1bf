"""Two "hosts" on one machine: two network namespaces joined by a veth pair (root only).

    with two_namespaces("kc", 214) as (ns_a, ns_b, addr_a, addr_b):
        ...  # ip netns exec ns_a ...; addr_b is reachable from ns_a

Used by the multi-host tests (``kthena_serve/tests/_netns.py`` turns the refusal into a skip)
and by ``bench.kv_move --netns``. Both namespaces are deleted on exit; the veth pair goes
with them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

__all__ = ["NetnsUnavailable", "netns_reason", "two_namespaces"]


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (the reason is the message)."""


def netns_reason() -> str | None:
    """Why this process cannot make network namespaces, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "the iproute2 'ip' command is missing"
    probe = f"kthena-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextlib.contextmanager
def two_namespaces(tag: str, subnet: int) -> Iterator[tuple[str, str, str, str]]:
    """``(ns_a, ns_b, addr_a, addr_b)`` on ``10.<subnet>.<n>.0/30``; ``tag`` (a few letters)
    keeps the names of concurrent users apart.

    Raises:
        NetnsUnavailable: namespaces cannot be made here, or a step failed (which, and why).
    """
    reason = netns_reason()
    if reason:
        raise NetnsUnavailable(reason)
    pid = os.getpid()
    n = (pid + subnet) % 250 + 1
    ns_a, ns_b = f"kthena-{tag}-a-{pid}", f"kthena-{tag}-b-{pid}"
    veth_a, veth_b = f"k{tag}a{n}", f"k{tag}b{n}"
    addr_a, addr_b = f"10.{subnet}.{n}.1", f"10.{subnet}.{n}.2"
    steps = [["ip", "netns", "add", ns_a], ["ip", "netns", "add", ns_b],
             ["ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b],
             ["ip", "link", "set", veth_a, "netns", ns_a],
             ["ip", "link", "set", veth_b, "netns", ns_b],
             ["ip", "-n", ns_a, "addr", "add", f"{addr_a}/30", "dev", veth_a],
             ["ip", "-n", ns_b, "addr", "add", f"{addr_b}/30", "dev", veth_b],
             ["ip", "-n", ns_a, "link", "set", veth_a, "up"],
             ["ip", "-n", ns_b, "link", "set", veth_b, "up"],
             ["ip", "-n", ns_a, "link", "set", "lo", "up"],
             ["ip", "-n", ns_b, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                raise NetnsUnavailable(f"cannot build the two-host network ({' '.join(step)}): "
                                       f"{done.stderr.strip()}")
        yield ns_a, ns_b, addr_a, addr_b
    finally:
        subprocess.run(["ip", "netns", "del", ns_a], capture_output=True)  # veth goes with it
        subprocess.run(["ip", "netns", "del", ns_b], capture_output=True)
        # a step failed before the veth moved into ns_a: it is still in this namespace
        subprocess.run(["ip", "link", "del", veth_a], capture_output=True)
