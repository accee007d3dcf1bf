"""ASGI middleware: a request-body size cap and the API key check (every path but the open
ones: ``/health``, and ``/metrics`` where the server is started with ``--public-metrics``).

Request signing: on the paths a middleware lists as ``signed_paths``, a caller may prove it
holds the key without sending it: ``sign_request`` puts a time and an HMAC-SHA256 (keyed by
the key) over method, path, time and the body's SHA-256 in two headers, and the middleware
accepts them within ``SIGNATURE_WINDOW_S`` of its clock. PD decode workers sign what they send
to prefill workers, whose address may come from a request body: the secret never leaves them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import Message, Receive

__all__ = ["HEALTH_PATH", "METRICS_PATH", "SIGNATURE_HEADER", "SIGNATURE_WINDOW_S",
           "TIME_HEADER", "ApiKeyMiddleware", "BodyLimitMiddleware", "public_paths",
           "sign_request", "verify_request"]

TIME_HEADER = "x-kthena-time"
SIGNATURE_HEADER = "x-kthena-signature"
SIGNATURE_WINDOW_S = 60.0
_MAX_SIGNED_BODY = 16 << 20  # a signed body is read whole before it is checked


def _mac(key: str, method: str, path: str, stamp: str, body: bytes) -> str:
    message = f"{method.upper()}\n{path}\n{stamp}\n{hashlib.sha256(body).hexdigest()}"
    return hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()


def sign_request(key: str, method: str, path: str, body: bytes,
                 now: float | None = None) -> dict[str, str]:
    """The two headers that prove, for this method, path and body, that the caller holds
    ``key`` (without sending it)."""
    stamp = f"{time.time() if now is None else now:.3f}"
    return {TIME_HEADER: stamp, SIGNATURE_HEADER: _mac(key, method, path, stamp, body)}


def verify_request(key: str, method: str, path: str, headers: Mapping[str, str], body: bytes,
                   now: float | None = None) -> bool:
    """Whether ``headers`` carry a signature of this request by ``key``, made within
    ``SIGNATURE_WINDOW_S`` seconds of ``now``."""
    stamp, signature = headers.get(TIME_HEADER), headers.get(SIGNATURE_HEADER)
    if not stamp or not signature:
        return False
    try:
        skew = abs((time.time() if now is None else now) - float(stamp))
    except ValueError:
        return False
    if not skew <= SIGNATURE_WINDOW_S:  # also refuses nan
        return False
    return hmac.compare_digest(signature, _mac(key, method, path, stamp, body))

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


async def _read_body(receive, max_bytes: int) -> bytes | None:
    """The whole request body, or its first part past ``max_bytes``; None if the client left."""
    body, more = b"", True
    while more and len(body) <= max_bytes:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app ``body`` once, then defers to the server's (so the app
    still learns when the client disconnects)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


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
        body = await _read_body(receive, self.max_bytes)
        if body is None:
            return None
        if len(body) > self.max_bytes:
            return await self._too_large(send)
        return await self.app(scope, _replay(body, receive), send)

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
        signed_paths: paths that also accept a request signed with the key
            (``sign_request``) instead of the key itself.
    """

    def __init__(self, app, api_key: str, open_paths: Iterable[str] = (HEALTH_PATH,),
                 signed_paths: Iterable[str] = ()) -> None:
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty key")
        self.app, self.key, self.expected = app, api_key, api_key.encode()
        self.open_paths = frozenset(open_paths)
        self.signed_paths = frozenset(signed_paths)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        is_bearer = scheme.lower() == b"bearer"
        if hmac.compare_digest(token.strip(b" "), self.expected) and is_bearer:
            return await self.app(scope, receive, send)
        if path in self.signed_paths and TIME_HEADER.encode() in headers:
            return await self._signed(scope, receive, send, headers)
        return await self._refuse(send)

    async def _signed(self, scope, receive, send, headers) -> None:
        body = await _read_body(receive, _MAX_SIGNED_BODY)
        if body is None:
            return None
        text = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items()}
        if len(body) > _MAX_SIGNED_BODY or not verify_request(
                self.key, scope.get("method", ""), scope["path"], text, body):
            return await self._refuse(send)
        return await self.app(scope, _replay(body, receive), send)

    @staticmethod
    async def _refuse(send) -> None:
        await _send_error(send, 401, "missing or wrong API key; send "
                          "'Authorization: Bearer <key>'", "authentication_error",
                          "invalid_api_key")
