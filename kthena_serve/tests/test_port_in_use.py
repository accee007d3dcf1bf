"""A port that cannot be listened on is found before anything loads: one line naming the port
and the flag to change, and a non-zero exit, in every mode."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kthena_serve.server.launch import ListenError, bind_listener, run_server


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("mode", [[], ["--mode", "pd"], ["--dp", "2"]],
                         ids=["colocated", "pd", "dp"])
def test_kthena_serve_on_a_taken_port_fails_before_loading(taken_port, mode):
    kthena = Path(sys.executable).with_name("kthena")
    done = subprocess.run([str(kthena), "serve", "--port", str(taken_port), *mode],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"kthena serve: port {taken_port} on 127.0.0.1 is in use; pick another with --port"]
    assert done.stdout == ""  # no layout line, no worker or replica started, no model loaded


def test_bind_listener_names_the_address_and_the_flag(taken_port):
    with pytest.raises(ListenError, match=f"^port {taken_port} on 127.0.0.1 is in use; pick "
                                          "another with --port$"):
        bind_listener("127.0.0.1", taken_port)
    with pytest.raises(ListenError, match="192.0.2.1 is not an address of this machine; pick "
                                          "another with --host"):
        bind_listener("192.0.2.1", 8000)  # TEST-NET-1: never local


def test_bound_socket_refuses_connections_until_served():
    sock = bind_listener("127.0.0.1", 0)
    with sock, socket.socket() as client:
        port = sock.getsockname()[1]
        assert client.connect_ex(("127.0.0.1", port)) != 0  # refused while the model loads


def test_run_server_raises_instead_of_exiting(taken_port):
    from fastapi import FastAPI

    with pytest.raises(ListenError, match=f"port {taken_port} on 127.0.0.1 is in use"):
        run_server(FastAPI(), host="127.0.0.1", port=taken_port)
