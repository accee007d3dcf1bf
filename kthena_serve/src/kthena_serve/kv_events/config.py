"""KVEventsConfig: where and as whom a server announces its cached chunks, validated once.

``redis_url`` is ``redis://HOST:PORT`` (optionally ``redis://[user:password@]HOST:PORT/DB``);
``pod`` is the owner name the router compares with ``{pod name}.{namespace}`` of each
candidate pod; ``model`` is the model id the router puts into its keys (the id clients send).
"""

from __future__ import annotations

import re

import attrs

from kthena_core.redis_url import redacted_url, redis_url_problem
from kthena_serve.kv_events.router_hash import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_CHUNKS,
    FIELD_FRESH_SECONDS,
)

__all__ = ["KVEventsConfig", "KVEventsConfigError", "redacted_url"]

# Kubernetes: a pod name is a DNS-1123 subdomain (dots allowed), a namespace a DNS-1123 label.
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_POD_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_NAMESPACE = re.compile(_LABEL)


class KVEventsConfigError(ValueError):
    """A ``KVEventsConfig`` field holds a value that cannot work.

    Attributes:
        field: the field's name (the CLI turns it into its flag).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"KVEventsConfig.{field}: {message}")
        self.field = field


def _redis_url(instance: object, attribute: attrs.Attribute, value: str) -> None:
    problem = redis_url_problem(value)
    if problem is not None:
        raise KVEventsConfigError(attribute.name, problem)


def _pod(instance: object, attribute: attrs.Attribute, value: str) -> None:
    name, _, namespace = value.rpartition(".") if isinstance(value, str) else ("", "", "")
    if (not name or len(name) > 253 or not _POD_NAME.fullmatch(name)
            or len(namespace) > 63 or not _NAMESPACE.fullmatch(namespace)):
        raise KVEventsConfigError(
            attribute.name, f"{value!r} is not NAME.NAMESPACE: the router names an owner "
            "'{pod name}.{namespace}' (lowercase letters, digits, '-'; the pod name may hold "
            "dots, the namespace may not); in a pod spec pass "
            "--pod-name $(POD_NAME).$(POD_NAMESPACE) from the downward API")


def _model(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise KVEventsConfigError(attribute.name, f"must be the served model id, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise KVEventsConfigError(attribute.name, f"must be a positive number, got {value!r}")


def _refresh(instance: object, attribute: attrs.Attribute, value: float) -> None:
    _positive(instance, attribute, value)
    if value >= FIELD_FRESH_SECONDS:
        raise KVEventsConfigError(attribute.name, f"must be below {FIELD_FRESH_SECONDS} s, the "
                                  f"age at which the router drops a field (got {value!r})")


@attrs.frozen
class KVEventsConfig:
    """Publishing of the KV cache's router chunks to Redis (``kthena serve --kv-events``).

    Attributes:
        redis_url: the Redis the router reads (``redis://HOST:PORT``).
        pod: this server's owner name, ``NAME.NAMESPACE``.
        model: the model id in the keys (the one clients send).
        chunk_size: tokens per router chunk (the plugin's ``blockSizeToHash``).
        max_chunks: leading chunks the router looks at (``maxBlocksToMatch``).
        queue_size: KV events buffered between the engine and the publisher thread; more
            are dropped and counted, never waited for.
        socket_timeout_s: connect and reply timeout of one Redis round trip.
        max_backoff_s: longest wait between reconnect attempts (doubling from 0.1 s).
        refresh_s: how often held fields are written again with a fresh timestamp (the
            router's GC drops fields older than 24 h).
        batch_size: Redis commands per pipelined round trip.
    """

    redis_url: str = attrs.field(validator=_redis_url)
    pod: str = attrs.field(validator=_pod)
    model: str = attrs.field(validator=_model)
    chunk_size: int = attrs.field(default=DEFAULT_CHUNK_SIZE, validator=_positive)
    max_chunks: int = attrs.field(default=DEFAULT_MAX_CHUNKS, validator=_positive)
    queue_size: int = attrs.field(default=65536, validator=_positive)
    socket_timeout_s: float = attrs.field(default=2.0, validator=_positive)
    max_backoff_s: float = attrs.field(default=5.0, validator=_positive)
    refresh_s: float = attrs.field(default=3600.0, validator=_refresh)
    batch_size: int = attrs.field(default=1000, validator=_positive)

    def for_worker(self, worker: str) -> KVEventsConfig:
        """This config for one of several workers behind one ``--pod-name`` (the workers of
        ``kthena serve --mode pd``): owner ``NAME-WORKER.NAMESPACE``, so that each worker
        announces its own blocks (``kthena-0.default`` -> ``kthena-0-decode-1.default``).

        Raises:
            KVEventsConfigError: the owner name that gives is not NAME.NAMESPACE (too long,
                or ``worker`` is not a DNS label).
        """
        name, _, namespace = self.pod.rpartition(".")
        return attrs.evolve(self, pod=f"{name}-{worker}.{namespace}")

    @chunk_size.validator
    @max_chunks.validator
    @queue_size.validator
    @batch_size.validator
    def _is_int(self, attribute: attrs.Attribute, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise KVEventsConfigError(attribute.name, f"must be an int, got {value!r}")
