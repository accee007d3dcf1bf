"""Pinned prefills: blocks a prefill worker keeps for a decode worker to pull, with deadlines.

A prefill answered for a remote decode (``do_remote_decode``) leaves its prompt blocks held in
its own KV manager, under a random transfer id. They go back exactly once, by whichever comes
first::

    add ──▶ pinned ── lease (decode checks ids + prompt, deadline moves to now + lease_s)
              │            │
              │            └─ release (decode's get is done) ──▶ freed, release says True
              └─ deadline passes (no decode came, or it stalled) ──▶ freed by ``expire``

``release`` returning False tells the decode side its read may have raced a free (the pin had
expired), so it must not use those bytes. ``free`` is called outside the table's lock; the
worker passes one that runs the KV manager's ``free`` on its compute thread (the manager's
owner). Thread-safe.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = ["Pin", "PinError", "PinTable"]


class PinError(LookupError):
    """A lease the table refuses; ``status`` is the HTTP status the worker answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@attrs.frozen
class Pin:
    """One prefill's held blocks and what a decode worker needs besides the bytes."""

    transfer_id: str
    request_id: str  # the owner of the blocks in the prefill worker's KV manager
    block_ids: tuple[int, ...]
    prompt_digest: str
    first_token_id: int
    first_token_logprobs: dict[str, Any] | None  # TokenLogprobs.to_json(), if asked
    deadline: float


class PinTable:
    """Pins by transfer id (see the module docs).

    Args:
        timeout_s: how long a pin waits for its decode request.
        lease_s: how long a leased pin waits for its release (the decode side's get).
        free: gives a pin's blocks back (called once per pin, outside the lock).
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, timeout_s: float, lease_s: float, free: Callable[[Pin], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.lease_s = timeout_s, lease_s
        self._free = free
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: dict[str, Pin] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._pins)

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(p.block_ids) for p in self._pins.values())

    def add(self, request_id: str, block_ids: Sequence[int], prompt_digest: str,
            first_token_id: int, first_token_logprobs: dict[str, Any] | None = None) -> Pin:
        """Pin blocks already held by ``request_id``; returns the pin (its fresh transfer id)."""
        pin = Pin(secrets.token_urlsafe(16), request_id, tuple(block_ids), prompt_digest,
                  first_token_id, first_token_logprobs, self._clock() + self.timeout_s)
        with self._lock:
            self._pins[pin.transfer_id] = pin
        return pin

    def lease(self, transfer_id: str, block_ids: Sequence[int], prompt_digest: str) -> Pin:
        """Check a decode worker's claim and give it ``lease_s`` to read the blocks.

        Raises:
            PinError: 404 no such pin (never made, released, or expired); 409 the block ids or
                the prompt differ from the pinned ones.
        """
        with self._lock:
            pin = self._pins.get(transfer_id)
            if pin is None or pin.deadline <= self._clock():
                raise PinError(404, f"no KV is pinned under remote_request_id "
                               f"{transfer_id!r}: unknown, already pulled, or held past its "
                               f"{self.timeout_s:g} s timeout")
            if tuple(block_ids) != pin.block_ids:
                raise PinError(409, "remote_block_ids are not the blocks pinned for this "
                               "remote_request_id; send the prefill answer's list unchanged")
            if prompt_digest != pin.prompt_digest:
                raise PinError(409, "the decode request's prompt is not the one this "
                               "prefill computed; send the same body to both")
            pin = attrs.evolve(pin, deadline=max(pin.deadline, self._clock() + self.lease_s))
            self._pins[transfer_id] = pin
            return pin

    def release(self, transfer_id: str) -> bool:
        """Free a pin now; True if it was still pinned (not expired, not released before)."""
        with self._lock:
            pin = self._pins.pop(transfer_id, None)
            valid = pin is not None and pin.deadline > self._clock()
        if pin is not None:
            self._free(pin)
        return valid

    def expire(self) -> int:
        """Free every pin past its deadline; returns how many."""
        now = self._clock()
        with self._lock:
            gone = [p for p in self._pins.values() if p.deadline <= now]
            for pin in gone:
                del self._pins[pin.transfer_id]
            self.num_expired += len(gone)
        for pin in gone:
            self._free(pin)
        return len(gone)

    def clear(self) -> None:
        """Free every pin (the worker is stopping)."""
        with self._lock:
            pins = list(self._pins.values())
            self._pins.clear()
        for pin in pins:
            self._free(pin)
