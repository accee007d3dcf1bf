"""Host-memory tier: a byte-bounded LRU of block values in this process's RAM."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

import attrs

from mooncake_kv.tiers.base import register_tier

__all__ = ["HostMemoryTier", "HostTierConfig"]


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive number of bytes, got {value!r}")


@attrs.frozen
class HostTierConfig:
    """Open with `open_tier`: a HostMemoryTier of `capacity_bytes` (values' sizes summed)."""

    kind: ClassVar[str] = "host"
    capacity_bytes: int = attrs.field(validator=_positive)
    name: str = "host"


class HostMemoryTier:
    """LRU over keys; `get` and re-`put` refresh recency; putting past capacity evicts.

    A value larger than the whole capacity is not kept (it is returned as evicted).
    Not thread-safe: like the KV manager, it belongs to one owner thread.
    """

    def __init__(self, capacity_bytes: int, name: str = "host") -> None:
        _positive(self, attrs.fields(HostTierConfig).capacity_bytes, capacity_bytes)
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._values: OrderedDict[str, bytes] = OrderedDict()

    @classmethod
    def from_config(cls, config: HostTierConfig) -> HostMemoryTier:
        return cls(config.capacity_bytes, config.name)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._values)

    def contains(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str) -> bytes | None:
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    def put(self, key: str, value: bytes) -> list[tuple[str, bytes]]:
        self.remove(key)
        if len(value) > self.capacity_bytes:
            return [(key, value)]
        self._values[key] = value
        self.used_bytes += len(value)
        evicted = []
        while self.used_bytes > self.capacity_bytes:
            old_key, old_value = self._values.popitem(last=False)
            self.used_bytes -= len(old_value)
            evicted.append((old_key, old_value))
        return evicted

    def remove(self, key: str) -> None:
        value = self._values.pop(key, None)
        if value is not None:
            self.used_bytes -= len(value)

    def close(self) -> None:
        self._values.clear()
        self.used_bytes = 0


register_tier(HostTierConfig.kind, HostMemoryTier.from_config)
