"""A PD decode worker's app: its engine over a shared pool, the handoff service, the Kthena
connector, and the control routes /pd/state and /pd/generate (``_DecodeRoutes``)."""


from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import TYPE_CHECKING

import attrs
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kthena_serve.cluster.auth import LOOPBACK_HOSTS, check_prefill_url
from kthena_serve.cluster.events import EventLog
from kthena_serve.cluster.worker import new_incarnation, state_reply
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from kthena_serve.pd import server as shared
from kthena_serve.pd.config import PDConfig, Transport
from kthena_serve.pd.decode import HandoffError
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.pd.protocol import PoolRef, output_to_json, params_from_json
from kthena_serve.server.errors import error_body
from kthena_serve.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from kthena_comm.transfer import MemoryHandle, TransferEngine
    from kthena_serve.engine.model_runner import Runner
    from kthena_serve.engine.request import RequestOutput
    from kthena_serve.kv_events.config import KVEventsConfig
    from kthena_serve.pd.rank_pull import RankGet, RankPull
    from kthena_serve.pd.reshard import RankPools
    from mooncake_kv.pool import KVPool


__all__ = ["build_decode_app"]

log = logging.getLogger(__name__)


def build_decode_app(name: str, config: EngineConfig, pd: PDConfig, *, secret: str,
                     mooncake_host: str | None = None,
                     prefill_hosts: Iterable[str] = LOOPBACK_HOSTS, api_key: str | None = None,
                     served_model_name: str | None = None,
                     public_metrics: bool = False, kv_events: KVEventsConfig | None = None,
                     ) -> tuple[shared.OnePort, shared.Closer]:
    """The decode worker: engine over a shared pool, /pd/generate, /pd/state, and the OpenAI
    routes (decode requests from the Kthena router pull their KV: decode_connector.py).

    Args:
        secret: the deployment secret its callers must send and it sends to prefill workers.
        prefill_hosts: hosts or networks a ``prefill_url`` or ``remote_host`` may name (the
            rest: 400).
        api_key: what the OpenAI routes require (None: nothing).
        served_model_name: the ``model`` the OpenAI routes serve and the metrics' model_name
            (default: from the model).
        public_metrics: /metrics needs no secret (the Kthena router scrapes without one).
        kv_events: publish the pool's cached router chunks to Redis under this worker's
            owner name (None: off).
    """
    routes = _DecodeRoutes(name, config, pd, secret=secret, mooncake_host=mooncake_host,
                           prefill_hosts=frozenset(prefill_hosts),
                           served_model_name=shared.served_name(config, served_model_name),
                           kv_events=kv_events)
    app = shared.control_app(secret, public_metrics)
    app.state.dead_rank = routes.dead_rank  # TP: pd/worker.py stops the worker when one dies
    shared.common_routes(app, routes.render_metrics, lambda: routes.engine.is_alive)
    app.get("/pd/state")(routes.state)
    app.post("/pd/generate")(routes.generate)
    openai = shared.openai_app(routes.engine, config, routes.connector, api_key,
                               routes.server_metrics)
    return shared.OnePort(app, openai), routes.close


class _DecodeRoutes:
    """A decode worker's parts (engine over its shared pool, the handoff service, the Kthena
    connector) and its control routes: ``state`` (/pd/state) and ``generate`` (/pd/generate)."""

    def __init__(self, name: str, config: EngineConfig, pd: PDConfig, *, secret: str,
                 mooncake_host: str | None, prefill_hosts: frozenset[str],
                 served_model_name: str, kv_events: KVEventsConfig | None) -> None:
        from kthena_serve.async_engine import AsyncLLM
        from kthena_serve.engine import LLMEngine, build_runner
        from kthena_serve.pd.decode import DecodeService, prefill_client
        from kthena_serve.pd.decode_connector import DecodeConnector
        from kthena_serve.pd.transfer import BlockGetter

        runner, tokenizer = build_runner(config, shared_pool=True)
        self.dead_rank = getattr(runner, "dead_rank", None)
        engine = LLMEngine(config, runner, tokenizer)
        self.name, self.prefill_hosts = name, prefill_hosts
        self.pull_engine, pull_handle, self.ref = _decode_pool(runner.pool, config, pd,
                                                               mooncake_host)
        pull_refusal = None
        if config.tp > 1:  # every rank's pool, which prefill workers copy their heads into
            names = [name for name, _layout in runner.rank_pools()]
            self.ref = attrs.evolve(self.ref, tp=config.tp, rank_shm_names=names)
            pull_handle = None  # a get fills one pool: a TP pull goes head by head (ranks)
            pull_refusal = (f"this decode worker is a TP{config.tp} engine, whose KV is split "
                            "over its ranks' pools: a whole-block get into one pool cannot "
                            "fill them (its pulls go head by head, pd/rank_pull.py)")
        self.rank_pools = None  # mooncake TP: ranks 1.. mapped here, registered for the puts
        if config.tp > 1 and pd.transport is Transport.MOONCAKE:
            self.rank_pools, handles = _register_ranks(runner, self.pull_engine,
                                                       self.ref.mooncake_handle)
            self.ref = attrs.evolve(self.ref, rank_shm_names=(), rank_mooncake_handles=handles)
        self.ranks = _rank_pull(runner, config, pd, self.pull_engine, self.ref,
                                self.rank_pools)  # a TP pair's connector pull
        self.events = EventLog(engine.kv)
        self.engine = AsyncLLM(engine).start()
        self.metrics = PDMetrics("decode")
        self.server_metrics = ServerMetrics(self.engine, served_model_name)
        self.publisher = shared.start_kv_events(name, kv_events, engine.kv, self.server_metrics)
        client = prefill_client()  # one for every call to prefill workers (see prefill_client)
        self.service = DecodeService(self.engine, self.ref, pd, self.metrics, secret=secret,
                                     client=client, name=name, dead_rank=self.dead_rank)
        getter = BlockGetter(self.pull_engine, pull_handle, runner.pool.layout,
                             pd.transfer_timeout_s, refusal=pull_refusal)
        self.connector = DecodeConnector(self.engine, getter, pd, self.metrics, secret=secret,
                                         prefill_hosts=prefill_hosts, client=client,
                                         ranks=self.ranks)
        self.incarnation = new_incarnation()

    def render_metrics(self) -> bytes:
        return self.server_metrics.render() + self.metrics.render()

    async def state(self, since: int = 0) -> dict:
        """What the router polls: load, KV stats and events, limits, the pool's reference."""
        quarantined = self.service.num_quarantined + self.connector.num_quarantined
        return state_reply(self.name, "decode", self.incarnation, alive=self.engine.is_alive,
                           stats=self.engine.stats(), events=self.events, since=since,
                           limits=self.engine.processor.limits, pool=attrs.asdict(self.ref),
                           num_quarantined=quarantined)

    async def generate(self, request: Request) -> Response:
        """The router's request, validated once here; its outputs as NDJSON."""
        try:
            body = await request.json()
            rid = body["request_id"]
            prefill_url = body.get("prefill_url")
            if prefill_url is not None:
                check_prefill_url(prefill_url, self.prefill_hosts)
            # off the event loop: a request with structured_outputs compiles its grammar here
            engine_request = await asyncio.to_thread(
                self.engine.make_request, rid, list(body["prompt_ids"]),
                params_from_json(body["params"]), cache_salt=body.get("cache_salt"))
        except InvalidRequestError as error:
            return JSONResponse(error_body(400, str(error), error.param), status_code=400)
        except (TypeError, ValueError, KeyError) as error:
            return JSONResponse(error_body(400, f"bad generate request: {error}"),
                                status_code=400)
        # No admission check: the PD router admitted it against its own queue, which holds
        # this one's (a refusal here would come after the router's 200 was sent). Its wait
        # still counts in this worker's queue (``reserve`` / ``generate``), which the router
        # reads in /pd/state.
        stream = self.service.generate(engine_request, prefill_url)
        return StreamingResponse(_ndjson(rid, stream, self.server_metrics),
                                 media_type="application/x-ndjson")

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()  # removes this worker's fields before the engine goes
        self.engine.shutdown()  # closes the engine and with it the shared pool (unlinked)
        self.pull_engine.close()
        if self.ranks is not None:  # after the engine: no copy runs any more
            self.ranks.close()
        if self.rank_pools is not None:  # unmapped once no longer registered
            self.rank_pools.close()


def _decode_pool(pool: KVPool, config: EngineConfig, pd: PDConfig, mooncake_host: str | None,
                 ) -> tuple[TransferEngine, MemoryHandle | None, PoolRef]:
    """(engine that reads other pools into ``pool``, ``pool``'s handle for it or None, the
    reference prefill workers write by): registered with Mooncake (mooncake: host or device
    memory), or privately (shm) with the pool exported to the host (pool_share.py). A device
    pool over shm has no handle: the shm engine moves host memory only, so the Kthena
    router's pull path (``BlockGetter``) refuses it, naming the mooncake transport."""
    from kthena_serve.pd.pool_share import export_pool
    from kthena_serve.pd.transfer import register_pool, shm_engine

    mooncake = handle = None  # mooncake: the pool as prefill workers put into it
    shared: dict = {}
    if pd.transport is Transport.MOONCAKE:
        engine, mooncake = register_pool(pool, mooncake_host or "127.0.0.1",
                                         pd.transfer_timeout_s)
        handle = mooncake
    else:  # the shm engine only reads other pools into this one: private registration
        engine = shm_engine(pd.transfer_timeout_s)
        shared = export_pool(pool)  # {"shm_name": ...} or {"device_ipc": ...}
        if pool.buffer.device.type == "cpu":
            handle = engine.register(pool.buffer)
    ref = PoolRef(pool.layout.num_blocks, config.block_size, config.dtype,
                  mooncake_handle=None if mooncake is None else mooncake.to_json(),
                  kv_cache_dtype=config.kv_cache_dtype, **shared)
    return engine, handle, ref


def _register_ranks(runner: Runner, engine: TransferEngine, first: str,
                    ) -> tuple[RankPools, tuple[str, ...]]:
    """A TP decode worker's ranks 1.. pools (/dev/shm files of its ranks) mapped here and
    registered with ``engine``, which holds rank 0's (``first``, its handle's JSON); returns
    them and every rank's handle JSON in rank order (``PoolRef.rank_mooncake_handles``)."""
    from kthena_serve.pd.reshard import RankPools

    ranks = runner.rank_pools()[1:]
    mapped = RankPools.attach([name for name, _ in ranks], [layout for _, layout in ranks])
    try:
        handles = [engine.register(pool.buffer).to_json() for pool in mapped.pools]
    except BaseException:
        mapped.close()
        raise
    return mapped, (first, *handles)


def _rank_pull(runner: Runner, config: EngineConfig, pd: PDConfig, engine: TransferEngine,
               ref: PoolRef, rank_pools: RankPools | None) -> RankPull | RankGet | None:
    """What moves a TP pair's pinned blocks head by head into this worker's rank pools for
    the Kthena connector (``rank_pull.py``): over mooncake, gets into the rank pools
    registered with ``engine`` (``ref``'s handles; ranks 1.. are ``rank_pools``); over shm
    with a cpu pool, a copy; None otherwise (a device pool over shm: a TP prefill worker's
    lease is then refused, naming the transports that serve it)."""
    from kthena_comm.transfer import MemoryHandle
    from kthena_serve.pd.rank_pull import RankGet, RankPull, own_rank_pools

    if pd.transport is Transport.MOONCAKE:
        own = [MemoryHandle.from_json(handle) for handle in ref.rank_handles()]
        spawned = rank_pools.pools if rank_pools is not None else []
        layouts = [runner.pool.layout, *(pool.layout for pool in spawned)]
        return RankGet(engine, own, layouts, runner.model.config, config,
                       pd.transfer_timeout_s)
    if runner.pool.buffer.device.type != "cpu":
        return None
    return RankPull(own_rank_pools(runner), runner.model.config, config)


async def _ndjson(rid: str, stream: AsyncGenerator[RequestOutput, None],
                  server_metrics: ServerMetrics) -> AsyncIterator[str]:
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
