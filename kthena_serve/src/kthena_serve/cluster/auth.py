"""Who may call a worker of a deployment, and where a PD decode worker may send a prefill task.

* **The deployment secret.** The launcher (``ProcessLauncher``, cluster/launcher.py) draws one
  per deployment (``new_secret``) and hands it to each worker, PD worker or DP replica, in the
  environment variable ``KTHENA_PD_SECRET`` (``take_secret`` in cluster/worker.py reads it),
  never on the command line (``/proc/PID/cmdline`` is readable by every local user,
  ``/proc/PID/environ`` only by the same user). Every worker route but ``/health`` needs
  ``Authorization: Bearer <secret>`` (``server.middleware.ApiKeyMiddleware``); the router sends
  it (``auth_headers``) to the workers it started. A PD decode worker never sends the secret
  itself: the prefill worker it calls is named by a request (the router's ``prefill_url``, or
  a client's ``kv_transfer_params``), so it signs each call instead (``signed_json``: an
  HMAC-SHA256 of method, path, time and body keyed by the secret), which the prefill worker
  accepts on ``DECODE_TO_PREFILL_PATHS``. A host that is named wrongly learns a signature of
  one request, not the secret.
* **The prefill URL** (PD only). The router names the prefill worker in each
  ``/pd/generate`` body. The decode worker sends that URL the secret and block ids, so it only
  accepts ``http://<host>:<port>`` with a host from its allow-list (``check_prefill_url``):
  loopback by default, plus the hosts the launcher placed prefill workers on
  (``--prefill-hosts``; an entry with a ``/`` is a network, e.g. a cluster's pod CIDR). Ports
  are not pinned: a restarted worker may come back on another one. Behind the Kthena router
  the same list bounds the ``remote_host`` a decode request's ``kv_transfer_params`` may name.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

__all__ = ["DECODE_TO_PREFILL_PATHS", "LOOPBACK_HOSTS", "SECRET_ENV", "auth_headers",
           "check_prefill_url", "new_secret", "signed_json"]

DECODE_TO_PREFILL_PATHS = frozenset({"/pd/prefill", "/pd/cancel", "/pd/kv/lease",
                                     "/pd/kv/release", "/pd/kv/backlog"})

SECRET_ENV = "KTHENA_PD_SECRET"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def new_secret() -> str:
    """A fresh deployment secret (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def auth_headers(secret: str | None) -> dict[str, str]:
    """The header that authenticates a call to a worker; none without a secret."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def signed_json(secret: str | None, path: str, payload: Any) -> tuple[bytes, dict[str, str]]:
    """A JSON body for ``POST path`` and its headers: signed with ``secret`` (none without)."""
    # Here, not at the top: the server package loads torch, and a worker reads SECRET_ENV from
    # this module before it pins itself and sets OpenMP's environment (cluster/worker.py).
    from kthena_serve.server.middleware import sign_request

    body = json.dumps(payload, separators=(",", ":")).encode()
    headers = {"content-type": "application/json"}
    if secret:
        headers.update(sign_request(secret, "POST", path, body))
    return body, headers


def check_prefill_url(url: str, allowed_hosts: Iterable[str]) -> None:
    """Accept only ``http://<allowed host>:<port>`` (no path, query, credentials).

    Raises:
        ValueError: the URL has another form or its host is not allowed; the message says which.
    """
    if not isinstance(url, str):
        raise ValueError(f"prefill_url must be a string, got {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise ValueError(f"prefill_url {url!r} is not a valid URL: {error}") from None
    if parts.scheme != "http" or port is None or parts.path not in ("", "/") or parts.query \
            or parts.fragment or parts.username is not None or parts.password is not None:
        raise ValueError(f"prefill_url {url!r} must have the form http://HOST:PORT")
    allowed = {host.lower() for host in allowed_hosts}
    if not _is_allowed(parts.hostname or "", allowed):
        raise ValueError(f"prefill_url host {parts.hostname!r} is not a prefill worker host of "
                         f"this deployment (allowed: {', '.join(sorted(allowed))})")


def _is_allowed(host: str, allowed: set[str]) -> bool:
    """``host`` is listed, or is an IP address inside a listed network (``10.0.0.0/8``)."""
    if host in allowed:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    for entry in allowed:
        if "/" in entry:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:  # not a network: it can only match by name
                continue
    return False
