"""The HTTP apps of PD workers (decode and prefill); see worker.py for the routes.

One port, two apps (``_OnePort``)::

    /v1/*, /tokenize, /detokenize   the OpenAI app (server.build_app), as the Kthena router
                                    calls it: the API key if the worker has one (--api-key /
                                    KTHENA_API_KEY), and kv_transfer_params (prefill_api.py,
                                    decode_api.py)
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

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Iterable

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kthena_serve.cluster.auth import DECODE_TO_PREFILL_PATHS, LOOPBACK_HOSTS, check_prefill_url
from kthena_serve.cluster.events import EventLog
from kthena_serve.cluster.worker import new_incarnation, state_reply
from kthena_serve.config import EngineConfig
from kthena_serve.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from kthena_serve.pd.config import KVPush, PDConfig, Transport
from kthena_serve.pd.decode import HandoffError
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.pd.protocol import PoolRef, PrefillTask, output_to_json, params_from_json
from kthena_serve.server.errors import error_body
from kthena_serve.server.metrics import ServerMetrics
from kthena_serve.server.middleware import ApiKeyMiddleware, public_paths

__all__ = ["build_decode_app", "build_prefill_app"]

Closer = Callable[[], None]

log = logging.getLogger(__name__)


def _control_app(secret: str, public_metrics: bool, signed_paths: frozenset[str] = frozenset(),
                 ) -> FastAPI:
    """A bare app whose every route but /health (and /metrics, if ``public_metrics``) needs
    ``Authorization: Bearer <secret>``; ``signed_paths`` also take a request signed with it
    (what decode workers send: cluster/auth.py)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ApiKeyMiddleware, api_key=secret,
                       open_paths=public_paths(public_metrics=public_metrics),
                       signed_paths=signed_paths)
    return app


_OPENAI_PATHS = frozenset({"/tokenize", "/detokenize"})


class _OnePort:
    """ASGI app that serves the OpenAI routes from one app and the rest from the control app."""

    def __init__(self, control: FastAPI, openai: FastAPI) -> None:
        self.control, self.openai = control, openai
        self.state = control.state  # what the server reads (no drain: workers stop at once)

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        path = scope.get("path", "") if scope["type"] == "http" else ""
        is_openai = path.startswith("/v1/") or path in _OPENAI_PATHS
        await (self.openai if is_openai else self.control)(scope, receive, send)


def _served_name(config: EngineConfig, served_model_name: str | None) -> str:
    from kthena_serve.spec import model_name

    return served_model_name or model_name(config.model)


def _openai_app(engine, config: EngineConfig, connector, api_key: str | None,  # noqa: ANN001
                metrics: ServerMetrics) -> FastAPI:
    """The plain OpenAI app over a worker's engine, with its KV connector, observing into the
    worker's one ``metrics`` (its /metrics is the control app's)."""
    from kthena_serve.server import build_app

    served = metrics.model_name
    assert served is not None, "worker metrics carry the served model name"
    return build_app(engine, model_name=served, aliases={config.model, "default"} - {served},
                     api_key=api_key, kv_connector=connector, metrics=metrics)


def _common_routes(app: FastAPI, metrics_render: Callable[[], bytes],
                   is_alive: Callable[[], bool]) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not is_alive():
            return JSONResponse(error_body(503, "engine is not running"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_render(), media_type=CONTENT_TYPE_LATEST)


# ---- decode -----------------------------------------------------------------------------------
def build_decode_app(name: str, config: EngineConfig, pd: PDConfig, *, secret: str,
                     mooncake_host: str | None = None,
                     prefill_hosts: Iterable[str] = LOOPBACK_HOSTS, api_key: str | None = None,
                     served_model_name: str | None = None,
                     public_metrics: bool = False) -> tuple[_OnePort, Closer]:
    """The decode worker: engine over a shared pool, /pd/generate, /pd/state, and the OpenAI
    routes (decode requests from the Kthena router pull their KV: decode_api.py).

    Args:
        secret: the deployment secret its callers must send and it sends to prefill workers.
        prefill_hosts: hosts or networks a ``prefill_url`` or ``remote_host`` may name (the
            rest: 400).
        api_key: what the OpenAI routes require (None: nothing).
        served_model_name: the ``model`` the OpenAI routes serve and the metrics' model_name
            (default: from the model).
        public_metrics: /metrics needs no secret (the Kthena router scrapes without one).
    """
    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.engine import LLMEngine, build_runner
    from kthena_serve.pd.decode import DecodeService, prefill_client
    from kthena_serve.pd.decode_api import DecodeConnector
    from kthena_serve.pd.transfer import BlockGetter, register_pool, shm_engine

    runner, tokenizer = build_runner(config, shared_pool=True)
    pool = runner.pool
    engine = LLMEngine(config, runner, tokenizer)
    handle = None  # the pool as prefill workers put into it (mooncake)
    if pd.transport is Transport.MOONCAKE:
        pull_engine, handle = register_pool(pool, mooncake_host or "127.0.0.1",
                                            pd.transfer_timeout_s)
        pull_handle = handle
    else:  # the shm engine only reads other pools into this one: private registration
        pull_engine = shm_engine(pd.transfer_timeout_s)
        pull_handle = pull_engine.register(pool.buffer)
    ref = PoolRef(pool.layout.num_blocks, config.block_size, config.dtype, pool.name,
                  handle.to_json() if handle is not None else None, config.kv_cache_dtype)
    events = EventLog(engine.kv)
    async_engine = AsyncLLM(engine).start()
    metrics = PDMetrics("decode")
    server_metrics = ServerMetrics(async_engine, _served_name(config, served_model_name))
    client = prefill_client()  # one for every call to prefill workers (see prefill_client)
    service = DecodeService(async_engine, ref, pd, metrics, secret=secret, client=client)
    allowed_hosts = frozenset(prefill_hosts)
    connector = DecodeConnector(
        async_engine, BlockGetter(pull_engine, pull_handle, pool.layout, pd.transfer_timeout_s),
        pd, metrics, secret=secret, prefill_hosts=allowed_hosts, client=client)
    incarnation = new_incarnation()
    app = _control_app(secret, public_metrics)
    _common_routes(app, lambda: server_metrics.render() + metrics.render(),
                   lambda: async_engine.is_alive)

    @app.get("/pd/state")
    async def state(since: int = 0) -> dict:
        return state_reply(name, "decode", incarnation, alive=async_engine.is_alive,
                           stats=async_engine.stats(), events=events, since=since,
                           limits=async_engine.processor.limits, pool=attrs.asdict(ref),
                           num_quarantined=service.num_quarantined + connector.num_quarantined)

    @app.post("/pd/generate")
    async def generate(request: Request) -> Response:
        try:  # this worker's edge: the router's request is validated once, here
            body = await request.json()
            rid = body["request_id"]
            prefill_url = body.get("prefill_url")
            if prefill_url is not None:
                check_prefill_url(prefill_url, allowed_hosts)
            engine_request = async_engine.make_request(
                rid, list(body["prompt_ids"]), params_from_json(body["params"]),
                cache_salt=body.get("cache_salt"))
        except InvalidRequestError as error:
            return JSONResponse(error_body(400, str(error), error.param), status_code=400)
        except (TypeError, ValueError, KeyError) as error:
            return JSONResponse(error_body(400, f"bad generate request: {error}"),
                                status_code=400)
        stream = service.generate(engine_request, prefill_url)
        return StreamingResponse(_ndjson(rid, stream, server_metrics),
                                 media_type="application/x-ndjson")

    def close() -> None:
        async_engine.shutdown()  # closes the engine and with it the shared pool (unlinked)
        pull_engine.close()

    openai = _openai_app(async_engine, config, connector, api_key, server_metrics)
    return _OnePort(app, openai), close


async def _ndjson(rid: str, stream, server_metrics: ServerMetrics):  # noqa: ANN001, ANN202
    """The router's stream of one request; its end is observed once, as the OpenAI app does
    (finished, or aborted: client gone, error, shutdown)."""
    finished = False
    try:
        async for out in stream:
            if out.finished:
                finished = True
                server_metrics.observe(out)
            data = output_to_json(out)
            data["request_id"] = rid
            yield json.dumps({"output": data}) + "\n"
    except EngineDeadError as error:
        # `code` lets the front end tell a failed KV handoff (the prefill side) from the rest.
        code = "kv_handoff_failed" if isinstance(error, HandoffError) else "engine_dead"
        yield json.dumps({"error": {"status": 503, "code": code, "message": str(error)}}) + "\n"
    except RequestFailedError as error:  # the engine failed on this request alone
        yield json.dumps({"error": {"status": 500, "code": "request_failed",
                                    "message": str(error)}}) + "\n"
    except Exception:  # noqa: BLE001 - reported in-band, headers are gone; details to the log
        log.exception("stream of %s failed", rid)
        yield json.dumps({"error": {"status": 500, "code": "internal",
                                    "message": "internal error while streaming; retry the "
                                               "request"}}) + "\n"
    finally:
        if not finished:
            server_metrics.observe_aborted()
        await stream.aclose()


# ---- prefill ----------------------------------------------------------------------------------
def build_prefill_app(name: str, config: EngineConfig, pd: PDConfig, *, secret: str,
                      mooncake_host: str | None = None, advertise_host: str = "127.0.0.1",
                      api_key: str | None = None, served_model_name: str | None = None,
                      public_metrics: bool = False) -> tuple[_OnePort, Closer]:
    """The prefill worker: model + executor on one compute thread, /pd/prefill, /pd/cancel,
    and the OpenAI routes with pinned prefills a decode worker pulls (/pd/kv/lease, release).

    Its own pool (the mooncake transport's, and the Kthena router's prefills) is served to
    decode workers: registered with Mooncake, or in a shm segment the host's processes map.

    Args:
        secret: the deployment secret its callers (decode workers, the router) must send.
        advertise_host: the address decode workers reach it at (``remote_host``); the port is
            set once the server listens (``state.on_port``).
        api_key: what the OpenAI routes require (None: nothing).
        served_model_name: the ``model`` the OpenAI routes serve and the metrics' model_name
            (default: from the model).
        public_metrics: /metrics needs no secret (the Kthena router scrapes without one).
    """
    from kthena_serve.model import load_model
    from kthena_serve.pd.pins import PinTable
    from kthena_serve.pd.prefill import PrefillCancelled
    from kthena_serve.pd.prefill_api import PrefillConnector, PrefillEngine
    from kthena_serve.threads import configure_threads

    configure_threads(config.num_threads)
    model, tokenizer = load_model(config.model, dtype=config.torch_dtype,
                                  quantization=config.quantization)
    metrics = PDMetrics("prefill")
    executor, putter, kv_engine, kv_handle = _own_pool(model, config, pd, mooncake_host,
                                                       metrics.observe_batch)
    events = EventLog(executor.kv) if putter is not None else None  # shm: not for /pd/prefill

    def free(pin) -> None:  # noqa: ANN001 - on the compute thread, the KV manager's owner
        future = executor.call(executor.free, pin.request_id)
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.error(
            "freeing the pinned blocks of %s failed: %r", pin.request_id, f.exception()))

    pins = PinTable(pd.kv_pin_timeout_s, pd.transfer_timeout_s, free)
    sweeper = _Sweeper(pins, max(0.02, min(0.2, pd.kv_pin_timeout_s / 4)))
    engine = PrefillEngine(executor, tokenizer, config, pins)
    incarnation = new_incarnation()
    connector = PrefillConnector(engine, f"{name}-{incarnation}", advertise_host)
    stats = engine  # its stats count the /pd/prefill tasks too: one executor runs both
    server_metrics = ServerMetrics(stats, _served_name(config, served_model_name))
    app = _control_app(secret, public_metrics, signed_paths=DECODE_TO_PREFILL_PATHS)
    app.state.on_port = connector.set_port
    _common_routes(app, lambda: server_metrics.render() + metrics.render(), lambda: True)

    def submit(task: PrefillTask):  # noqa: ANN202 - a future of the PrefillResult
        if putter is None:
            return executor.submit_shared(task)
        layout = executor.layout_for(task.pool.num_blocks, task.pool.block_size,
                                     task.pool.dtype, task.pool.kv_cache_dtype)
        return executor.submit_local(task, putter.session(
            task.pool.mooncake_handle, layout, layerwise=pd.kv_push is KVPush.LAYERWISE))

    @app.post("/pd/prefill")
    async def prefill(request: Request) -> Response:
        try:
            task = PrefillTask.from_json(await request.json())
            future = submit(task)  # batched with the others' prefills (prefill.py)
        except (TypeError, ValueError, KeyError) as error:
            return JSONResponse(error_body(400, f"bad prefill task: {error}"), status_code=400)
        except Exception as error:  # noqa: BLE001 - the decode side applies its policy
            return JSONResponse(error_body(503, f"prefill failed: {type(error).__name__}: "
                                           f"{error}"), status_code=503)
        try:
            result = await asyncio.wrap_future(future)
        except PrefillCancelled:
            return JSONResponse(error_body(409, "cancelled"), status_code=409)
        except Exception as error:  # noqa: BLE001 - the decode side applies its policy
            return JSONResponse(error_body(503, f"prefill failed: {type(error).__name__}: "
                                           f"{error}"), status_code=503)
        metrics.prefill.labels("prefill").observe(result.compute_s)
        metrics.observe_handoff(result.handoff_s, result.handoff_bytes)
        metrics.prefill_cached.labels("prefill").inc(result.num_prefill_cached_tokens)
        return JSONResponse(result.to_json())

    @app.post("/pd/cancel")
    async def cancel(request: Request) -> dict:
        rid = (await request.json())["request_id"]
        return {"busy": executor.cancel(rid)}

    _kv_routes(app, connector, pins, kv_engine.backend, kv_handle, executor.pool.layout)

    @app.get("/pd/state")
    async def pd_state(since: int = 0) -> dict:
        return state_reply(name, "prefill", incarnation, alive=True, stats=stats.stats(),
                           events=events, since=since, num_pinned=len(pins),
                           num_pinned_blocks=pins.num_blocks, num_pins_expired=pins.num_expired)

    def close() -> None:
        engine.abort_all("the prefill worker is stopping")
        sweeper.stop()
        pins.clear()
        executor.close()  # its compute thread, then the own pool: the segment goes with the engine
        kv_engine.close()

    openai = _openai_app(engine, config, connector, api_key, server_metrics)
    return _OnePort(app, openai), close


def _own_pool(model, config: EngineConfig, pd: PDConfig,  # noqa: ANN001, ANN202
              mooncake_host: str | None, on_batch):
    """(executor, putter or None, transfer engine, handle) for the prefill worker's own pool:
    private and registered with Mooncake (mooncake), or in a served shm segment (shm)."""
    from kthena_serve.pd.prefill import PrefillExecutor
    from kthena_serve.pd.transfer import BlockPutter, shm_engine, shm_segment_pool

    if pd.transport is Transport.MOONCAKE:
        executor = PrefillExecutor(model, config, own_pool=True, on_batch=on_batch)
        putter = BlockPutter(executor.pool, mooncake_host or "127.0.0.1", pd.transfer_timeout_s)
        return executor, putter, putter.engine, putter.local
    engine = shm_engine(pd.transfer_timeout_s)
    handles = []

    def in_segment(layout):  # noqa: ANN001, ANN202
        pool, handle = shm_segment_pool(engine, layout)
        handles.append(handle)
        return pool

    executor = PrefillExecutor(model, config, own_pool=in_segment, on_batch=on_batch)
    return executor, None, engine, handles[0]


class _Sweeper:
    """Frees expired pins every ``interval_s`` (a daemon thread)."""

    def __init__(self, pins, interval_s: float) -> None:  # noqa: ANN001
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pins, interval_s),
                                        name="kthena-pin-sweeper", daemon=True)
        self._thread.start()

    def _run(self, pins, interval_s: float) -> None:  # noqa: ANN001
        while not self._stop.wait(interval_s):
            pins.expire()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _kv_routes(app: FastAPI, connector, pins, backend: str, handle, layout) -> None:  # noqa: ANN001
    """/pd/kv/lease and /pd/kv/release: a decode worker claims pinned blocks, then frees them."""
    from kthena_serve.pd.pins import PinError

    @app.post("/pd/kv/lease")
    async def kv_lease(request: Request) -> Response:
        try:
            body = await request.json()
            engine_id, transfer_id = body["engine_id"], body["transfer_id"]
            block_ids, digest = body["block_ids"], body["prompt_digest"]
            if not all(isinstance(v, str) for v in (engine_id, transfer_id, digest)) \
                    or not isinstance(block_ids, list):
                raise TypeError("engine_id, transfer_id, prompt_digest: strings; block_ids: "
                                "a list")
        except (TypeError, ValueError, KeyError) as error:
            return JSONResponse(error_body(400, f"bad lease: {error}"), status_code=400)
        if engine_id != connector.engine_id:
            return JSONResponse(error_body(404, f"remote_engine_id {engine_id!r} is not this "
                                           f"prefill worker ({connector.engine_id}): the KV "
                                           "was pinned elsewhere, or by a process that has "
                                           "restarted since"), status_code=404)
        if body.get("backend") != backend:
            return JSONResponse(error_body(409, f"this prefill worker serves KV over {backend}"
                                           f", the decode worker pulls over "
                                           f"{body.get('backend')}: use one --pd-transport"),
                                status_code=409)
        try:
            pin = pins.lease(transfer_id, block_ids, digest)
        except PinError as error:
            return JSONResponse(error_body(error.status, str(error)), status_code=error.status)
        return JSONResponse({"handle": handle.to_dict(), "num_blocks": layout.num_blocks,
                             "fingerprint": layout.shape.fingerprint(),
                             "kind": layout.kind.value, "first_token_id": pin.first_token_id,
                             "first_token_logprobs": pin.first_token_logprobs})

    @app.post("/pd/kv/release")
    async def kv_release(request: Request) -> Response:
        try:
            transfer_id = (await request.json())["transfer_id"]
            if not isinstance(transfer_id, str):
                raise TypeError("transfer_id must be a string")
        except (TypeError, ValueError, KeyError) as error:
            return JSONResponse(error_body(400, f"bad release: {error}"), status_code=400)
        return JSONResponse({"released": pins.release(transfer_id)})
