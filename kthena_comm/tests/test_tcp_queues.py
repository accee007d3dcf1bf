"""`tcp_queues`: the kernel's queues of this process's TCP sockets to a host, read from /proc.

Real sockets over 127.0.0.1 in this process: bytes sent and not read show as the receiving
socket's unread bytes, reading them empties it, a socket whose peer closed leaves the states
in which the peer may still send, and sockets to other hosts are not counted.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

import pytest

from kthena_comm.transfer.tcp_queues import host_addresses, socket_backlog, tcp_sockets

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/net/tcp is Linux's")
LOOPBACK = host_addresses("127.0.0.1")


@contextlib.contextmanager
def connected_pair():
    """A connected (client, server-side) pair of TCP sockets on 127.0.0.1, the listener still
    listening; all closed after."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        try:
            yield client, server
        finally:
            client.close()
            server.close()


def settle(check, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    """Loopback delivery is asynchronous: poll ``check()`` until true."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the kernel never showed it"
        time.sleep(0.01)



def test_unread_bytes_show_until_read():
    with connected_pair() as (client, server):
        before = socket_backlog(LOOPBACK)
        client.sendall(b"x" * 50_000)
        settle(lambda: socket_backlog(LOOPBACK).unread >= before.unread + 50_000)
        got = 0
        while got < 50_000:
            got += len(server.recv(65536))
        settle(lambda: socket_backlog(LOOPBACK).unread == before.unread)


def test_a_closed_peer_leaves_the_sending_states_and_other_hosts_are_not_counted():
    with connected_pair() as (client, server):
        inode = os.fstat(server.fileno()).st_ino  # the server side's socket
        (mine,) = [s for s in tcp_sockets(LOOPBACK) if s.inode == inode]
        assert mine.peer_may_send
        client.close()  # FIN to the server side
        settle(lambda: not next(s for s in tcp_sockets(LOOPBACK) if s.inode == inode
                                ).peer_may_send)
        assert socket_backlog(host_addresses("192.0.2.1")).sockets == 0  # TEST-NET-1: none


def test_outgoing_counts_the_connections_this_process_opened():
    before = socket_backlog(LOOPBACK)
    with connected_pair():
        now = socket_backlog(LOOPBACK)  # the client's socket is outgoing, the accepted one not
        assert (now.sockets - before.sockets, now.outgoing - before.outgoing) == (2, 1)


def test_host_addresses_reads_names_addresses_and_ports():
    assert host_addresses("127.0.0.1:8000") == LOOPBACK
    assert host_addresses("[::1]") == host_addresses("::1")
    with pytest.raises(ValueError, match="cannot resolve 'no-such-host.invalid'"):
        host_addresses("no-such-host.invalid")
