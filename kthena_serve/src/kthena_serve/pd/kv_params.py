"""``kv_transfer_params``: the field the Kthena router's ``nixl`` / ``mooncake`` connectors add.

The router (kthena-router ``connectors/nixl.go``, ``transport.go``) proxies one client request
as two plain OpenAI calls::

    1 POST prefill/<path>  the body without stream / stream_options, max_tokens = 1
                           (max_completion_tokens = 1 if present) and
                           "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}
      ◀── the normal JSON answer plus "kv_transfer_params": {...}        (``prefill_reply``)
    2 POST decode/<path>   the original body plus that object, unchanged (and include_usage)
      ◀── the answer, streamed if the client asked for a stream

The prefill answer names where the prompt's KV waits, in the field names vLLM's connectors
use (the router only copies the object)::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": "<prefill worker incarnation>", "remote_request_id": "<transfer id>",
     "remote_block_ids": [..], "remote_host": "<prefill host>", "remote_port": <prefill port>,
     "tp_size": <the prefill worker's TP size>}

``tp_size`` is optional in a request; where present it must be the TP size of the worker that
pinned the KV (vLLM's connectors send it too): a prefill request's must be the prefill
worker's own, a decode request's is checked against the prefill worker's answer to the lease.

Everything here is parsing and building that object; it trusts nothing it reads (a decode
request's fields are checked for type and range, unknown fields are refused by name).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kthena_serve.engine.errors import InvalidRequestError

__all__ = ["KVAsk", "RemotePrefill", "check_prefill_tp_size", "parse_kv_params", "prefill_reply",
           "prompt_digest"]

PARAM = "kv_transfer_params"
MAX_BLOCK_IDS = 1 << 16  # more blocks than any context this server takes
MAX_TP_SIZE = 1024  # more ranks than one host runs
_MAX_TEXT = 256
_REMOTE = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
           "remote_port")
_KNOWN = frozenset(("do_remote_decode", "do_remote_prefill", "tp_size", *_REMOTE))


class KVAsk(str, enum.Enum):
    """What a request's ``kv_transfer_params`` asks of this worker."""

    NONE = "none"  # both flags false: a plain request
    REMOTE_DECODE = "remote_decode"  # prefill here, keep the KV for a decode worker to pull
    REMOTE_PREFILL = "remote_prefill"  # decode here, pull the prompt's KV from a prefill worker


@attrs.frozen
class RemotePrefill:
    """Where a decode request's prompt KV waits (parsed ``kv_transfer_params``)."""

    engine_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    tp_size: int | None = None  # the prefill worker's TP size, if the params say it

    @property
    def url(self) -> str:
        """The prefill worker's base URL (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{PARAM}: {message}", PARAM)


def _flag(data: Mapping[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _refuse(f"{name} must be true or false, got {value!r}")
    return value


def _text(data: Mapping[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT:
        raise _refuse(f"{name} must be a non-empty string of at most {_MAX_TEXT} characters "
                      "(copy it from the prefill worker's answer)")
    return value


def _block_ids(value: Any) -> tuple[int, ...]:
    """Ints, or decimal strings (types.go declares ``[]string``; vLLM sends ints)."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_BLOCK_IDS:
        raise _refuse(f"remote_block_ids must be a list of 1 to {MAX_BLOCK_IDS} block ids")
    ids = []
    for item in value:
        if isinstance(item, str) and item.isascii() and item.isdigit() and len(item) < 19:
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < 1 << 62:
            raise _refuse(f"remote_block_ids holds {item!r}; block ids are ints >= 0")
        ids.append(item)
    return tuple(ids)


def parse_kv_params(data: Mapping[str, Any]) -> tuple[KVAsk, RemotePrefill | None]:
    """Read a request's ``kv_transfer_params``.

    Returns:
        (what it asks, where the KV is for ``REMOTE_PREFILL``, else None).

    Raises:
        InvalidRequestError: unknown fields, wrong types, both flags set, ``remote_*`` fields
            on a prefill request, or missing ones on a decode request.
    """
    unknown = sorted(set(data) - _KNOWN)
    if unknown:
        raise _refuse(f"unknown field(s) {', '.join(unknown)}; this worker reads "
                      f"{', '.join(sorted(_KNOWN))}")
    tp_size = _tp_size(data)
    remote_decode, remote_prefill = _flag(data, "do_remote_decode"), _flag(data,
                                                                          "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise _refuse("do_remote_decode and do_remote_prefill cannot both be true")
    if not remote_prefill:
        present = [name for name in _REMOTE if data.get(name) is not None]
        if present:
            raise _refuse(f"{', '.join(present)} belong to a decode request "
                          "(do_remote_prefill: true)")
        return (KVAsk.REMOTE_DECODE if remote_decode else KVAsk.NONE), None
    port = data.get("remote_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise _refuse(f"remote_port must be an int in 1..65535, got {port!r}")
    remote = RemotePrefill(_text(data, "remote_engine_id"), _text(data, "remote_request_id"),
                           _block_ids(data.get("remote_block_ids")),
                           _text(data, "remote_host"), port, tp_size)
    return KVAsk.REMOTE_PREFILL, remote


def _tp_size(data: Mapping[str, Any]) -> int | None:
    """A request's ``tp_size``: None when absent, else a TP size (an int in 1..MAX_TP_SIZE)."""
    value = data.get("tp_size")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_TP_SIZE:
        raise _refuse(f"tp_size={value!r}: a TP size is an int in 1..{MAX_TP_SIZE}, the "
                      "prefill worker's own (copy it from its answer, or leave it out)")
    return value


def check_prefill_tp_size(data: Mapping[str, Any], tp: int) -> None:
    """A prefill request's ``tp_size``, if it has one, must be this prefill worker's ``tp``.

    Raises:
        InvalidRequestError: another size (or not a size).
    """
    asked = _tp_size(data)
    if asked is not None and asked != tp:
        raise _refuse(f"tp_size={asked}, but this prefill worker is a TP{tp} engine; send "
                      f"tp_size {tp} or leave it out (the answer carries it)")


def prefill_reply(engine_id: str, transfer_id: str, block_ids: Sequence[int], host: str,
                  port: int, tp_size: int = 1) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill answer carries (what the decode request sends)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": engine_id, "remote_request_id": transfer_id,
            "remote_block_ids": list(block_ids), "remote_host": host, "remote_port": port,
            "tp_size": tp_size}


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of the prompt ids: the decode side proves it asks for the KV of the same prompt
    without sending the prompt to the prefill worker again."""
    digest = hashlib.sha256()
    digest.update(len(token_ids).to_bytes(8, "little"))
    for token in token_ids:
        digest.update(int(token).to_bytes(8, "little", signed=True))
    return digest.hexdigest()
