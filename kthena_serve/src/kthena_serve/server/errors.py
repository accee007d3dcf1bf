"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``, and handlers."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kthena_serve.engine.admission import (
    QUEUE_TIMEOUT,  # also the code of a refusal at its deadline
)
from kthena_serve.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
)

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["OVERLOADED", "QUEUE_TIMEOUT", "ApiError", "error_body", "install_handlers", "overloaded_response"]

OVERLOADED = "overloaded"  # the error code of a refusal past the queue bound (admission.py)

_INTERNAL = "internal error while handling the request; retry it, and report it if it persists"

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error to return as is: HTTP status, message, offending param, machine-readable code."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               ) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, retry_after_s: int = 1) -> JSONResponse:
    """The error as a response; a 503 ("try again later") says when, in ``Retry-After``."""
    headers = {"Retry-After": str(retry_after_s)} if status == 503 else None
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def overloaded_response(error: OverloadedError) -> JSONResponse:
    """503 ``{"error": {..., "code": "overloaded"}}`` with the refusal's ``Retry-After``; code
    ``queue_timeout`` for a request refused at its queue deadline after admission (a DP router
    does not pass that one on: its wait is spent)."""
    code = QUEUE_TIMEOUT if error.limit == QUEUE_TIMEOUT else OVERLOADED
    return error_response(503, str(error), code=code, retry_after_s=error.retry_after_s)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg', '')}", None
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":  # OpenAI's wording for an unknown field
        return (f"unrecognized request argument supplied: {param}; this server does not "
                "implement it"), param
    where = f"'{param}': " if param else "body: "
    return f"{where}{first.get('msg', 'invalid request')}", param


def install_handlers(app: FastAPI) -> None:
    """Map every failure to an OpenAI error body with a matching status."""

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(InvalidRequestError)
    async def _engine_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        return overloaded_response(exc)

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, str(exc), code="request_failed")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    # Not an exception_handler(Exception): Starlette runs that one in its outermost layer and
    # re-raises, so the server drops the keep-alive connection after every 500.
    app.add_middleware(_CatchAll)


class _CatchAll:
    """Any unexpected exception becomes a 500 with an OpenAI body; the connection stays open."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:  # noqa: BLE001
            log.exception("unhandled error on %s", scope.get("path"))
            if started:
                raise  # headers are gone: nothing clean can be sent any more
            await error_response(500, _INTERNAL)(scope, receive, send)
