"""Decode side of PD: reserve blocks, have a prefill worker fill them, admit, stream.

::

    /pd/generate(EngineRequest, prefill_url)
      1 reserve   AsyncLLM.reserve -> Scheduler.reserve: own prefix cache + blocks for the rest
      2 prefill   POST prefill_url/pd/prefill {block ids, cached length, pool ref, params}
                  (bounded by transfer_timeout_s)
      3 admit     AsyncLLM.generate_prefilled -> Scheduler.admit_prefilled(first token) -> decode
                  (the first token's logprobs come back with it, gathered on the prefill side)
    failure at 2: policy fail      -> 503 "handoff failed ..."
                  policy recompute -> the decode engine computes the prompt itself
                  a rank of either TP worker died -> 503 naming it (the prefill worker's
                  ``rank_died``; this worker's own dead rank: no policy, it cannot decode)

Blocks a prefill worker may still be writing are never handed to anyone else: after a
timeout or a dropped connection the reservation is *quarantined* until the prefill worker
says nothing of the request runs or is left in its sockets (it drops queued ones), or is
unreachable (dead), and this process's kernel holds nothing more from it (`late_writes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import attrs
import httpx

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.cluster.auth import signed_json
from kthena_serve.engine.errors import EngineDeadError
from kthena_serve.engine.request import EngineRequest, RequestOutput
from kthena_serve.pd.config import FailurePolicy, PDConfig, Transport
from kthena_serve.pd.late_writes import LateWrites
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.pd.protocol import PoolRef, PrefillResult, PrefillTask, params_to_json

__all__ = ["DecodeService", "HandoffError", "prefill_client"]

log = logging.getLogger(__name__)


def prefill_client() -> httpx.AsyncClient:
    """The one HTTP client a decode worker calls prefill workers with (made at start-up).

    A client per call would build an SSL context (reading the CA bundle: ~0.2 s here) and
    import httpx's transport modules on the event loop that streams every running request's
    tokens: each long prompt stalled all streams by that much. Proxies from the environment are
    ignored (prefill workers are reached directly); deadlines are given per call.
    """
    return httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0), trust_env=False,
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=32))


class HandoffError(EngineDeadError):
    """A PD handoff failed and the policy says fail: the request ends with 503."""


class _PrefillFailed(Exception):
    """``cause``: what the client may be told (a dead rank); the rest goes to the log."""

    def __init__(self, reason: str, detail: str, settled: bool,
                 cause: str | None = None) -> None:
        super().__init__(detail)
        self.reason, self.settled, self.cause = reason, settled, cause


class DecodeService:
    """The decode worker's PD logic over a started ``AsyncLLM`` whose pool is shared.

    Args:
        engine: the started engine.
        pool: its KV pool reference as prefill workers need it.
        config: policy and timeout.
        metrics: where handoff times and failures go.
        secret: the deployment secret; calls to prefill workers are signed with it, it is
            never sent (None: unsigned).
        client: the HTTP client for prefill workers (default: a new ``prefill_client()``).
        name: this worker's name, in the errors that name one of its ranks.
        dead_rank: a TP engine's ``ParallelModelRunner.dead_rank`` (None: tp=1).
    """

    def __init__(self, engine: AsyncLLM, pool: PoolRef, config: PDConfig,
                 metrics: PDMetrics, *, secret: str | None = None,
                 client: httpx.AsyncClient | None = None, name: str = "decode",
                 dead_rank: Callable[[], Exception | None] | None = None) -> None:
        self.engine = engine
        self.name, self._dead_rank = name, dead_rank
        self.client = client or prefill_client()
        self._secret = secret
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.num_quarantined = 0
        self._tasks: set[asyncio.Task] = set()

    async def generate(self, request: EngineRequest, prefill_url: str | None,
                       ) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        reserved = None
        if prefill_url is not None:
            reserved = await self.engine.reserve(request)
        if reserved is None:
            self.metrics.requests.labels(self.metrics.role, "local").inc()
            async for out in self.engine.generate(request):
                yield out
            return
        start = time.perf_counter()
        task = PrefillTask(rid, request.prompt_ids, reserved.num_cached_tokens,
                           reserved.block_ids, params_to_json(request.params), self.pool,
                           request.cache_salt)
        try:
            result = await self._prefill(prefill_url, task)
        except _PrefillFailed as failure:
            async for out in self._recover(request, prefill_url, failure):
                yield out
            return
        except BaseException:  # the client left while the prefill ran: settle, then release
            self._spawn(self._settle_and_release(prefill_url, rid))
            raise
        await self._raise_if_a_rank_died(rid, count=True)
        self.metrics.observe_handoff(time.perf_counter() - start - result.compute_s,
                                     result.handoff_bytes)
        self.metrics.requests.labels(self.metrics.role, "disaggregated").inc()
        async for out in self.engine.generate_prefilled(rid, result.first_token_id,
                                                        result.first_token_logprobs):
            yield out

    async def _prefill(self, url: str, task: PrefillTask) -> PrefillResult:
        timeout = self.config.transfer_timeout_s
        try:
            body, headers = signed_json(self._secret, "/pd/prefill", task.to_json())
            response = await self.client.post(f"{url}/pd/prefill", content=body,
                                              headers=headers,
                                              timeout=httpx.Timeout(timeout, connect=2.0))
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
            died = _rank_died(response)
            raise _PrefillFailed("error", f"prefill at {url} answered {response.status_code}: "
                                 f"{response.text[:200]}", True, died)
        return PrefillResult(**response.json())

    async def _recover(self, request: EngineRequest, url: str, failure: _PrefillFailed,
                       ) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        policy = self.config.policy
        self.metrics.failure(policy.value, failure.reason)
        log.warning("handoff of %s failed (%s): %s", rid, policy.value, failure)
        if failure.settled:
            await self._raise_if_a_rank_died(rid)
            await self._release(rid)
        else:  # the prefill worker may still write into these blocks: keep them aside
            self._spawn(self._settle_and_release(url, rid))
            await self._raise_if_a_rank_died(None)
        if policy is FailurePolicy.FAIL and failure.cause is not None:
            raise HandoffError(f"{failure.cause}; retry the request")
        if policy is FailurePolicy.FAIL:
            raise HandoffError(f"the KV handoff failed ({failure.reason}) and this deployment's "
                               "policy is 'fail'; retry the request")  # details: the log
        self.metrics.requests.labels(self.metrics.role, "recomputed").inc()
        local = request if failure.settled else attrs.evolve(request,
                                                             request_id=f"{rid}~recompute")
        async for out in self.engine.generate(local):
            yield attrs.evolve(out, request_id=rid)

    async def _release(self, rid: str) -> None:
        await self.engine.release(rid)

    async def _raise_if_a_rank_died(self, rid: str | None, *, count: bool = False) -> None:
        """Fail the hand-off, naming the rank, when one of this TP worker's ranks has died: no
        step runs without it (the worker is stopping), so neither decode nor recompute can.
        ``rid``: its reservation, released first (None: one kept aside, released later);
        ``count``: a failure the metrics have not counted yet (the prefill succeeded).

        Raises:
            HandoffError: a rank has died.
        """
        died = self._dead_rank() if self._dead_rank is not None else None
        if died is None:
            return
        if count:
            self.metrics.failure(self.config.policy.value, "rank_died")
        if rid is not None:
            with contextlib.suppress(EngineDeadError):  # a failed step stopped the engine
                await self._release(rid)
        raise HandoffError(f"{self.name}: {died}; retry the request")

    async def _settle_and_release(self, url: str, rid: str) -> None:
        """Free ``rid``'s blocks once nothing of its failed hand-off can land any more: the
        prefill worker says nothing of it is left on its side (or is gone), and then this
        process's kernel holds nothing unread from it (`late_writes`)."""
        self.num_quarantined += 1
        # shm: the prefill worker writes the pool with its own stores, which end with it; only
        # a transfer over TCP (mooncake) leaves bytes in the kernels
        late = LateWrites(httpx.URL(url).host) \
            if self.config.transport is Transport.MOONCAKE else None
        try:
            peer_settled = await self._ask_until_settled(url, rid)
            while late is not None and not late.drained(peer_settled):
                await asyncio.sleep(0.05)
            await self._release(rid)
        finally:
            self.num_quarantined -= 1

    async def _ask_until_settled(self, url: str, rid: str) -> bool:
        """Ask the prefill worker until it is not writing ``rid``: True; False if it is gone
        (its port refuses; its kernel may still send what its sockets held)."""
        while True:
            try:
                body, headers = signed_json(self._secret, "/pd/cancel", {"request_id": rid})
                reply = await self.client.post(f"{url}/pd/cancel", content=body,
                                               headers=headers, timeout=1.0)
                if not reply.json().get("busy", False):
                    return True
            except httpx.ConnectError:
                return False
            except httpx.TransportError:
                pass  # slow or stopped (SIGSTOP): it may still write; ask again
            await asyncio.sleep(0.1)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _rank_died(response: httpx.Response) -> str | None:
    """The prefill worker's message when one of its TP ranks died (code ``rank_died``)."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error.get("message") if error.get("code") == "rank_died" else None
