"""The HTTP control apps of PD workers (decode and prefill); see worker.py for the routes.

Every route but ``/health`` needs the deployment secret (pd/auth.py); a decode worker sends a
prefill task only to a URL whose host is in its allow-list.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kthena_serve.client import EngineStats
from kthena_serve.config import EngineConfig
from kthena_serve.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from kthena_serve.pd.auth import LOOPBACK_HOSTS, check_prefill_url
from kthena_serve.pd.config import PDConfig, Transport
from kthena_serve.pd.decode import HandoffError
from kthena_serve.pd.events import EventLog
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.pd.protocol import PoolRef, PrefillTask, output_to_json, params_from_json
from kthena_serve.server.errors import error_body
from kthena_serve.server.middleware import ApiKeyMiddleware
from mooncake_kv import KVCacheStats

__all__ = ["build_decode_app", "build_prefill_app"]

Closer = Callable[[], None]

log = logging.getLogger(__name__)


def _incarnation() -> str:
    return f"{os.getpid()}-{time.time_ns()}"


def _control_app(secret: str) -> FastAPI:
    """A bare app whose every route but /health needs ``Authorization: Bearer <secret>``."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ApiKeyMiddleware, api_key=secret)
    return app


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
                     prefill_hosts: Iterable[str] = LOOPBACK_HOSTS) -> tuple[FastAPI, Closer]:
    """The decode worker: engine over a shared pool, /pd/generate, /pd/state.

    Args:
        secret: the deployment secret its callers must send and it sends to prefill workers.
        prefill_hosts: hosts a ``prefill_url`` may name (the rest are refused with 400).
    """
    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.engine import LLMEngine, build_runner
    from kthena_serve.pd.decode import DecodeService
    from kthena_serve.server.metrics import ServerMetrics

    runner, tokenizer = build_runner(config, shared_pool=True)
    pool = runner.pool
    engine = LLMEngine(config, runner, tokenizer)
    te = handle = None
    if pd.transport is Transport.MOONCAKE:
        from kthena_serve.pd.transfer import register_pool

        te, handle = register_pool(pool, mooncake_host or "127.0.0.1", pd.transfer_timeout_s)
    ref = PoolRef(pool.layout.num_blocks, config.block_size, config.dtype, pool.name,
                  handle.to_json() if handle is not None else None)
    events = EventLog(engine.kv)
    async_engine = AsyncLLM(engine).start()
    metrics = PDMetrics("decode")
    server_metrics = ServerMetrics(async_engine)
    service = DecodeService(async_engine, ref, pd, metrics, secret=secret)
    allowed_hosts = frozenset(prefill_hosts)
    incarnation = _incarnation()
    app = _control_app(secret)
    _common_routes(app, lambda: server_metrics.render() + metrics.render(),
                   lambda: async_engine.is_alive)

    @app.get("/pd/state")
    async def state(since: int = 0) -> dict:
        stats = async_engine.stats()
        first, last, items = events.since(since)
        return {"name": name, "role": "decode", "incarnation": incarnation,
                "alive": async_engine.is_alive, "num_running": stats.num_running,
                "num_waiting": stats.num_waiting, "kv": attrs.asdict(stats.kv),
                "stats": stats.to_json(), "limits": attrs.asdict(async_engine.limits()),
                "pool": attrs.asdict(ref), "num_quarantined": service.num_quarantined,
                "first_seq": first, "last_seq": last, "events": items}

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
        return StreamingResponse(_ndjson(rid, stream), media_type="application/x-ndjson")

    def close() -> None:
        async_engine.shutdown()  # closes the engine and with it the shared pool (unlinked)
        if te is not None:
            te.close()

    return app, close


async def _ndjson(rid: str, stream):  # noqa: ANN001, ANN202
    try:
        async for out in stream:
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
        await stream.aclose()


# ---- prefill ----------------------------------------------------------------------------------
# A shm prefill worker computes into decode workers' pools and owns none.
_NO_POOL = KVCacheStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


class _Cancelled(Exception):
    pass


class _PrefillState:
    """Which requests are queued or running on the compute thread (for /pd/cancel)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued: set[str] = set()
        self.cancelled: set[str] = set()
        self.running: str | None = None

    def start(self, rid: str) -> None:
        with self.lock:
            self.queued.discard(rid)
            if rid in self.cancelled:
                self.cancelled.discard(rid)
                raise _Cancelled(rid)
            self.running = rid

    def cancel(self, rid: str) -> bool:
        """Drop ``rid`` if queued; True while it is being computed."""
        with self.lock:
            if self.running == rid:
                return True
            if rid in self.queued:
                self.queued.discard(rid)
                self.cancelled.add(rid)
            return False


def build_prefill_app(name: str, config: EngineConfig, pd: PDConfig, *, secret: str,
                      mooncake_host: str | None = None) -> tuple[FastAPI, Closer]:
    """The prefill worker: model + executor on one compute thread, /pd/prefill, /pd/cancel.

    Args:
        secret: the deployment secret its callers (decode workers, the router) must send.
    """
    from kthena_serve.model import load_model
    from kthena_serve.pd.prefill import PrefillExecutor, check_task
    from kthena_serve.threads import configure_threads

    configure_threads(config.num_threads)
    model, _ = load_model(config.model, dtype=config.torch_dtype)
    own = pd.transport is Transport.MOONCAKE
    executor = PrefillExecutor(model, config, own_pool=own)
    putter = None
    if own:
        from kthena_serve.pd.transfer import BlockPutter

        putter = BlockPutter(executor.pool, mooncake_host or "127.0.0.1", pd.transfer_timeout_s)
    events = EventLog(executor.kv) if executor.kv is not None else None
    compute = ThreadPoolExecutor(1, thread_name_prefix="kthena-prefill")
    state = _PrefillState()
    metrics = PDMetrics("prefill")
    incarnation = _incarnation()
    app = _control_app(secret)
    _common_routes(app, metrics.render, lambda: True)

    def run(task: PrefillTask):  # noqa: ANN202 - on the compute thread
        state.start(task.request_id)
        try:
            if putter is None:
                return executor.run_shared(task)
            layout = executor.layout_for(task.pool.num_blocks, task.pool.block_size,
                                         task.pool.dtype)
            return executor.run_local(task, lambda src, dst: putter.put(
                task.pool.mooncake_handle, layout, src, dst))
        finally:
            with state.lock:
                state.running = None

    @app.post("/pd/prefill")
    async def prefill(request: Request) -> Response:
        try:
            task = PrefillTask.from_json(await request.json())
            check_task(task)
        except (TypeError, ValueError, KeyError) as error:
            return JSONResponse(error_body(400, f"bad prefill task: {error}"), status_code=400)
        with state.lock:
            state.queued.add(task.request_id)
        try:
            result = await asyncio.wrap_future(compute.submit(run, task))
        except _Cancelled:
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
        return {"busy": state.cancel(rid)}

    @app.get("/pd/state")
    async def pd_state(since: int = 0) -> dict:
        with state.lock:
            running = int(state.running is not None)
            waiting = len(state.queued)
        first, last, items = events.since(since) if events else (1, 0, [])
        kv = executor.kv.stats() if executor.kv is not None else _NO_POOL
        # The first token it samples is counted by the decode worker, which streams it.
        stats = EngineStats(executor.num_steps, executor.num_computed_tokens, 0, 0, waiting,
                            running, kv)
        return {"name": name, "role": "prefill", "incarnation": incarnation, "alive": True,
                "num_running": running, "num_waiting": waiting,
                "kv": attrs.asdict(kv) if executor.kv is not None else None,
                "stats": stats.to_json(), "first_seq": first, "last_seq": last, "events": items}

    def close() -> None:
        compute.shutdown(wait=True, cancel_futures=True)
        if putter is not None:
            putter.close()
        executor.close()

    return app, close
