"""Foreign transfer status codes -> kthena_comm exceptions, in one table per library.

HIXL (CANN's one-sided library, under Mooncake's ascend_direct transport) documents its status
codes (CANN "HIXL error codes"); each family maps to one exception:

    TIMEOUT                          -> TransferTimeoutError   (retry, or fail the request)
    NOT_CONNECTED                    -> PeerUnreachableError   (the link is gone)
    PARAM_INVALID                    -> UnregisteredRangeError (a range is not registered)
    RESOURCE_EXHAUSTED, FAILED, ...  -> TransferError

Mooncake's Python API collapses every failure to ``-1`` (``0`` for an async batch id), HIXL's
code included, so a Mooncake failure is sorted into the same families by what can still be
observed: the peer no longer answers a probe (NOT_CONNECTED), the call failed only after the
transport's own transfer deadline had passed (TIMEOUT), or neither (PARAM_INVALID: the peer is
up and rejected a range).
"""

from __future__ import annotations

import enum

from kthena_comm.errors import (
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
    UnregisteredRangeError,
)

__all__ = ["HixlStatus", "hixl_error", "mooncake_error"]


class HixlStatus(enum.IntEnum):
    """HIXL ``Status`` values (uint32), as documented for CANN 8.5 / 9.0."""

    SUCCESS = 0
    PARAM_INVALID = 103900
    TIMEOUT = 103901
    NOT_CONNECTED = 103902
    ALREADY_CONNECTED = 103903
    NOTIFY_FAILED = 103904
    UNSUPPORTED = 103905
    RESOURCE_EXHAUSTED = 203900
    FAILED = 503900


_FAMILIES: dict[int, type[TransferError]] = {
    HixlStatus.TIMEOUT: TransferTimeoutError,
    HixlStatus.NOT_CONNECTED: PeerUnreachableError,
    HixlStatus.PARAM_INVALID: UnregisteredRangeError,
}


def hixl_error(status: int, backend: str, peer: str, op: str) -> TransferError | None:
    """The exception for a HIXL status; None for SUCCESS (and ALREADY_CONNECTED, not a fault)."""
    if status in (HixlStatus.SUCCESS, HixlStatus.ALREADY_CONNECTED):
        return None
    try:
        name = HixlStatus(status).name
    except ValueError:
        name = "unknown status"
    cls = _FAMILIES.get(status, TransferError)
    return cls(backend, peer, op, f"HIXL returned {status} ({name})")


def mooncake_error(rc: int, backend: str, peer: str, op: str, *, peer_answers: bool,
                   elapsed_s: float, transport_timeout_s: float | None) -> TransferError:
    """The exception for a failed Mooncake call (``rc`` < 0), sorted as the module doc says."""
    if not peer_answers:
        return PeerUnreachableError(backend, peer, op,
                                    f"Mooncake returned {rc} and the peer does not answer")
    if transport_timeout_s is not None and elapsed_s >= transport_timeout_s:
        return TransferTimeoutError(backend, peer, op,
                                    f"Mooncake returned {rc} after {elapsed_s:.1f}s, past the "
                                    f"transport's {transport_timeout_s:g}s transfer timeout")
    return UnregisteredRangeError(backend, peer, op,
                                  f"Mooncake returned {rc} while the peer answers probes: it "
                                  "rejected a range it has not registered (or the local "
                                  "transport queue overflowed; see Mooncake's log)")
