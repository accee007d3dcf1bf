"""What this process's TCP sockets to a host still hold in the kernel: the bytes a one-sided
transfer over TCP may yet deliver.

A TCP transfer that its engine reports failed (a timeout on a partitioned link) is not
necessarily over: what the engine had written into its sockets stays in the kernel, and when the
link heals TCP delivers it, and the receiver's transfer engine writes it into registered memory.
Only the two kernels know when nothing is left:

    sender     unacked   bytes written to a socket to that host and not yet acknowledged
               (``tx_queue`` of /proc/net/tcp): they may still arrive
    receiver   unread    bytes from that host the kernel holds and the process has not read
               (``rx_queue``): its transfer engine reads them into their destination next

Both are read from ``/proc/self/net/tcp`` and ``tcp6`` (the process's network namespace), for the
sockets ``/proc/self/fd`` says this process holds. Linux only: elsewhere ``socket_backlog``
returns None (unknown), and callers treat unknown as "may still write".
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from pathlib import Path

import attrs

__all__ = ["SocketBacklog", "TcpSocket", "host_addresses", "listening_ports", "socket_backlog",
           "tcp_sockets"]

_PROC = Path("/proc/self")
_CLOSED = 0x07  # TCP_CLOSE
_LISTEN = 0x0A
_FIN_RECEIVED = (0x06, 0x08, 0x09, 0x0B)  # TIME_WAIT, CLOSE_WAIT, LAST_ACK, CLOSING


@attrs.frozen
class SocketBacklog:
    """Bytes this process's TCP sockets to some hosts hold in the kernel.

    Attributes:
        unacked: sent (or queued to send) and not acknowledged by the peer, on this
            process's sockets and on closed ones the kernel still sends for (orphans, which no
            process holds: every orphan to those hosts in this network namespace counts).
        unread: received from the peer and not yet read by this process.
        sockets: how many of this process's sockets were counted.
        outgoing: of those, the ones this process opened (its local port is not one it
            listens on): a transfer engine that opens a connection per transfer and closes it
            when the transfer ends holds one open per transfer still running.
    """

    unacked: int
    unread: int
    sockets: int
    outgoing: int = 0

    @property
    def empty(self) -> bool:
        return self.unacked == 0 and self.unread == 0


def host_addresses(host: str) -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses ``host`` (a name, an address, or ``host:port``) stands for.

    Raises:
        ValueError: the name does not resolve.
    """
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.strip("[]")
    try:
        return frozenset({ipaddress.ip_address(name)})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    return frozenset(ipaddress.ip_address(info[4][0]) for info in infos)


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for entry in os.scandir(_PROC / "fd"):
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's ``HEX:PORT`` address (host byte order per 32-bit word) -> its IP."""
    raw = bytes.fromhex(hex_addr.split(":")[0])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def _rows(table: Path) -> Iterable[list[str]]:
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return []
    return (line.split() for line in lines)


@attrs.frozen
class TcpSocket:
    """One of this process's TCP sockets to a peer host, as the kernel reports it.

    Attributes:
        inode: the socket's inode (stable while it exists).
        state: the kernel's TCP state number (1 ESTABLISHED ... 11 CLOSING).
        unacked: bytes sent (or queued to send) the peer has not acknowledged.
        unread: bytes received this process has not read.
    """

    inode: int
    state: int
    unacked: int
    unread: int
    local_port: int = 0
    remote_port: int = 0

    @property
    def peer_may_send(self) -> bool:
        """Whether more bytes may still come from the peer: it has not sent its FIN (states
        SYN_SENT, SYN_RECV, ESTABLISHED, FIN_WAIT1, FIN_WAIT2)."""
        return self.state in (0x01, 0x02, 0x03, 0x04, 0x05)


def tcp_sockets(peers: Iterable[ipaddress.IPv4Address | ipaddress.IPv6Address]
                ) -> list[TcpSocket] | None:
    """This process's TCP sockets whose remote address is one of ``peers`` (listening and
    closed ones left out); None where /proc does not say (not Linux)."""
    rows = _table()
    if rows is None:
        return None
    wanted, inodes = set(peers), _own_socket_inodes()
    return [s for s, remote in rows if s.inode in inodes and s.state not in (_CLOSED, _LISTEN)
            and remote in wanted]


def listening_ports() -> set[int]:
    """The TCP ports this process listens on (empty off Linux)."""
    inodes = _own_socket_inodes() if (_PROC / "fd").exists() else set()
    return {s.local_port for s, _ in _table() or () if s.inode in inodes and s.state == _LISTEN}


def _table() -> list[tuple[TcpSocket, ipaddress.IPv4Address | ipaddress.IPv6Address]] | None:
    """Every TCP socket of this network namespace, with its remote address; None off Linux."""
    if not (_PROC / "net" / "tcp").exists():
        return None
    found = []
    for name in ("tcp", "tcp6"):
        for row in _rows(_PROC / "net" / name):
            if len(row) < 10:
                continue
            tx, rx = row[4].split(":")
            state = int(row[3], 16)
            # rx_queue counts the peer's FIN as one byte once it has come
            unread = max(0, int(rx, 16) - (state in _FIN_RECEIVED))
            found.append((TcpSocket(int(row[9]), state, int(tx, 16), unread,
                                    int(row[1].split(":")[1], 16), int(row[2].split(":")[1], 16)),
                          _address(row[2])))
    return found


def socket_backlog(peers: Iterable[ipaddress.IPv4Address | ipaddress.IPv6Address]
                   ) -> SocketBacklog | None:
    """The kernel backlog of this process's TCP sockets whose remote address is one of
    ``peers``; None where /proc does not say (not Linux)."""
    rows = _table()
    if rows is None:
        return None
    wanted, inodes = set(peers), _own_socket_inodes()
    listening = {s.local_port for s, _ in rows if s.inode in inodes and s.state == _LISTEN}
    mine = [s for s, remote in rows if s.inode in inodes and remote in wanted
            and s.state not in (_CLOSED, _LISTEN)]
    orphans = [s for s, remote in rows if s.inode == 0 and remote in wanted]
    return SocketBacklog(sum(s.unacked for s in mine + orphans), sum(s.unread for s in mine),
                         len(mine), sum(s.local_port not in listening for s in mine))
