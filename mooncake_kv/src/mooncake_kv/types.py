"""Ids, hashes and errors shared by the whole KV layer.

Ids are ``NewType``s over plain ``int``/``bytes``/``str`` so they cost nothing at run
time but keep signatures honest. Every error subclasses ``KVCacheError`` *and* the
builtin it behaves like (``KeyError``, ``ValueError``, ``RuntimeError``), so callers can
catch either; each message says what was wrong and what is allowed.
"""

from __future__ import annotations

from typing import NewType

__all__ = [
    "BlockHash",
    "BlockId",
    "DoubleFreeError",
    "DuplicateRequestError",
    "InstanceId",
    "KVCacheError",
    "OwnerThreadError",
    "RequestFinishedError",
    "RequestId",
    "RequestStateError",
    "TokenCountError",
    "TokenIdError",
    "UnknownIndexError",
    "UnknownInstanceError",
    "UnknownRequestError",
]

BlockId = NewType("BlockId", int)
"""Index of a block in one instance's pool: 0 .. num_blocks-1."""

BlockHash = NewType("BlockHash", bytes)
"""Digest naming a full block and its whole prefix: 16 bytes (xxh3_128) or 32 (sha256)."""

RequestId = NewType("RequestId", str)
"""The scheduler's name for a request; unique among live requests of one manager."""

InstanceId = NewType("InstanceId", str)
"""Name of one serving instance (one KVCacheManager) in a cluster."""


class KVCacheError(Exception):
    """Base class of every error raised by mooncake_kv."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else self.__class__.__name__


class _RequestError(KVCacheError):
    """An error about one request; ``request_id`` names it."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class UnknownRequestError(_RequestError, KeyError):
    """The request id was never registered with ``match_prefix`` (or was forgotten)."""


class RequestFinishedError(_RequestError, RuntimeError):
    """The request was already freed; only ``match_prefix`` may register it again."""


class DoubleFreeError(_RequestError, RuntimeError):
    """``free`` was called for a request that is already freed."""


class DuplicateRequestError(_RequestError, ValueError):
    """``match_prefix`` was called for a request that is still live."""


class RequestStateError(_RequestError, RuntimeError):
    """A verb was called out of order for this request (e.g. ``try_append`` before prefill)."""


class TokenCountError(_RequestError, ValueError):
    """A token count is negative, reserves prefill slots past the matched tokens, or more
    tokens were committed than slots reserved."""


class TokenIdError(_RequestError, ValueError):
    """A request's token id is not an integer in ``[0, 2**32)``."""


class OwnerThreadError(KVCacheError, RuntimeError):
    """A mutating verb was called from a thread other than the manager's owner thread."""


class UnknownIndexError(KVCacheError, ValueError):
    """A prefix index or hash algorithm name is not registered."""


class UnknownInstanceError(KVCacheError, KeyError):
    """An instance id is not known to the cluster index."""
