"""Errors the engine raises for requests it cannot take; the server maps them to HTTP 4xx."""

from __future__ import annotations

__all__ = ["EngineDeadError", "InvalidRequestError", "RequestFailedError"]


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked (too long, bad parameter ...).

    Attributes:
        param: the offending field, as the OpenAI API names it (``"max_tokens"`` ...), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step failed); the request cannot complete."""


class RequestFailedError(RuntimeError):
    """The engine failed while serving this one request; it ended, the others went on.

    The message says what to do, never the internal exception (that goes to the log).
    """
