"""A PD prefill worker's app: the model and its batched executor, pins a decode worker pulls,
the Kthena connector, and the control routes /pd/prefill, /pd/cancel, /pd/state, /pd/kv/*
(``_PrefillRoutes``)."""


from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kthena_serve.cluster.auth import DECODE_TO_PREFILL_PATHS
from kthena_serve.cluster.events import EventLog
from kthena_serve.cluster.worker import new_incarnation, state_reply
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.grammar import Grammars
from kthena_serve.pd import server as shared
from kthena_serve.pd.config import KVPush, PDConfig, Transport
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.pd.prefill import PrefillCancelled
from kthena_serve.pd.protocol import PrefillTask, params_from_json
from kthena_serve.server.errors import error_body
from kthena_serve.server.metrics import ServerMetrics

if TYPE_CHECKING:
    import torch

    from kthena_comm.transfer import MemoryHandle, TransferEngine
    from kthena_serve.engine.model_runner import Runner
    from kthena_serve.kv_events.config import KVEventsConfig
    from kthena_serve.pd.pins import Pin, PinTable
    from kthena_serve.pd.prefill import PrefillExecutor
    from kthena_serve.pd.prefill_connector import PrefillConnector
    from kthena_serve.pd.reshard import DecodeRankPools, RankPools
    from kthena_serve.pd.transfer import BlockPutter
    from mooncake_kv.layout import KVLayout
    from mooncake_kv.pool import KVPool


__all__ = ["build_prefill_app"]

log = logging.getLogger(__name__)

# How long a TP prefill worker whose forward failed looks for a rank that died (its exit status)
RANK_EXIT_WAIT_S = 0.5


def build_prefill_app(name: str, config: EngineConfig, pd: PDConfig, *, secret: str,
                      mooncake_host: str | None = None, advertise_host: str = "127.0.0.1",
                      api_key: str | None = None, served_model_name: str | None = None,
                      public_metrics: bool = False, kv_events: KVEventsConfig | None = None,
                      ) -> tuple[shared.OnePort, shared.Closer]:
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
        kv_events: publish the own pool's cached router chunks to Redis under this worker's
            owner name (None: off). The own pool holds what a prefill can reuse: every prompt
            over mooncake, the Kthena router's prefills over shm (a /pd/prefill over shm
            writes the decode worker's pool, which that worker announces).
    """
    routes = _PrefillRoutes(name, config, pd, mooncake_host=mooncake_host,
                            advertise_host=advertise_host,
                            served_model_name=shared.served_name(config, served_model_name),
                            kv_events=kv_events)
    app = shared.control_app(secret, public_metrics, signed_paths=DECODE_TO_PREFILL_PATHS)
    app.state.on_port = routes.connector.set_port
    app.state.dead_rank = getattr(routes.executor.runner, "dead_rank", None)  # TP: pd/worker.py
    shared.common_routes(app, routes.render_metrics, lambda: True)
    app.post("/pd/prefill")(routes.prefill)
    app.post("/pd/cancel")(routes.cancel)
    app.get("/pd/state")(routes.state)
    _kv_routes(app, routes.connector, routes.pins, routes.kv_engine.backend, routes.kv_handle,
               routes.executor.pool.layout, tp=config.tp,
               rank_names=_served_rank_names(routes), rank_handles=_served_rank_handles(routes))
    openai = shared.openai_app(routes.engine, config, routes.connector, api_key,
                         routes.server_metrics)
    return shared.OnePort(app, openai), routes.close


class _PrefillRoutes:
    """A prefill worker's parts (model, batched executor over its own pool, pins a decode
    worker pulls, the Kthena connector) and its control routes: ``prefill`` (/pd/prefill),
    ``cancel`` (/pd/cancel), ``state`` (/pd/state)."""

    def __init__(self, name: str, config: EngineConfig, pd: PDConfig, *,
                 mooncake_host: str | None, advertise_host: str, served_model_name: str,
                 kv_events: KVEventsConfig | None) -> None:
        from kthena_serve.engine.threads import configure_threads
        from kthena_serve.model import load_model
        from kthena_serve.pd.pins import PinTable
        from kthena_serve.pd.prefill_connector import PrefillConnector, PrefillEngine
        from kthena_serve.pd.reshard_put import RankPutter

        runner = None
        if config.tp > 1:  # its ranks' pools in /dev/shm: the hand-off maps and copies them
            from kthena_serve.engine.parallel_runner import ParallelModelRunner

            runner = ParallelModelRunner(config, shared_pool=True)  # pins this process
            model, tokenizer = runner.model, runner.tokenizer
        else:
            configure_threads(config.num_threads)
            model, tokenizer = load_model(config.model, dtype=config.torch_dtype,
                                          device=config.device, quantization=config.quantization,
                                          kernels=config.kernels, kv_block_size=config.block_size)
        self.name, self.pd = name, pd
        self.metrics = PDMetrics("prefill")
        # one compiled-grammar cache: the OpenAI routes' checks and the executor's first tokens
        self.grammars = Grammars(tokenizer, model.config.shape.vocab_size)
        self.executor, self.putter, self.kv_engine, self.kv_handle = _own_pool(
            model, config, pd, mooncake_host, self.metrics.observe_batch,
            tokenizer.eos_token_ids, self.grammars, runner)
        self.own_ranks, self.targets = _rank_pools(self.executor, runner, model, config)
        self.rank_putter = None if self.putter is None else RankPutter(
            self.putter.engine, self.putter.local, self.own_ranks, model.config, config,
            pd.transfer_timeout_s)  # a TP instance on either side: each rank's heads put
        # shm: the own pool is not what /pd/prefill fills, so its events are not announced
        self.events = EventLog(self.executor.kv) if self.putter is not None else None
        self.pins = PinTable(pd.kv_pin_timeout_s, pd.transfer_timeout_s, self._free)
        self.sweeper = _Sweeper(self.pins, max(0.02, min(0.2, pd.kv_pin_timeout_s / 4)))
        # its stats count the /pd/prefill tasks too: one executor runs both
        self.engine = PrefillEngine(self.executor, tokenizer, config, self.pins)
        self.incarnation = new_incarnation()
        self.connector = PrefillConnector(self.engine, f"{name}-{self.incarnation}",
                                          advertise_host, tp=config.tp)
        self.server_metrics = ServerMetrics(self.engine, served_model_name)
        self.publisher = shared.start_kv_events(name, kv_events, self.executor.kv,
                                                self.server_metrics)

    def _free(self, pin: Pin) -> None:
        """An expired or released pin's blocks, freed on the compute thread (their owner)."""
        future = self.executor.call(self.executor.free, pin.request_id)
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.error(
            "freeing the pinned blocks of %s failed: %r", pin.request_id, f.exception()))

    def render_metrics(self) -> bytes:
        return self.server_metrics.render() + self.metrics.render()

    def _submit(self, task: PrefillTask) -> concurrent.futures.Future:
        """A future of the task's ``PrefillResult``, batched with the others' prefills: zero
        copy into a tp=1 decode pool from a tp=1 worker; else computed into the own rank pools
        and copied into the decode ranks' (``ReshardCopy``: layer by layer, unless
        ``--pd-kv-push batched``); across hosts, put (mooncake:
        each rank's heads into the decode ranks', ``ReshardPut``, where either is TP)."""
        from kthena_serve.pd.reshard import ReshardCopy

        if self.putter is None:
            if self.own_ranks.tp > 1 or task.pool.tp > 1:
                task.pool.rank_names()  # a ValueError (400) for a pool not on this host
                return self.executor.submit_local(
                    task, ReshardCopy(self.own_ranks, self.targets, task.pool,
                                      layerwise=self.pd.kv_push is KVPush.LAYERWISE))
            return self.executor.submit_shared(task)
        layout = self.executor.layout_for(task.pool.num_blocks, task.pool.block_size,
                                          task.pool.dtype, task.pool.kv_cache_dtype)
        if self.own_ranks.tp > 1 or task.pool.tp > 1:  # a ValueError (400): no rank handles
            return self.executor.submit_local(task, self.rank_putter.push(task.pool))
        session = self.putter.session(task.pool.mooncake_handle, layout,
                                      layerwise=self.pd.kv_push is KVPush.LAYERWISE)
        return self.executor.submit_local(task, session)

    async def prefill(self, request: Request) -> Response:
        """A decode worker's task: prefill, hand the KV off, answer the first token."""
        try:
            task = PrefillTask.from_json(await request.json())
            spec = params_from_json(task.params).structured_outputs
            if spec is not None:  # compiled here, off the event loop and the compute thread
                await asyncio.to_thread(self.grammars.compile, spec)
            future = self._submit(task)
        except (TypeError, ValueError, KeyError) as error:
            return JSONResponse(error_body(400, f"bad prefill task: {error}"), status_code=400)
        except Exception as error:  # noqa: BLE001 - the decode side applies its policy
            return await self._prefill_failed(error)
        try:
            result = await asyncio.wrap_future(future)
        except PrefillCancelled:
            return JSONResponse(error_body(409, "cancelled"), status_code=409)
        except Exception as error:  # noqa: BLE001 - the decode side applies its policy
            return await self._prefill_failed(error)
        self.metrics.prefill.labels("prefill").observe(result.compute_s)
        self.metrics.observe_handoff(result.handoff_s, result.handoff_bytes)
        self.metrics.prefill_cached.labels("prefill").inc(result.num_prefill_cached_tokens)
        return JSONResponse(result.to_json())

    async def _prefill_failed(self, error: Exception) -> Response:
        """A failed prefill's 503; where one of this TP worker's ranks has died (its forward
        failed with it), code ``rank_died`` and a message naming this worker and the rank.

        A forward fails as soon as the dead rank's sockets close, which can be a moment before
        its exit status can be read: a TP worker looks for it for up to ``RANK_EXIT_WAIT_S``
        (not for a full pool, which no rank's death causes)."""
        dead_rank = getattr(self.executor.runner, "dead_rank", None)
        if dead_rank is None or isinstance(error, MemoryError):
            return _prefill_failed(error)
        deadline = time.monotonic() + RANK_EXIT_WAIT_S
        while (died := dead_rank()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if died is None:
            return _prefill_failed(error)
        return JSONResponse(error_body(503, f"{self.name}: {died}", code="rank_died"),
                            status_code=503)

    async def cancel(self, request: Request) -> dict:
        """Drop a queued prefill; ``busy`` while a forward still writes its KV."""
        rid = (await request.json())["request_id"]
        return {"busy": self.executor.cancel(rid)}

    async def state(self, since: int = 0) -> dict:
        """What the router polls: load, KV stats and events, the pins held."""
        pins = self.pins
        return state_reply(self.name, "prefill", self.incarnation, alive=True,
                           stats=self.engine.stats(), events=self.events, since=since,
                           num_pinned=len(pins), num_pinned_blocks=pins.num_blocks,
                           num_pins_expired=pins.num_expired)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()  # removes this worker's fields before the pool goes
        self.engine.abort_all("the prefill worker is stopping")
        self.sweeper.stop()
        self.pins.clear()
        self.executor.close()  # its compute thread, then the own pool (a segment: with its engine)
        self.kv_engine.close()  # before the rank pools registered with it are unmapped
        self.own_ranks.close()
        self.targets.close()


def _prefill_failed(error: Exception) -> Response:
    return JSONResponse(error_body(503, f"prefill failed: {type(error).__name__}: {error}"),
                        status_code=503)


def _own_pool(model: torch.nn.Module, config: EngineConfig, pd: PDConfig,
              mooncake_host: str | None, on_batch: Callable[[int, int], None],
              eos_token_ids: Sequence[int], grammars: Grammars, runner: Runner | None = None,
              ) -> tuple[PrefillExecutor, BlockPutter | None, TransferEngine, MemoryHandle | None]:
    """(executor, putter or None, transfer engine, handle) for the prefill worker's own pool:
    private and registered with Mooncake (mooncake: host or device memory), or in a served shm
    segment (shm, cpu). On a device over shm the own pool is private device memory with no
    handle (the shm engine moves host memory only): /pd/kv/lease refuses, naming mooncake. A
    TP worker's own pool is its ranks' (``runner``), with no handle: over shm a lease names
    them; over mooncake its putter registers rank 0's pool (``RankPutter`` the other ranks')."""
    from kthena_serve.pd.prefill import PrefillExecutor
    from kthena_serve.pd.transfer import BlockPutter, shm_engine, shm_segment_pool

    if runner is not None:  # mooncake: rank 0's pool registered (the others: `RankPutter`)
        executor = PrefillExecutor(model, config, runner=runner, on_batch=on_batch,
                                   eos_token_ids=eos_token_ids, grammars=grammars)
        if pd.transport is Transport.MOONCAKE:
            putter = BlockPutter(executor.pool, mooncake_host or "127.0.0.1",
                                 pd.transfer_timeout_s)
            return executor, putter, putter.engine, None
        return executor, None, shm_engine(pd.transfer_timeout_s), None
    if pd.transport is Transport.MOONCAKE:
        executor = PrefillExecutor(model, config, own_pool=True, on_batch=on_batch,
                                   eos_token_ids=eos_token_ids, grammars=grammars)
        putter = BlockPutter(executor.pool, mooncake_host or "127.0.0.1", pd.transfer_timeout_s)
        return executor, putter, putter.engine, putter.local
    engine = shm_engine(pd.transfer_timeout_s)
    if config.device != "cpu":
        executor = PrefillExecutor(model, config, own_pool=True, on_batch=on_batch,
                                   eos_token_ids=eos_token_ids, grammars=grammars)
        return executor, None, engine, None
    handles = []

    def in_segment(layout: KVLayout) -> KVPool:
        pool, handle = shm_segment_pool(engine, layout)
        handles.append(handle)
        return pool

    executor = PrefillExecutor(model, config, own_pool=in_segment, on_batch=on_batch,
                               eos_token_ids=eos_token_ids, grammars=grammars)
    return executor, None, engine, handles[0]


def _rank_pools(executor: PrefillExecutor, runner: Runner | None, model: torch.nn.Module,
                config: EngineConfig) -> tuple[RankPools, DecodeRankPools]:
    """(this worker's own pools per rank, the decode instances' rank pools as mapped here):
    a TP worker maps its ranks' /dev/shm pools (rank 0's is its own process's)."""
    from kthena_serve.engine.parallel_runner import ParallelModelRunner
    from kthena_serve.pd.reshard import DecodeRankPools, RankPools

    own = RankPools([executor.pool])
    if isinstance(runner, ParallelModelRunner):
        ranks = runner.rank_pools()
        mapped = RankPools.attach([name for name, _ in ranks[1:]],
                                  [layout for _, layout in ranks[1:]])
        own = RankPools([executor.pool, *mapped.pools], owned=mapped.pools)
    return own, DecodeRankPools(model.config, config)


class _Sweeper:
    """Frees expired pins every ``interval_s`` (a daemon thread)."""

    def __init__(self, pins: PinTable, interval_s: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pins, interval_s),
                                        name="kthena-pin-sweeper", daemon=True)
        self._thread.start()

    def _run(self, pins: PinTable, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            pins.expire()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _served_rank_names(routes: _PrefillRoutes) -> list[str]:
    """The /dev/shm pools a decode worker on this host maps to copy pinned blocks head by head
    (``rank_pull.py``, where either worker is a TP engine): every rank's of a TP worker, a
    tp=1 worker's own pool's segment (a cpu pool); none over mooncake."""
    if routes.kv_engine.backend != "shm":
        return []
    if routes.own_ranks.tp > 1:
        return [pool.name for pool in routes.own_ranks.pools]
    return [routes.kv_handle.segment] if routes.kv_handle is not None else []


def _served_rank_handles(routes: _PrefillRoutes) -> list[MemoryHandle]:
    """The pools registered with Mooncake a decode worker gets pinned blocks from head by
    head (``rank_pull.RankGet``, where either worker is a TP engine): every rank's of a TP
    worker, a tp=1 worker's own pool (``RankPutter.handles``, rank 0's first); none over shm."""
    return [] if routes.rank_putter is None else list(routes.rank_putter.handles)


def _kv_routes(app: FastAPI, connector: PrefillConnector, pins: PinTable, backend: str,
               handle: MemoryHandle | None, layout: KVLayout, *, tp: int = 1,
               rank_names: Sequence[str] = (), rank_handles: Sequence[MemoryHandle] = (),
               ) -> None:
    """/pd/kv/lease and /pd/kv/release: a decode worker claims pinned blocks, then frees them;
    /pd/kv/backlog (`_backlog_route`).

    A lease answers the pool to get from (``handle``; None for a TP worker), ``tp``, and
    every rank's pool: over shm its name (``rank_names``), over mooncake its handle
    (``rank_handles``). A decode worker where either side is a TP engine copies (shm) or
    gets (mooncake) the blocks head by head from those instead (``rank_pull.py``)."""
    from kthena_serve.pd.pins import PinError

    _backlog_route(app)

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
        if handle is None and tp == 1:
            return JSONResponse(error_body(409, "this prefill worker's own KV pool is in device "
                                           f"memory and {backend} moves host memory only: "
                                           "serving pinned blocks needs --pd-transport "
                                           "mooncake"), status_code=409)
        try:
            pin = pins.lease(transfer_id, block_ids, digest)
        except PinError as error:
            return JSONResponse(error_body(error.status, str(error)), status_code=error.status)
        served: dict = {"tp": tp}
        if rank_names:
            served["rank_shm_names"] = list(rank_names)
        if rank_handles:
            served["rank_mooncake_handles"] = [h.to_dict() for h in rank_handles]
        return JSONResponse({"handle": None if handle is None else handle.to_dict(),
                             "num_blocks": layout.num_blocks,
                             "fingerprint": layout.shape.fingerprint(),
                             "kind": layout.kind.value, "first_token_id": pin.first_token_id,
                             "first_token_logprobs": pin.first_token_logprobs, **served})

    @app.post("/pd/kv/release")
    async def kv_release(request: Request) -> Response:
        try:
            transfer_id = (await request.json())["transfer_id"]
            if not isinstance(transfer_id, str):
                raise TypeError("transfer_id must be a string")
        except (TypeError, ValueError, KeyError) as error:
            return JSONResponse(error_body(400, f"bad release: {error}"), status_code=400)
        return JSONResponse({"released": pins.release(transfer_id)})


def _backlog_route(app: FastAPI) -> None:
    """/pd/kv/backlog: what a get the caller gave up on may still deliver (`late_writes`)."""
    from kthena_comm.transfer.tcp_queues import host_addresses, socket_backlog

    @app.post("/pd/kv/backlog")
    async def kv_backlog(request: Request) -> Response:
        """What this process's kernel still holds for the caller's host: bytes sent to it and
        not acknowledged (a get it served that the caller gave up on may still deliver them);
        null where the kernel cannot be read."""
        caller = request.client.host if request.client else ""
        try:
            backlog = socket_backlog(host_addresses(caller))
        except ValueError:
            backlog = None
        return JSONResponse({"unacked": None if backlog is None else backlog.unacked})
