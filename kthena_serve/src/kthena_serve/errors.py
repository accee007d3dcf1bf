"""Errors the engine raises: for requests it cannot take (the server maps them to HTTP 4xx),
and when the engine itself cannot start or run."""

from __future__ import annotations

__all__ = ["EngineDeadError", "InvalidRequestError", "RankDiedError", "RequestFailedError"]


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


class RankDiedError(RuntimeError):
    """A tensor-parallel rank's process exited before it joined the others.

    Attributes:
        rank: the TP rank whose process died.
        exitcode: its exit status (negative: killed by that signal).
    """

    def __init__(self, message: str, rank: int, exitcode: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
