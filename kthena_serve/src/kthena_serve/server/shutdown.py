"""Graceful shutdown: stop admitting, let running requests finish, then end the rest cleanly.

::

    SIGTERM ─▶ draining: new requests (and /health) get 503 + Retry-After
               running requests go on ... until none is left or --shutdown-timeout passes
               then on_deadline(): the engine ends what is left with an error event + [DONE]
               then the server exits (a second SIGTERM / SIGINT exits at once)
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["Drain", "DrainMiddleware"]

RETRY_AFTER_S = 1


class Drain:
    """In-flight request count and the draining flag of one app (read by the server)."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_active = 0


class DrainMiddleware:
    """Counts requests in flight; refuses new ones with 503 once the app is draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.is_draining:
            await _refuse(send)
            return
        self.drain.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.num_active -= 1


async def _refuse(send: Send) -> None:
    body = json.dumps({"error": {
        "message": "the server is shutting down; send the request to another replica or retry "
                   "shortly", "type": "service_unavailable", "param": None,
        "code": "shutting_down"}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body})
