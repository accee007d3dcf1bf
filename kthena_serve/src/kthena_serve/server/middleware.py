"""ASGI middleware: a request-body size cap and the API key check (every path but the open
ones: ``/health``, and ``/metrics`` where the server is started with ``--public-metrics``)."""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable

__all__ = ["HEALTH_PATH", "METRICS_PATH", "ApiKeyMiddleware", "BodyLimitMiddleware",
           "public_paths"]

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"


def public_paths(*, public_metrics: bool) -> frozenset[str]:
    """The paths a server answers without credentials: the probes' ``/health``, and with
    ``public_metrics`` the scrapers' ``/metrics`` (totals only; docs/security.md)."""
    return frozenset({HEALTH_PATH, METRICS_PATH} if public_metrics else {HEALTH_PATH})


async def _send_error(send, status: int, message: str, kind: str, code: str | None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Answer 413 to a body over ``max_bytes`` (declared or streamed) before the app sees it.

    The body is read here and replayed to the app; later ``receive`` calls go to the server,
    so the app still learns when the client disconnects.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        await _send_error(send, 413, f"request body exceeds {self.max_bytes} bytes",
                          "invalid_request_error", "request_too_large")


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on every path except ``open_paths``.

    The scheme is matched case-insensitively (RFC 7235: ``bearer`` is ``Bearer``); the key is
    compared in constant time. Paths are matched exactly (``/metrics/`` is not ``/metrics``).

    Args:
        api_key: the key; must not be empty.
        open_paths: the paths anyone may call (default: ``/health`` only; servers pass
            ``public_paths(...)``).
    """

    def __init__(self, app, api_key: str, open_paths: Iterable[str] = (HEALTH_PATH,)) -> None:
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty key")
        self.app, self.expected = app, api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        is_bearer = scheme.lower() == b"bearer"
        if not (hmac.compare_digest(token.strip(b" "), self.expected) and is_bearer):
            return await _send_error(send, 401, "missing or wrong API key; send "
                                     "'Authorization: Bearer <key>'", "authentication_error",
                                     "invalid_api_key")
        return await self.app(scope, receive, send)
