"""Run the app under uvicorn: in the foreground (``kthena serve``) or on a thread (tests, embedding).

Socket buffers are kept small so that a client that stops reading is noticed: by default the
kernel grows a loopback send buffer to megabytes and asyncio buffers 64 KiB more, which is
thousands of tokens a reader never takes. Here a connection buffers at most about
``2 * SEND_BUFFER_BYTES`` in the kernel (Linux doubles the value) plus ``WRITE_BUFFER_BYTES``
in asyncio before the response's ``send`` waits; the engine then pauses that stream (see
``AsyncLLM``). At LLM stream rates (kilobytes per second) this costs nothing.

Connections that hold a socket without a request are closed: one whose request header is not
complete ``HEADER_TIMEOUT_S`` after it opened (or after the request's first byte), and one idle
between requests for ``KEEP_ALIVE_S`` (uvicorn's keep-alive timeout). Every server here (the
colocated server, the PD and DP routers and workers) runs through ``run_server``.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

if TYPE_CHECKING:
    import asyncio

    from kthena_serve.server.shutdown import Drain

__all__ = ["HEADER_TIMEOUT_S", "KEEP_ALIVE_S", "SEND_BUFFER_BYTES", "WRITE_BUFFER_BYTES",
           "BackgroundServer", "ListenError", "bind_listener", "run_server"]

log = logging.getLogger(__name__)

SEND_BUFFER_BYTES = 16 * 1024  # SO_SNDBUF of accepted connections (inherited from the listener)
WRITE_BUFFER_BYTES = 16 * 1024  # asyncio's high-water mark per connection (default 64 KiB)


def _http_protocol(header_timeout_s: float) -> type:
    """uvicorn's "auto" HTTP protocol, with a smaller asyncio write buffer per connection and
    a bound on the time a request's header may take (uvicorn has none).

    The header clock starts when a connection opens and when the first byte of a request after
    a finished one arrives; the request's header complete (uvicorn starts its cycle) stops it.
    Between requests uvicorn's own keep-alive timeout closes an idle connection."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class BoundedConnection(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _cycle_before: object = None  # the cycle before the request being read

        def connection_made(self, transport: asyncio.Transport) -> None:
            transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
            super().connection_made(transport)
            self._start_header_clock()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or
                                               self.cycle.response_complete):
                self._start_header_clock()  # a next request on a kept-alive connection
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._cycle_before:
                self._stop_header_clock()  # its header is complete: the request runs

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_clock()
            super().connection_lost(exc)

        def _start_header_clock(self) -> None:
            self._cycle_before = self.cycle
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _stop_header_clock(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.debug("closing a connection that sent no complete request header in %g s",
                          header_timeout_s)
                self.transport.close()

    return BoundedConnection

_FLUSH_S = 5.0  # after on_deadline: time for the final error events to reach the clients


class ListenError(OSError):
    """The server's socket cannot be bound or listen; the message names the address and what
    to change (``--port`` / ``--host``)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _why(host: str, port: int, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use; pick another with --port"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine; pick another with --host"
    if error.errno == errno.EACCES:
        return f"port {port} on {host} needs privileges; pick one above 1023 with --port"
    if isinstance(error, socket.gaierror):
        return f"--host {host!r} does not resolve ({error.strerror}); pick another with --host"
    return f"cannot listen on {host}:{port} ({error.strerror or error}); check --host and --port"


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a free port), not yet listening: what
    ``run_server(sock=...)`` serves.

    ``kthena serve`` binds it before the model loads, so a port another server listens on is
    reported at once; until the server starts, connections are refused rather than queued
    behind the load. (SO_REUSEADDR, as uvicorn sets it, lets a restart reuse a port whose
    old connections are in TIME_WAIT; it also lets two servers that both still load bind one
    port: the second to listen then gets ``ListenError`` from ``run_server``.)

    Raises:
        ListenError: the address is in use, not this machine's, or needs privileges.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn decides
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ListenError(error.errno, _why(host, port, error)) from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn.Server that reports the bound port once it accepts connections, and drains
    before it exits (see server/shutdown.py) when its app has a ``Drain``."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[int], None] | None,
                 shutdown_timeout: float = 30.0,
                 on_deadline: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_ready = on_ready
        self.port: int | None = None
        self.drain = getattr(config.app.state, "drain", None)
        self.shutdown_timeout = shutdown_timeout
        self.on_deadline = on_deadline

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.drain is None or self.drain.is_draining:
            super().handle_exit(sig, frame)  # a second signal: exit now
            return
        self.drain.is_draining = True
        log.warning("draining: %d requests in flight, up to %g s", self.drain.num_active,
                    self.shutdown_timeout)
        threading.Thread(target=self._finish_drain, name="kthena-drain", daemon=True).start()

    def _finish_drain(self) -> None:
        _wait_idle(self.drain, time.monotonic() + self.shutdown_timeout)
        if self.drain.num_active and self.on_deadline is not None:
            log.warning("drain timeout: ending %d requests", self.drain.num_active)
            self.on_deadline()
            _wait_idle(self.drain, time.monotonic() + _FLUSH_S)
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets)
        except OSError as error:  # listen() on the bound socket (another process raced us)
            host, port = sockets[0].getsockname()[:2] if sockets else (self.config.host,
                                                                       self.config.port)
            raise ListenError(error.errno, _why(host, port, error)) from None
        for server in self.servers:
            for sock in server.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        if self.servers and self.servers[0].sockets:
            self.port = self.servers[0].sockets[0].getsockname()[1]
        if self.on_ready is not None and self.port is not None:
            self.on_ready(self.port)


def _wait_idle(drain: Drain, deadline: float) -> None:
    while drain.num_active and time.monotonic() < deadline:
        time.sleep(0.05)


# An idle keep-alive connection is closed after this many seconds: longer than the clients
# that pool connections keep them (aiohttp's, in vLLM's bench client, up to 60 s), so the
# client closes first. The other way round, a request sent on a connection the server is just
# closing is reset (uvicorn's default is 5 s; seen as one ConnectionResetError in a trace run).
KEEP_ALIVE_S = 75.0
# A connection that has not sent a complete request header this many seconds after it opened
# (or after its request's first byte) is closed: a slow-header (slowloris) or never-used
# connection holds a socket, not a request. Node's headersTimeout is 60 s; a client sends a
# header in one write.
HEADER_TIMEOUT_S = 30.0


def _config(app: FastAPI, host: str, port: int, log_level: str, keep_alive_s: float | None,
            header_timeout_s: float | None) -> uvicorn.Config:
    keep_alive_s = KEEP_ALIVE_S if keep_alive_s is None else keep_alive_s
    header_timeout_s = HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s
    for name, value in (("keep_alive_s", keep_alive_s), ("header_timeout_s", header_timeout_s)):
        if not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5, lifespan="off",
                          http=_http_protocol(header_timeout_s), timeout_keep_alive=keep_alive_s)


def run_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000,
               on_ready: Callable[[int], None] | None = None, log_level: str = "info",
               shutdown_timeout: float = 30.0,
               on_deadline: Callable[[], None] | None = None,
               sock: socket.socket | None = None, keep_alive_s: float | None = None,
               header_timeout_s: float | None = None) -> None:
    """Serve until SIGTERM / SIGINT; ``on_ready(port)`` runs once the socket accepts connections.

    On the first signal the app drains (``shutdown_timeout`` seconds at most), then
    ``on_deadline()`` ends what is still running (the engine's streams get a final error event
    and ``[DONE]``), then the server exits.

    Args:
        sock: a socket from ``bind_listener(host, port)`` (the server takes it over and closes
            it); None: bound here.
        keep_alive_s: an idle connection between requests is closed after this long
            (``--timeout-keep-alive``; None: ``KEEP_ALIVE_S``).
        header_timeout_s: a connection that sends no complete request header this long after
            it opened (or after its next request's first byte) is closed
            (``--timeout-header-read``; None: ``HEADER_TIMEOUT_S``).

    Raises:
        ListenError: the address cannot be bound or listened on (never uvicorn's exit).
    """
    sock = bind_listener(host, port) if sock is None else sock
    with sock:
        config = _config(app, host, port, log_level, keep_alive_s, header_timeout_s)
        _Server(config, on_ready, shutdown_timeout, on_deadline).run(sockets=[sock])


class BackgroundServer:
    """uvicorn on a daemon thread, on a free port of 127.0.0.1 by default.

    Example::

        with BackgroundServer(app) as server:
            httpx.get(f"{server.url}/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                 shutdown_timeout: float = 30.0,
                 on_deadline: Callable[[], None] | None = None,
                 keep_alive_s: float = KEEP_ALIVE_S,
                 header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        config = _config(app, host, port, "warning", keep_alive_s, header_timeout_s)
        self._server = _Server(config, None, shutdown_timeout, on_deadline)
        self._host = host
        self._thread = threading.Thread(target=self._server.run, name="kthena-http", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while self._server.port is None:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._server.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def begin_shutdown(self) -> None:
        """What SIGTERM does to ``run_server``: drain, end the rest at the timeout, exit."""
        self._server.handle_exit(15, None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
