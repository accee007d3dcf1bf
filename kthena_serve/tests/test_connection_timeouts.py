"""Connections that hold a socket without a request are closed (issue 53): one that never
sends a complete request header, one that sends it a byte at a time, and one idle between
requests; a request whose header arrived in time runs as long as it needs.

The bounds are set to 1 s here; each test waits far longer than the bound for the close and
asserts that it happened, not how fast.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from fastapi import FastAPI

from kthena_serve.server.launch import HEADER_TIMEOUT_S, KEEP_ALIVE_S, BackgroundServer

BOUND_S = 1.0
PATIENCE_S = 60.0  # how long a test waits for a close that is due after BOUND_S


@pytest.fixture(scope="module")
def address():
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(3 * BOUND_S)  # longer than the header bound: it must not apply
        return {"slow": True}

    with BackgroundServer(app, keep_alive_s=BOUND_S, header_timeout_s=BOUND_S) as server:
        yield "127.0.0.1", int(server.url.rsplit(":", 1)[1])


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within PATIENCE_S."""
    sock.settimeout(PATIENCE_S)
    try:
        while sock.recv(4096):
            pass  # a response before the close is read past
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode()


def _read_response(sock: socket.socket) -> bytes:
    sock.settimeout(PATIENCE_S)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_a_connection_that_sends_nothing_is_closed(address):
    with socket.create_connection(address) as sock:
        assert _closed_by_server(sock)


def test_a_header_sent_a_byte_at_a_time_is_closed(address):
    """A slow-header client keeps sending, never finishing its header: the header bound runs
    from the connection's start, not from its last byte."""
    with socket.create_connection(address) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        deadline = time.monotonic() + PATIENCE_S
        closed = False
        while not closed and time.monotonic() < deadline:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                sock.settimeout(BOUND_S / 4)
                closed = sock.recv(4096) == b""
            except TimeoutError:
                continue  # still open: send the next header line
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed


def test_an_idle_keep_alive_connection_is_closed_after_its_requests(address):
    with socket.create_connection(address) as sock:
        for _ in range(2):  # the second request's header clock starts afresh
            sock.sendall(_request("/health"))
            response = _read_response(sock)
            assert response.startswith(b"HTTP/1.1 200") and b'{"ok":true}' in response
        assert _closed_by_server(sock)


def test_a_request_whose_header_came_in_time_runs_past_the_bound(address):
    with socket.create_connection(address) as sock:
        sock.sendall(_request("/slow"))
        response = _read_response(sock)
        assert response.startswith(b"HTTP/1.1 200") and b'{"slow":true}' in response


def test_defaults_are_bounded_and_bad_bounds_are_refused():
    assert 0 < HEADER_TIMEOUT_S < KEEP_ALIVE_S < 100  # the 100 s saw no close at all
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="header_timeout_s must be a positive number"):
            BackgroundServer(FastAPI(), header_timeout_s=bad)
