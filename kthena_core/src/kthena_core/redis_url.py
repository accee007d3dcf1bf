"""A Redis URL as the KV-event publisher takes it (``redis://HOST:PORT[/DB]``), checked once.

``kthena serve --kv-events`` (kthena_serve's ``KVEventsConfig``) and ``kthena deploy k8s``
(deploy.yaml's ``kv_events``) both check with ``redis_url_problem``, so the two accept the
same URLs.
"""

from __future__ import annotations

import re
import urllib.parse

__all__ = ["REDIS_URL_HINT", "redacted_url", "redis_url_problem"]

REDIS_URL_HINT = "write redis://HOST:PORT, e.g. redis://redis.kthena-system:6379"


def redacted_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def redis_url_problem(url: object) -> str | None:
    """What is wrong with ``url`` as ``redis://[user:password@]HOST:PORT[/DB]``, or None.

    The text names the (redacted) URL and what is allowed.
    """
    if not isinstance(url, str):
        return f"{url!r} is not a URL; {REDIS_URL_HINT}"
    shown = redacted_url(url)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return f"cannot read {shown!r}; {REDIS_URL_HINT}"
    if parts.scheme != "redis":
        return f"{shown!r} is not a redis:// URL (rediss:// and others are not taken); " \
               f"{REDIS_URL_HINT}"
    if not parts.hostname or port is None:
        return f"{shown!r} needs a host and a port; {REDIS_URL_HINT}"
    if parts.path not in ("", "/") and not re.fullmatch(r"/\d+", parts.path):
        return f"{shown!r}: the path must be a database number (/0) or empty"
    if parts.query or parts.fragment:
        return f"{shown!r}: options (?...) are not taken"
    return None
