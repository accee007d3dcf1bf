"""What the HTTP apps of both PD workers share (decode_server.py, prefill_server.py; worker.py
lists the routes).

One port, two apps (``OnePort``)::

    /v1/*, /tokenize, /detokenize   the OpenAI app (server.build_app), as the Kthena router
                                    calls it: the API key if the worker has one (--api-key /
                                    KTHENA_API_KEY), and kv_transfer_params (prefill_connector.py,
                                    decode_connector.py)
    everything else                 the control app: /pd/* need the deployment secret
                                    (cluster/auth.py), /health is open, /metrics needs the secret
                                    unless the worker runs with --public-metrics

Both apps share one ``ServerMetrics`` (labelled with the served model name), so /metrics
carries vLLM's ``vllm:*`` names the Kthena router scrapes, the ``kthena_*`` twins and the
``kthena_pd_*`` families, each once, and a request is observed once on whichever path it took
(the OpenAI routes, or the PD router's /pd/generate).

A decode worker sends a prefill task, or a KV lease, only to a host in its allow-list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kthena_serve.engine.config import EngineConfig
from kthena_serve.server.errors import error_body
from kthena_serve.server.metrics import ServerMetrics
from kthena_serve.server.middleware import ApiKeyMiddleware, public_paths

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from kthena_serve.client import EngineClient, KVConnector
    from kthena_serve.kv_events import KVEventSource, RedisKVPublisher
    from kthena_serve.kv_events.config import KVEventsConfig

__all__ = ["Closer", "OnePort", "common_routes", "control_app", "openai_app", "served_name",
           "start_kv_events"]

Closer = Callable[[], None]


def control_app(secret: str, public_metrics: bool,
                signed_paths: frozenset[str] = frozenset()) -> FastAPI:
    """A bare app whose every route but /health (and /metrics, if ``public_metrics``) needs
    ``Authorization: Bearer <secret>``; ``signed_paths`` also take a request signed with it
    (what decode workers send: cluster/auth.py)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ApiKeyMiddleware, api_key=secret,
                       open_paths=public_paths(public_metrics=public_metrics),
                       signed_paths=signed_paths)
    return app


_OPENAI_PATHS = frozenset({"/tokenize", "/detokenize"})


class OnePort:
    """ASGI app that serves the OpenAI routes from one app and the rest from the control app."""

    def __init__(self, control: FastAPI, openai: FastAPI) -> None:
        self.control, self.openai = control, openai
        self.state = control.state  # what the server reads (no drain: workers stop at once)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        is_openai = path.startswith("/v1/") or path in _OPENAI_PATHS
        await (self.openai if is_openai else self.control)(scope, receive, send)


def served_name(config: EngineConfig, served_model_name: str | None) -> str:
    from kthena_serve.model.source import served_name as model_served_name

    return served_model_name or model_served_name(config.model)


def openai_app(engine: EngineClient, config: EngineConfig, connector: KVConnector,
                api_key: str | None, metrics: ServerMetrics) -> FastAPI:
    """The plain OpenAI app over a worker's engine, with its KV connector, observing into the
    worker's one ``metrics`` (its /metrics is the control app's)."""
    from kthena_serve.server import build_app

    served = metrics.model_name
    assert served is not None, "worker metrics carry the served model name"
    return build_app(engine, model_name=served, aliases={config.model, "default"} - {served},
                     api_key=api_key, kv_connector=connector, metrics=metrics)


def start_kv_events(name: str, config: KVEventsConfig | None, source: KVEventSource,
                    metrics: ServerMetrics) -> RedisKVPublisher | None:
    """The worker's KV-event publisher over ``source`` (its KV manager), under the worker's
    own owner name (``config.pod``), its counters on the worker's /metrics; None if off."""
    if config is None:
        return None
    import sys

    from kthena_serve.kv_events import KVEventsCollector, RedisKVPublisher
    from kthena_serve.kv_events.config import redacted_url

    publisher = RedisKVPublisher(config, source).start()
    metrics.registry.register(KVEventsCollector(publisher))
    print(f"pd worker {name}: KV events to {redacted_url(config.redis_url)} as {config.pod} "
          f"(model {config.model!r}, {config.chunk_size}-token chunks)", file=sys.stderr,
          flush=True)
    return publisher


def common_routes(app: FastAPI, metrics_render: Callable[[], bytes],
                   is_alive: Callable[[], bool]) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not is_alive():
            return JSONResponse(error_body(503, "engine is not running"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_render(), media_type=CONTENT_TYPE_LATEST)
