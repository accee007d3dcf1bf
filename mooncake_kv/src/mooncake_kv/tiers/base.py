"""Tier seam: the `KVTier` protocol, its registry, and the self-checking block frame.

A tier is a key -> bytes cache below the device pool (host memory, Mooncake Store, ...).
Tiers know nothing about blocks; `TieredKVCache` names keys, frames payloads and decides
what to store where. Every payload is stored inside a frame that repeats its key and the
cache geometry and carries an xxh3-64 checksum, so a truncated, stale or foreign value is
detected on the way back and treated as a miss (recompute), never loaded as KV:

    | magic "MKVB" | ver | key_len | fp_len | payload_len | xxh3_64 | key | fingerprint | payload |
      4              1     2         2        8             8

New tiers are added with `register_tier(kind, factory)` and opened with `open_tier(config)`,
where `config.kind` names the factory.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import xxhash

from mooncake_kv.types import KVCacheError

__all__ = [
    "CorruptBlockError",
    "KVTier",
    "TierConfig",
    "TierError",
    "TierUnavailableError",
    "UnknownTierError",
    "available_tiers",
    "frame_block",
    "open_tier",
    "register_tier",
    "unframe_block",
]

_MAGIC = b"MKVB"
_VERSION = 1
_HEADER = struct.Struct("<4sBHHQQ")


class TierError(KVCacheError, RuntimeError):
    """A tier operation failed (the caller degrades to recompute)."""


class TierUnavailableError(TierError, ConnectionError):
    """A tier cannot be opened or reached (e.g. no Mooncake master answers)."""


class UnknownTierError(KVCacheError, ValueError):
    """No tier factory is registered under that kind."""


class CorruptBlockError(KVCacheError, ValueError):
    """A stored value is not the frame of the block asked for."""


@runtime_checkable
class KVTier(Protocol):
    """A bounded key -> bytes cache. Called from the KV manager's owner thread only."""

    name: str

    def contains(self, key: str) -> bool:
        """Whether `key` is held now (a hint: it may be gone by the next `get`)."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value of `key`, or None on a miss."""
        ...

    def put(self, key: str, value: bytes) -> list[tuple[str, bytes]]:
        """Store `value`; return entries pushed out to make room (for the next tier down)."""
        ...

    def remove(self, key: str) -> None:
        """Drop `key` if held."""
        ...

    def close(self) -> None:
        """Release resources; later calls may fail. Safe to repeat."""
        ...


@runtime_checkable
class TierConfig(Protocol):
    """A frozen config whose `kind` names the registered factory that opens it."""

    kind: str


_FACTORIES: dict[str, Callable[[Any], KVTier]] = {}


def register_tier(kind: str, factory: Callable[[Any], KVTier]) -> None:
    """Make `open_tier(config)` call `factory(config)` for configs of this `kind`."""
    _FACTORIES[kind] = factory


def available_tiers() -> list[str]:
    return sorted(_FACTORIES)


def open_tier(config: TierConfig) -> KVTier:
    """Open the tier `config` describes.

    Raises:
        UnknownTierError: nothing registered under `config.kind`.
        TierUnavailableError: the tier exists but cannot be reached.
    """
    factory = _FACTORIES.get(getattr(config, "kind", None))
    if factory is None:
        raise UnknownTierError(
            f"no tier registered for {config!r}; known kinds: {', '.join(available_tiers())}"
        )
    return factory(config)


def _checksum(key: bytes, fingerprint: bytes, payload: bytes) -> int:
    digest = xxhash.xxh3_64()
    for part in (key, fingerprint, payload):
        digest.update(part)
    return digest.intdigest()


def frame_block(key: str, fingerprint: str, payload: bytes) -> bytes:
    """Wrap a block payload with its key, cache fingerprint and checksum."""
    raw_key, raw_fp = key.encode(), fingerprint.encode()
    header = _HEADER.pack(_MAGIC, _VERSION, len(raw_key), len(raw_fp), len(payload),
                          _checksum(raw_key, raw_fp, payload))
    return b"".join((header, raw_key, raw_fp, payload))


def unframe_block(key: str, fingerprint: str, blob: bytes) -> bytes:
    """The payload inside `blob`, checked against the expected key and fingerprint.

    Raises:
        CorruptBlockError: wrong magic/version/key/fingerprint/length or checksum.
    """
    if len(blob) < _HEADER.size:
        raise CorruptBlockError(f"value of {key!r} is {len(blob)} bytes, shorter than a frame")
    magic, version, key_len, fp_len, payload_len, checksum = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != _VERSION:
        raise CorruptBlockError(f"value of {key!r} is not a version-{_VERSION} block frame")
    start = _HEADER.size
    raw_key = blob[start : start + key_len]
    raw_fp = blob[start + key_len : start + key_len + fp_len]
    payload = blob[start + key_len + fp_len :]
    if raw_key != key.encode() or raw_fp != fingerprint.encode():
        raise CorruptBlockError(
            f"value of {key!r} holds block {raw_key!r} of cache {raw_fp!r}, "
            f"not {fingerprint!r}"
        )
    if len(payload) != payload_len or _checksum(raw_key, raw_fp, payload) != checksum:
        raise CorruptBlockError(f"value of {key!r} fails its length or checksum test")
    return payload
