"""Value types of one-sided transfer: a registered-memory descriptor and a transfer op.

A ``MemoryHandle`` is what a peer needs to address memory it does not own: which backend, which
peer (address or session), the base address and length in the owner's address space, an optional
segment name (shm), an optional KV-pool layout id, and where the memory lives (host or a device).
It is small, frozen and serialisable, so it can travel in a control message (JSON) to the peer
that will put into or get from it.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from kthena_comm.transfer.memory import MemoryLocation


def _non_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be an int > 0, got {value!r}")


def _a_location(instance: object, attribute: attrs.Attribute, value: str) -> None:
    MemoryLocation.parse(value)  # raises ValueError naming the accepted spellings


@attrs.frozen
class MemoryHandle:
    """Registered memory, as a peer addresses it."""

    backend: str
    peer: str
    """Owner's address (``host:port`` for mooncake, ``shm:<pid>`` for shm, fabric id for local)."""
    base_addr: int = attrs.field(validator=_non_negative)
    length: int = attrs.field(validator=_positive)
    segment: str = ""
    """Backend-specific name of the memory (shm segment); empty when not needed."""
    layout_id: str | None = None
    """Id of the KV-pool layout this memory holds, when it is a KV pool."""
    location: str = attrs.field(default="host", validator=_a_location)
    """Where the memory lives in its owner: ``host``, ``cuda:N`` or ``npu:N``."""

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryHandle:
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MemoryHandle:
        return cls.from_dict(json.loads(text))


@attrs.frozen
class TransferOp:
    """Move ``length`` bytes between ``local`` at ``local_offset`` and ``remote`` at ``remote_offset``.

    In a put the bytes go local → remote; in a get remote → local. ``local`` must be registered
    with the engine that runs the op.
    """

    local: MemoryHandle
    local_offset: int = attrs.field(validator=_non_negative)
    remote: MemoryHandle
    remote_offset: int = attrs.field(validator=_non_negative)
    length: int = attrs.field(validator=_positive)
