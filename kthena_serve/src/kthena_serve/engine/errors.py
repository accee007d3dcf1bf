"""Errors the engine raises: for requests it cannot take (the server maps them to HTTP 4xx),
and when the engine itself cannot start or run."""

from __future__ import annotations

__all__ = ["EngineDeadError", "InvalidRequestError", "OverloadedError", "RankDiedError",
           "RequestFailedError"]


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


class OverloadedError(RuntimeError):
    """The queue is past its bound (``--max-queue-delay`` / ``--max-queued-tokens``): the
    request was refused before anything was generated (the server answers 503).

    Attributes:
        retry_after_s: whole seconds after which the queue is expected back under the bound
            (the ``Retry-After`` header).
        limit: the bound that refused it (``queue_delay`` or ``queued_tokens``; ``worker``: a
            worker behind the PD router refused it by its own bound).
    """

    def __init__(self, message: str, retry_after_s: int, limit: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit


class RequestFailedError(RuntimeError):
    """The engine failed while serving this one request; it ended, the others went on.

    The message says what to do, never the internal exception (that goes to the log).
    """


class RankDiedError(RuntimeError):
    """A tensor-parallel rank's process exited (before it joined the others, or while it
    served: ``ParallelModelRunner.dead_rank``).

    Attributes:
        rank: the TP rank whose process died.
        exitcode: its exit status (negative: killed by that signal).
    """

    def __init__(self, message: str, rank: int, exitcode: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
