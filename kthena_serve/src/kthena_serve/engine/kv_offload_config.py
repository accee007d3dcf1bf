"""The ``--kv-offload`` value: ``KVOffloadConfig`` (parsed, checked, frozen).

See ``kthena_serve.engine.kv_offload`` for the syntax and the offloader it opens; this module holds
only the value, so ``EngineConfig`` can check it without importing the engine side.
"""

from __future__ import annotations

import re

import attrs

from kthena_serve.engine.sizes import parse_bytes

__all__ = ["DEFAULT_MASTER", "SYNTAX", "KVOffloadConfig", "KVOffloadSyntaxError"]

DEFAULT_MASTER = "127.0.0.1:50051"
SYNTAX = ("'host=SIZE[,store=mooncake[@HOST:PORT]][,write=spill|through][,segment=SIZE]"
          "[,listen=ADDRESS][,queue=N][,timeout=SECONDS]'")
_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-]+:\d{1,5}$")
_HOST = re.compile(r"^[A-Za-z0-9_.\-]+$")


class KVOffloadSyntaxError(ValueError):
    """A ``--kv-offload`` value that cannot be read; the message says what is allowed."""


def _fail(text: str, what: str) -> KVOffloadSyntaxError:  # noqa: ARG001 - text: call sites
    return KVOffloadSyntaxError(f"{what}; the value reads {SYNTAX}, e.g. 'host=2GiB' or "
                                "'host=2GiB,store=mooncake@127.0.0.1:50051'")


def _positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise KVOffloadSyntaxError(f"KVOffloadConfig.{attribute.name} must be a positive int, "
                                   f"got {value!r}")


def _check_address(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not _ADDRESS.match(value)
                              or not 0 < int(value.rpartition(":")[2]) < 65536):
        raise KVOffloadSyntaxError(f"KVOffloadConfig.store_address must be None or HOST:PORT, "
                                   f"got {value!r}")


def _check_host(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not _HOST.match(value):
        raise KVOffloadSyntaxError(f"KVOffloadConfig.store_listen must be an IPv4 address or a "
                                   f"host name, got {value!r}")


def _check_timeout(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 600:
        raise KVOffloadSyntaxError(f"KVOffloadConfig.promote_timeout_s must be seconds in "
                                   f"(0, 600], got {value!r}")


@attrs.frozen
class KVOffloadConfig:
    """Where blocks go below the device pool (see module docs for the text form).

    Attributes:
        host_bytes: host-memory tier capacity.
        store_address: ``HOST:PORT`` of a ``mooncake_master``, or None (host tier only).
        store_segment_bytes: this process's RAM lent to the store.
        store_write_through: every offload also goes to the store at once (else: spills).
        queue_depth: offload queue bound.
        promote_timeout_s: how long a request waits for its promotion.
        store_listen: the address this process's store client listens on and advertises
            (its segment is read from there; never every interface).
    """

    host_bytes: int = attrs.field(validator=_positive_int)
    store_address: str | None = attrs.field(default=None, validator=_check_address)
    store_segment_bytes: int = attrs.field(default=64 << 20, validator=_positive_int)
    store_write_through: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    queue_depth: int = attrs.field(default=256, validator=_positive_int)
    promote_timeout_s: float = attrs.field(default=5.0, validator=_check_timeout)
    store_listen: str = attrs.field(default="127.0.0.1", validator=_check_host)

    @classmethod
    def parse(cls, text: str) -> KVOffloadConfig:
        """Read ``host=SIZE[,store=...][,queue=N][,timeout=S]``.

        Raises:
            KVOffloadSyntaxError: an unknown key, a repeated one, a missing ``host``, or a
                bad size, address, depth or timeout.
        """

        if not isinstance(text, str):
            raise _fail(str(text), f"expected text, got {type(text).__name__}")
        items: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("host", "store", "write", "segment", "listen", "queue",
                                      "timeout"):
                raise _fail(text, f"unknown item {part!r}")
            if key in items:
                raise _fail(text, f"{key!r} given twice")
            items[key] = value.strip()
        if "host" not in items:
            raise _fail(text, "no host=SIZE (the host tier comes first; the store sits below it)")
        sizes = {}
        for key in ("host", "segment"):
            try:
                sizes[key] = parse_bytes(items.get(key, str(64 << 20)))
            except ValueError as error:
                raise _fail(text, f"{key}: {error}") from None
        for key in ("segment", "write", "listen"):
            if key in items and "store" not in items:
                raise _fail(text, f"{key}= without store=")
        if items.get("write", "spill") not in ("spill", "through"):
            raise _fail(text, f"write={items['write']!r} is not 'spill' or 'through'")
        return cls(sizes["host"], _store_address(text, items.get("store")), sizes["segment"],
                   items.get("write") == "through",
                   _int(text, "queue", items.get("queue", "256")),
                   _seconds(text, items.get("timeout", "5")),
                   _listen(text, items.get("listen", "127.0.0.1")))

    def __str__(self) -> str:
        parts = [f"host={self.host_bytes}"]
        if self.store_address is not None:
            parts += [f"store=mooncake@{self.store_address}",
                      f"write={'through' if self.store_write_through else 'spill'}",
                      f"segment={self.store_segment_bytes}", f"listen={self.store_listen}"]
        return ",".join([*parts, f"queue={self.queue_depth}",
                         f"timeout={self.promote_timeout_s:g}"])


def _store_address(text: str, value: str | None) -> str | None:
    if value is None:
        return None
    kind, _, address = value.partition("@")
    if kind != "mooncake":
        raise _fail(text, f"store {kind!r} is not known (only 'mooncake')")
    address = address or DEFAULT_MASTER
    if not _ADDRESS.match(address) or not 0 < int(address.rpartition(":")[2]) < 65536:
        raise _fail(text, f"store address {address!r} is not HOST:PORT")
    return address


def _listen(text: str, value: str) -> str:
    if not _HOST.match(value):
        raise _fail(text, f"listen={value!r} is not an address or host name")
    return value


def _int(text: str, key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise _fail(text, f"{key}={value!r} is not a positive integer")
    return int(value)


def _seconds(text: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 600:
        raise _fail(text, f"timeout={value!r} is not a number of seconds in (0, 600]")
    return seconds
