"""Network faults on the veth link between two test namespaces (``_netns.two_host_network``).

    with two_host_network("nf", 216) as hosts, inside(hosts[0]):
        link = Link(hosts[0], hosts[1])
        link.partition()   # every packet on the link dropped, both ways, silently
        link.heal()        # all faults off

Mechanisms (this machine's kernel has no ``netem`` qdisc, so no fixed delay or netem loss):

========== =====================================================================================
partition  nftables: an ``input`` rule in each namespace drops every packet arriving over the
           veth (pure IP-level silence: a connect times out, an open connection stalls); without
           the ``nft`` binary, ``tc pfifo limit 0`` on both veth ends (ARP fails too: a connect
           gets EHOSTUNREACH after ~3 s)
slow       ``tc tbf`` on both veth ends: a rate limit whose queue adds delay under load and
           tail-drops past its latency bound
loss       nftables: ``numgen random mod 100 < P`` drops P% of the packets arriving over the veth
========== =====================================================================================

``inside(ns)`` moves the calling thread into a namespace (``setns``); threads and processes it
starts there stay there. Every fault is undone by ``heal`` (and goes with the namespaces anyway).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
from collections.abc import Iterator

__all__ = ["Link", "inside", "nft_reason"]

_CLONE_NEWNET = 0x40000000
_TABLE = "kthena_fault"


def nft_reason() -> str | None:
    """Why nftables rules cannot be used here, or None if they can."""
    return None if shutil.which("nft") else "the nftables 'nft' command is missing (make install)"


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """Run the calling thread in network namespace ``ns`` (``ip netns`` name) until exit."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        try:
            yield
        finally:
            if libc.setns(home, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to this test's namespace")
    finally:
        os.close(target)
        os.close(home)


def _run(*cmd: str, stdin: str | None = None) -> None:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def veth(ns: str) -> str:
    """The one non-loopback link of ``ns``."""
    shown = subprocess.run(["ip", "-n", ns, "-j", "link", "show"], capture_output=True,
                           text=True, check=True)
    (name,) = [link["ifname"] for link in json.loads(shown.stdout) if link["ifname"] != "lo"]
    return name


class Link:
    """The veth link between namespaces ``ns_a`` and ``ns_b``, and the faults put on it."""

    def __init__(self, ns_a: str, ns_b: str) -> None:
        self.ends = [(ns, veth(ns)) for ns in (ns_a, ns_b)]
        self.mechanism: str | None = None  # what the last fault used, for messages and docs

    def partition(self) -> str:
        """Drop every packet on the link, both ways; returns the mechanism used."""
        if nft_reason() is None:
            self._nft("drop")
            self.mechanism = "nftables input drop"
        else:
            for ns, dev in self.ends:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                     "pfifo", "limit", "0")
            self.mechanism = "tc pfifo limit 0"
        return self.mechanism

    def slow(self, rate: str = "4mbit", latency: str = "400ms", burst: str = "16kb") -> str:
        """Rate-limit both directions (``tc tbf``): queueing delay, tail drops past ``latency``."""
        for ns, dev in self.ends:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", rate, "burst", burst, "latency", latency)
        self.mechanism = f"tc tbf rate {rate} latency {latency}"
        return self.mechanism

    def lose(self, percent: int) -> str:
        """Drop ``percent`` % of the packets arriving at either end at random (nftables).

        Raises:
            RuntimeError: nftables is not usable here (``nft_reason`` says why).
        """
        if nft_reason() is not None:
            raise RuntimeError(nft_reason())
        self._nft(f"numgen random mod 100 < {int(percent)} drop")
        self.mechanism = f"nftables {int(percent)}% random input drop"
        return self.mechanism

    def heal(self) -> None:
        """Every fault off (what is not there is skipped)."""
        for ns, dev in self.ends:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            if nft_reason() is None:
                subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet",
                                _TABLE], capture_output=True)

    def rx_bytes(self, ns: str) -> int:
        """Bytes received over the link in ``ns`` so far."""
        shown = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show"], capture_output=True,
                               text=True, check=True)
        return sum(link["stats64"]["rx"]["bytes"] for link in json.loads(shown.stdout)
                   if link["ifname"] != "lo")

    def _nft(self, rule: str) -> None:
        """One ``input`` rule on the veth in each namespace (replacing an earlier one)."""
        for ns, dev in self.ends:
            subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", _TABLE],
                           capture_output=True)
            _run("ip", "netns", "exec", ns, "nft", "-f", "-", stdin=(
                f"table inet {_TABLE} {{\n"
                "  chain inbound {\n"
                "    type filter hook input priority 0; policy accept;\n"
                f"    iifname \"{dev}\" {rule}\n"
                "  }\n"
                "}\n"))
