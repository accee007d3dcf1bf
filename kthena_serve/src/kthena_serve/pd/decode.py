"""Decode side of PD: reserve blocks, have a prefill worker fill them, admit, stream.

::

    /pd/generate(prompt, prefill_url)
      1 reserve   engine thread: match_prefix (own cache) + try_allocate -> block ids
      2 prefill   POST prefill_url/pd/prefill {block ids, cached length, pool ref, params}
                  (bounded by transfer_timeout_s)
      3 admit     engine thread: add_prefilled_request(first token) -> decode steps
    failure at 2: policy fail      -> 503 "handoff failed ..."
                  policy recompute -> the decode engine computes the prompt itself

Blocks a prefill worker may still be writing are never handed to anyone else: after a
timeout or a dropped connection the reservation is *quarantined* until the prefill worker
says the request is not running (it drops queued ones) or is unreachable (dead).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.engine import LLMEngine
from kthena_serve.errors import EngineDeadError
from kthena_serve.pd.config import FailurePolicy, PDConfig
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.pd.protocol import PoolRef, PrefillResult, PrefillTask, params_to_json
from kthena_serve.request import RequestOutput
from kthena_serve.sampling_params import SamplingParams
from mooncake_kv import ExtraKeys
from mooncake_kv.pool import KVPool

__all__ = ["DecodeEngine", "DecodeService", "HandoffError", "share_pool"]

log = logging.getLogger(__name__)


class HandoffError(EngineDeadError):
    """A PD handoff failed and the policy says fail: the request ends with 503."""


def share_pool(engine: LLMEngine) -> KVPool:
    """Move the engine's KV pool into POSIX shared memory (same layout, before any request)."""
    runner = engine.runner
    old = runner.pool
    pool = KVPool.create(old.layout, shared=True)
    runner.pool = pool
    runner.kv_caches = [(pool.k_cache(i), pool.v_cache(i))
                        for i in range(old.layout.shape.num_layers)]
    old.close()
    return pool


class DecodeEngine(AsyncLLM):
    """AsyncLLM that also runs functions on its engine thread (the KV manager's owner)."""

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, future))
        return future

    async def run_on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        return await asyncio.wrap_future(self.call(fn))

    def _drain_inbox(self) -> None:
        others: deque[tuple] = deque()
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] != "call":
                others.append(command)
                continue
            _, fn, future = command
            try:
                future.set_result(fn(self.engine))
            except BaseException as error:  # handed to the awaiting caller
                future.set_exception(error)
        if others:
            self._inbox.extendleft(reversed(others))
            super()._drain_inbox()

    async def generate_prefilled(self, request_id: str, prompt_ids: list[int],
                                 params: SamplingParams, first_token_id: int, *,
                                 num_cached_tokens: int, cache_salt: str | None,
                                 ) -> AsyncIterator[RequestOutput]:
        """Like ``generate`` for a request whose blocks are reserved and filled."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)

        def admit(engine: LLMEngine) -> None:
            try:
                out = engine.add_prefilled_request(request_id, prompt_ids, params,
                                                   first_token_id,
                                                   num_cached_tokens=num_cached_tokens,
                                                   cache_salt=cache_salt)
            except Exception as error:
                engine.kv.free(request_id)
                self._dispatch([error], request_id)
                return
            self._dispatch([out])

        self._submit(("call", admit, concurrent.futures.Future()))
        # aclosing: a consumer that stops early (client gone) aborts the request right away.
        async with contextlib.aclosing(self._stream(request_id, queue)) as stream:
            async for item in stream:
                yield item


def _reserve(engine: LLMEngine, rid: str, ids: list[int], salt: str | None):
    """On the engine thread: blocks for the whole prompt, cached prefix included."""
    kv = engine.kv
    match = kv.match_prefix(rid, ids, ExtraKeys(cache_salt=salt) if salt else None)
    blocks = kv.try_allocate(rid, len(ids) - match.num_cached_tokens)
    if blocks is None:
        kv.free(rid)
        return None
    return blocks.block_ids, match.num_cached_tokens


class _PrefillFailed(Exception):
    def __init__(self, reason: str, detail: str, settled: bool) -> None:
        super().__init__(detail)
        self.reason, self.settled = reason, settled


class DecodeService:
    """The decode worker's PD logic over a started ``DecodeEngine`` with a shared pool.

    Args:
        engine: the started engine.
        pool: its KV pool reference as prefill workers need it.
        config: policy and timeout.
        metrics: where handoff times and failures go.
    """

    def __init__(self, engine: DecodeEngine, pool: PoolRef, config: PDConfig,
                 metrics: PDMetrics) -> None:
        self.engine = engine
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.num_quarantined = 0
        self._tasks: set[asyncio.Task] = set()

    async def generate(self, rid: str, ids: list[int], params: SamplingParams,
                       salt: str | None, prefill_url: str | None) -> AsyncIterator[RequestOutput]:
        reserved = None
        if prefill_url is not None:
            reserved = await self.engine.run_on_engine(lambda e: _reserve(e, rid, ids, salt))
        if reserved is None:
            self.metrics.requests.labels(self.metrics.role, "local").inc()
            async for out in self.engine.generate(rid, ids, params, cache_salt=salt):
                yield out
            return
        block_ids, num_cached = reserved
        start = time.perf_counter()
        task = PrefillTask(rid, tuple(ids), num_cached, tuple(block_ids), params_to_json(params),
                           self.pool, salt)
        try:
            result = await self._prefill(prefill_url, task)
        except _PrefillFailed as failure:
            async for out in self._recover(rid, ids, params, salt, prefill_url, failure):
                yield out
            return
        except BaseException:  # the client left while the prefill ran: settle, then release
            self._spawn(self._settle_and_release(prefill_url, rid))
            raise
        self.metrics.observe_handoff(time.perf_counter() - start - result.compute_s,
                                     result.handoff_bytes)
        self.metrics.requests.labels(self.metrics.role, "disaggregated").inc()
        async for out in self.engine.generate_prefilled(rid, ids, params, result.first_token_id,
                                                         num_cached_tokens=num_cached,
                                                         cache_salt=salt):
            yield out

    async def _prefill(self, url: str, task: PrefillTask) -> PrefillResult:
        timeout = self.config.transfer_timeout_s
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=2.0)) as client:
                response = await client.post(f"{url}/pd/prefill", json=task.to_json())
        except httpx.TimeoutException as error:
            raise _PrefillFailed("timeout", f"prefill at {url} did not answer within "
                                 f"{timeout:g} s ({type(error).__name__})", False) from None
        except httpx.ConnectError as error:
            raise _PrefillFailed("unreachable", f"prefill at {url} is unreachable: {error}",
                                 True) from None
        except httpx.TransportError as error:
            raise _PrefillFailed("unreachable", f"prefill at {url} dropped the request: "
                                 f"{type(error).__name__}", False) from None
        if response.status_code != 200:
            raise _PrefillFailed("error", f"prefill at {url} answered {response.status_code}: "
                                 f"{response.text[:200]}", True)
        return PrefillResult(**response.json())

    async def _recover(self, rid: str, ids: list[int], params: SamplingParams, salt: str | None,
                       url: str, failure: _PrefillFailed) -> AsyncIterator[RequestOutput]:
        policy = self.config.policy
        self.metrics.failure(policy.value, failure.reason)
        log.warning("handoff of %s failed (%s): %s", rid, policy.value, failure)
        if failure.settled:
            await self._release(rid)
        else:  # the prefill worker may still write into these blocks: keep them aside
            self._spawn(self._settle_and_release(url, rid))
        if policy is FailurePolicy.FAIL:
            raise HandoffError(f"request {rid}: KV handoff failed ({failure.reason}): {failure}; "
                               "policy 'fail' — retry the request")
        self.metrics.requests.labels(self.metrics.role, "recomputed").inc()
        local_id = rid if failure.settled else f"{rid}~recompute"
        async for out in self.engine.generate(local_id, ids, params, cache_salt=salt):
            yield out

    async def _release(self, rid: str) -> None:
        await self.engine.run_on_engine(lambda e: e.kv.free(rid))

    async def _settle_and_release(self, url: str, rid: str) -> None:
        """Wait until the prefill worker is not writing ``rid`` (or is dead), then free it."""
        self.num_quarantined += 1
        try:
            async with httpx.AsyncClient(timeout=1.0) as client:
                while True:
                    try:
                        reply = await client.post(f"{url}/pd/cancel", json={"request_id": rid})
                        if not reply.json().get("busy", False):
                            break
                    except httpx.ConnectError:
                        break  # refused: the process is gone, nothing writes any more
                    except httpx.TransportError:
                        pass  # slow or stopped (SIGSTOP): it may still write; ask again
                    await asyncio.sleep(0.1)
            await self._release(rid)
        finally:
            self.num_quarantined -= 1

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
