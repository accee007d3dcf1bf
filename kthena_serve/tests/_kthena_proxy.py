"""The Kthena router's ``nixl`` / ``mooncake`` connector request sequence, in Python.

What kthena-router (``pkg/kthena-router/connectors/nixl.go``, ``transport.go``) sends to a
prefill and a decode pod for one client request, for tests and for trying PD workers without
a cluster. It builds the same bodies::

    prefill: body - stream - stream_options, max_tokens = 1 (max_completion_tokens = 1 if
             set), kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false}
    decode:  body + stream_options.include_usage (stream) or include_usage (no stream)
                  + kv_transfer_params = the prefill answer's, unchanged (null if it had none)

and, like the router, fails if the prefill answer is not 2xx. Headers (the API key) go to
both, as the router clones the client's request.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import attrs
import httpx

__all__ = ["PDExchange", "decode_body", "prefill_body", "proxy"]


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """``preparePrefillBody`` plus the connector's ``kv_transfer_params``."""
    out = dict(body)
    out.pop("stream", None)
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if out.get("max_completion_tokens") is not None:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def decode_body(body: Mapping[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """``AddTokenUsage`` on the original body, plus the prefill answer's params."""
    out = dict(body)
    if out.get("stream") is True:
        options = out.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            out["stream_options"] = {"include_usage": True}
    else:
        out["include_usage"] = True
    out["kv_transfer_params"] = copy.deepcopy(kv_transfer_params)
    return out


@attrs.frozen
class PDExchange:
    """The two calls of one proxied request."""

    prefill: httpx.Response
    decode: httpx.Response | None  # None when the prefill failed (the router stops there)

    @property
    def kv_transfer_params(self) -> Any:
        return self.prefill.json().get("kv_transfer_params")


def proxy(client: httpx.Client, path: str, body: Mapping[str, Any], prefill_url: str,
          decode_url: str, *, headers: Mapping[str, str] | None = None) -> PDExchange:
    """POST ``body`` to ``path`` as the router's connector does: prefill, then decode.

    Args:
        client: the HTTP client (its timeout applies to both calls).
        path: ``/v1/completions`` or ``/v1/chat/completions``.
        prefill_url, decode_url: the pods' base URLs (``http://host:port``).
        headers: what the client sent (e.g. ``Authorization``), passed to both.
    """
    headers = dict(headers or {})
    reply = client.post(f"{prefill_url}{path}", json=prefill_body(body), headers=headers)
    if not 200 <= reply.status_code < 300:
        return PDExchange(reply, None)
    params = reply.json().get("kv_transfer_params")
    decoded = client.post(f"{decode_url}{path}", json=decode_body(body, params),
                          headers=headers)
    return PDExchange(reply, decoded)
