"""`LateWrites`: the decode side frees a failed hand-off's blocks only when its kernel holds
nothing more from the prefill host.

Real TCP sockets over 127.0.0.1 stand in for the transfer engine's connections (the kernel's
queues are what is read, whoever owns the socket): unread bytes keep the blocks aside whatever
the peer says; a gone peer keeps them aside until the sockets open at the failure have its FIN.
"""

from __future__ import annotations

import socket
import sys
import time

import pytest

from kthena_serve.pd.late_writes import LateWrites

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/net/tcp is Linux's")


def eventually(check, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "never became true"
        time.sleep(0.01)


@pytest.fixture
def pair():
    with socket.create_server(("127.0.0.1", 0)) as listener:  # listening throughout
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
        yield sender, receiver
        sender.close()
        receiver.close()


def _read(sock: socket.socket, num_bytes: int) -> None:
    while num_bytes > 0:
        num_bytes -= len(sock.recv(num_bytes))


def test_unread_bytes_keep_the_blocks_aside_whatever_the_peer_says(pair):
    sender, receiver = pair
    late = LateWrites("127.0.0.1")
    sender.sendall(b"k" * 40_000)  # a late put landing in the kernel
    eventually(lambda: not late.drained(peer_settled=True))
    _read(receiver, 40_000)  # the transfer engine reads it into its blocks
    eventually(lambda: late.drained(peer_settled=True))


def test_a_gone_peer_keeps_them_aside_until_its_fin(pair):
    sender, receiver = pair
    late = LateWrites("127.0.0.1")  # the failure: both sockets of the pair are open
    assert not late.drained(peer_settled=False)  # its kernel may still send
    sender.sendall(b"v" * 10_000)
    sender.close()  # the data, then the FIN
    eventually(lambda: receiver.recv(1, socket.MSG_PEEK) == b"v")
    assert not late.drained(peer_settled=False)  # received, not read yet
    _read(receiver, 10_000)
    receiver.close()
    eventually(lambda: late.drained(peer_settled=False))


def test_a_socket_opened_after_the_failure_does_not_hold_a_gone_peers_blocks():
    late = LateWrites("127.0.0.1")  # no socket to that host at the failure
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as fresh:
        accepted, _ = listener.accept()
        with accepted:
            assert fresh.fileno() >= 0 and late.drained(peer_settled=False)


def test_a_get_waits_for_its_own_connections_to_the_prefill_host(pair):
    """For a get this process's transfer engine ran, a connection it opened to the prefill
    host (not to its HTTP port) is a slice still reading: the blocks wait for it to close."""
    sender, _ = pair  # sender: opened by this process, to the listener's port
    port = sender.getpeername()[1]
    assert not LateWrites("127.0.0.1", own_reads_except_port=port + 1).drained(True)
    assert LateWrites("127.0.0.1", own_reads_except_port=port).drained(True)  # HTTP's own
    sender.close()
    eventually(lambda: LateWrites("127.0.0.1", own_reads_except_port=port + 1).drained(True))
