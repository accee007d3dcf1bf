"""The OpenAI-compatible HTTP app over an ``EngineClient`` (FastAPI): ``build_app`` mounts the
route bodies (routes.py), /plan, /health, /metrics and the middleware stack.

    POST /v1/completions, /v1/chat/completions   (SSE when ``stream``; ends with [DONE])
    GET  /v1/models, /health, /metrics           (/metrics: kthena_* and vLLM's vllm:* names;
                                                  open with public_metrics, like /health)
    GET  /plan                                   the layout served and the plan it came from
                                                  (``kthena plan --config``'s JSON), also the
                                                  labels of kthena_deployment_info in /metrics
    POST /tokenize, /detokenize                  (vLLM's; see ``tokenization``)

Requests are validated, tokenised and length-checked before anything streams, so every bad
input is a 4xx with an OpenAI error body. A streamed answer's headers go out with its first
output, so what fails while it waits (a refusal at its queue deadline, admission.py) is a
status too. ``prefix_hash`` / ``reuse_offset`` are accepted and
only compared with what token matching found (a metric); ``cache_salt`` keys the prefix cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kthena_serve.client import EngineClient, KVConnector
from kthena_serve.server.errors import error_body, install_handlers
from kthena_serve.server.metrics import ServerMetrics
from kthena_serve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, public_paths
from kthena_serve.server.routes import OpenAIRoutes
from kthena_serve.server.shutdown import Drain, DrainMiddleware

__all__ = ["build_app"]


class DeploymentLabels(Protocol):
    """Metrics that label ``kthena_deployment_info`` with the layout served."""

    def set_deployment(self, served: Mapping[str, object]) -> None: ...


def add_plan_route(app: FastAPI, metrics: DeploymentLabels,
                   deployment: Mapping[str, Any] | None) -> None:
    """GET /plan answers ``deployment`` (see `build_app`); its ``served`` layout also labels
    ``kthena_deployment_info`` in ``metrics`` (anything with ``set_deployment``)."""
    report = dict(deployment or {"served": None, "plan": None, "config": None})
    if report["served"] is not None:
        metrics.set_deployment(report["served"])

    @app.get("/plan")
    async def plan() -> Response:
        return JSONResponse(report)


def _print_line(line: str) -> None:
    print(f"kthena serve: {line}", flush=True)


def build_app(engine: EngineClient, *, model_name: str, aliases: set[str] | None = None,
              api_key: str | None = None, max_request_bytes: int = 1 << 20,
              kv_connector: KVConnector | None = None, metrics: ServerMetrics | None = None,
              public_metrics: bool = False, deployment: Mapping[str, Any] | None = None,
              log_requests: bool = False, tool_call_parser: str = "hermes",
              disable_any_whitespace: bool = True) -> FastAPI:
    """The HTTP app over a started ``EngineClient`` (``AsyncLLM`` or the PD ``RemoteEngine``).

    Args:
        model_name: the id clients send as ``model`` and /v1/models lists.
        aliases: other accepted ``model`` values (e.g. ``"default"``).
        api_key: if set, every path but /health needs ``Authorization: Bearer <api_key>``.
        max_request_bytes: bodies above this get 413.
        kv_connector: a PD worker's side of ``kv_transfer_params`` (without one, a request that
            carries them is a 400).
        metrics: where requests are observed (default: a new ``ServerMetrics``); a PD worker
            passes the one its control app's /metrics renders.
        public_metrics: /metrics needs no API key (``--public-metrics``: Prometheus and the
            Kthena router scrape without credentials).
        deployment: what GET /plan answers: ``{"served": {tp, pp, dp, sp, mode}, "plan": the
            planner's JSON or None, "config": the config file or None}`` (see
            ``ServeSpec.report``); ``served`` also labels
            ``kthena_deployment_info``. None: not known here (``served`` is null).
        tool_call_parser: the format chat output is parsed for tool calls in
            (``--tool-call-parser``; server/tool_parsers/).
        disable_any_whitespace: what a JSON constraint that does not say gets
            (``--structured-outputs-config``; True: compact JSON).

    Raises:
        ValueError: ``metrics`` was made for another served model name.
    """
    if metrics is not None and metrics.model_name != model_name:
        raise ValueError(f"metrics label their series model_name={metrics.model_name!r}, but "
                         f"this app serves {model_name!r}: make ServerMetrics(engine, "
                         f"{model_name!r})")
    api = OpenAIRoutes(engine, model_name, aliases or set(), kv_connector, metrics,
                       tool_call_parser=tool_call_parser,
                       disable_any_whitespace=disable_any_whitespace)
    if log_requests:  # --enable-log-requests: a line per request received and finished
        api.log = api.metrics.request_log = _print_line
    from kthena_serve import __version__

    app = FastAPI(title="kthena serve", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")  # the real schema, for clients and fuzzers
    app.state.api = api
    install_handlers(app)
    _add_routes(app, api, deployment, __version__)
    add_api_middleware(app, api_key=api_key, public_metrics=public_metrics,
                       max_request_bytes=max_request_bytes)
    return app


def _add_routes(app: FastAPI, api: OpenAIRoutes, deployment: Mapping[str, Any] | None,
                version_: str) -> None:
    """Mount the OpenAI routes, /plan, vLLM's tokenizer routes, /version, /health, /metrics."""
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    app.get("/v1/models")(api.models)
    add_plan_route(app, api.metrics, deployment)

    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": version_})

    @app.get("/health")
    async def health() -> Response:
        if not api.engine.is_alive:
            return JSONResponse(error_body(503, "engine is not running"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def add_api_middleware(app: FastAPI, *, api_key: str | None, public_metrics: bool,
                       max_request_bytes: int) -> None:
    """The middleware stack of a public OpenAI app (``kthena serve``'s, the DP router's), inner
    to outer: body limit (413), API key (401; /health and, with ``public_metrics``, /metrics
    open), drain (503 while shutting down: a draining server refuses before anything else)."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key,
                           open_paths=public_paths(public_metrics=public_metrics))
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
