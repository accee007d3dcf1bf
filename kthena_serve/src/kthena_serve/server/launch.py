"""Run the app under uvicorn: in the foreground (``kthena serve``) or on a thread (tests, embedding)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

__all__ = ["BackgroundServer", "run_server"]


class _Server(uvicorn.Server):
    """uvicorn.Server that reports the bound port once it accepts connections."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[int], None] | None) -> None:
        super().__init__(config)
        self.on_ready = on_ready
        self.port: int | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.servers and self.servers[0].sockets:
            self.port = self.servers[0].sockets[0].getsockname()[1]
        if self.on_ready is not None and self.port is not None:
            self.on_ready(self.port)


def _config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5, lifespan="off")


def run_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000,
               on_ready: Callable[[int], None] | None = None, log_level: str = "info") -> None:
    """Serve until interrupted; ``on_ready(port)`` runs once the socket accepts connections."""
    _Server(_config(app, host, port, log_level), on_ready).run()


class BackgroundServer:
    """uvicorn on a daemon thread, on a free port of 127.0.0.1 by default.

    Example::

        with BackgroundServer(app) as server:
            httpx.get(f"{server.url}/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _Server(_config(app, host, port, "warning"), None)
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

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
