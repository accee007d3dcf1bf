"""The decode worker's side of ``kv_transfer_params``: pull a prefilled prompt's KV, decode.

A decode request from the Kthena router carries the prefill answer's ``kv_transfer_params``
(kv_params.py). Before anything streams (``open``; a refusal is a 400)::

    1 check      the fields; remote_host must be a prefill host of this deployment
                 (``--prefill-hosts``), or nothing is contacted
    2 lease      POST remote/pd/kv/lease {engine id, transfer id, block ids, prompt digest}
                 (signed) ──── the prefill worker checks them against its pin and answers
                 its pool's handle and layout, and the first token; a refusal (unknown engine
                 id or transfer, other block ids, another prompt) is a 400 here

Then, as the request's output stream (``generate``)::

    3 reserve    AsyncLLM.reserve: own prefix cache matched (those blocks are not pulled),
                 blocks for the rest
    4 get        one-sided batch get of remote blocks [cached // block_size:] into them
                 (kthena_comm shm or mooncake engine; ``transfer.BlockGetter``); where either
                 worker is a TP engine, each block's heads from the prefill ranks' pools into
                 this worker's ranks' pools (the lease names the prefill ranks' pools): a
                 synchronous copy over shm (``rank_pull.RankPull``), one-sided gets over
                 mooncake (``rank_pull.RankGet``)
    5 release    POST remote/pd/kv/release: the prefill worker frees its pin and says whether
                 it was still pinned all along (if not, the bytes may be stale: not used)
    6 admit      AsyncLLM.generate_prefilled(first token) and stream

A failed get or release, or an unreachable prefill worker, follows the deployment's policy:
``recompute`` (the decode worker computes the prompt itself) or ``fail`` (503). Blocks a
timed-out get might still write are kept aside for ``transfer_timeout_s`` before they are
freed, so nothing else reads them in between.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import attrs
import httpx

from kthena_comm.errors import TransferTimeoutError
from kthena_comm.transfer import MemoryHandle
from kthena_serve.async_engine import AsyncLLM
from kthena_serve.client import KVSession
from kthena_serve.cluster.auth import check_prefill_url, signed_json
from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.logprobs import TokenLogprobs
from kthena_serve.engine.request import EngineRequest, RequestOutput
from kthena_serve.engine.scheduled import Reservation
from kthena_serve.pd.config import FailurePolicy, PDConfig
from kthena_serve.pd.decode import HandoffError, prefill_client
from kthena_serve.pd.kv_params import PARAM, KVAsk, RemotePrefill, parse_kv_params, prompt_digest
from kthena_serve.pd.late_writes import LateWrites
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.pd.protocol import PoolRef
from kthena_serve.pd.rank_pull import RankGet, RankPull
from kthena_serve.pd.transfer import QUIET_S, BlockGetter
from mooncake_kv.layout import KVLayout

__all__ = ["DecodeConnector", "Lease"]

log = logging.getLogger(__name__)


@attrs.frozen
class Lease:
    """What the prefill worker answered to a lease: where to read, and the first token."""

    remote: RemotePrefill
    handle: MemoryHandle | None  # its pool for the one-sided get (None: ``source``)
    layout: KVLayout
    first_token_id: int
    first_token_logprobs: TokenLogprobs | None
    source: PoolRef | None = None  # a TP pair's: the prefill ranks' pools, copied head by head


class _Unavailable(Exception):
    """The prefill worker could not be asked (unreachable, timed out, 5xx)."""


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{PARAM}: {message}", PARAM)


class DecodeConnector:
    """``KVConnector`` of a decode worker (see the module docs).

    Args:
        engine: the started engine.
        getter: reads remote blocks into the engine's pool.
        config: policy and ``transfer_timeout_s``.
        metrics: where pulls, their bytes and failures go.
        secret: the deployment secret; calls to prefill workers are signed with it (never sent).
        prefill_hosts: hosts ``remote_host`` may name (the rest are a 400).
        client: the HTTP client for prefill workers (default: a new ``prefill_client()``).
        ranks: moves a TP pair's blocks head by head between the ranks' pools (shm with a
            cpu pool: ``RankPull``; mooncake: ``RankGet``); None: every pull is a ``getter``
            get, and a TP prefill worker is refused.
    """

    def __init__(self, engine: AsyncLLM, getter: BlockGetter, config: PDConfig,
                 metrics: PDMetrics, *, secret: str | None, prefill_hosts: Iterable[str],
                 client: httpx.AsyncClient | None = None,
                 ranks: RankPull | RankGet | None = None,
                 ) -> None:
        self.engine, self.getter, self.config, self.metrics = engine, getter, config, metrics
        self.ranks = ranks
        self.client = client or prefill_client()
        self._secret = secret
        self.prefill_hosts = frozenset(prefill_hosts)
        self.num_quarantined = 0
        self._tasks: set[asyncio.Task] = set()

    # ---- before anything streams -----------------------------------------------------------------
    async def open(self, params: Mapping[str, Any], request: EngineRequest, *,
                   stream: bool) -> KVSession | None:
        """Check the params and lease the KV they name.

        Raises:
            InvalidRequestError: bad fields, a foreign host, or a lease the prefill refused.
            HandoffError: the prefill worker cannot be asked and the policy is ``fail``.
        """
        ask, remote = parse_kv_params(params)
        if ask is KVAsk.NONE:
            return None
        if ask is KVAsk.REMOTE_DECODE or remote is None:
            raise _refuse("do_remote_decode asks for a prefill, and this is a decode worker; "
                          "send it to a prefill worker")
        try:
            check_prefill_url(remote.url, self.prefill_hosts)
        except ValueError as error:
            raise _refuse(f"remote_host/remote_port: {error}") from None
        try:
            lease = await self._lease(remote, request)
        except _Unavailable as error:
            self.count_failure("unreachable", str(error))
            lease = None  # recompute: the session computes the prompt here
        return _PulledDecode(self, lease)

    async def _lease(self, remote: RemotePrefill, request: EngineRequest) -> Lease:
        body = {"engine_id": remote.engine_id, "transfer_id": remote.transfer_id,
                "block_ids": list(remote.block_ids), "backend": self.getter.engine.backend,
                "prompt_digest": prompt_digest(request.prompt_ids)}
        reply = await self._post(remote, "/pd/kv/lease", body)
        if 400 <= reply.status_code < 500:
            raise _refuse(f"the prefill worker at {remote.url} refused it: "
                          f"{_message(reply)}")
        if reply.status_code != 200:
            raise _Unavailable(f"lease at {remote.url} answered {reply.status_code}: "
                               f"{_message(reply)}")
        try:
            return self._read_lease(remote, request, reply.json())
        except (KeyError, TypeError, ValueError) as error:
            raise _refuse(f"the prefill worker's lease is unusable here: {error}") from None

    def _read_lease(self, remote: RemotePrefill, request: EngineRequest,
                    data: dict[str, Any]) -> Lease:
        own = self.getter.layout
        tp = data.get("tp", 1)
        if remote.tp_size is not None and tp != remote.tp_size:
            raise ValueError(f"tp_size={remote.tp_size}, but the prefill worker at {remote.url} "
                             f"is a TP{tp} engine: send the kv_transfer_params of its answer "
                             "unchanged")
        handle = source = None
        if tp == 1 and (self.ranks is None or self.ranks.tp == 1):  # one pool into one
            handle = self._handle(data)
        elif self.ranks is None:
            raise ValueError(f"the prefill worker is a TP{tp} engine and this worker pulls "
                             f"over {self.getter.engine.backend} into a device pool: with TP "
                             "workers the Kthena connector path runs over --pd-transport "
                             "mooncake, or shm with cpu pools")
        else:
            source = self.ranks.source(data)
        num_prompt_blocks = -(-len(request.prompt_ids) // own.shape.block_size)
        if len(remote.block_ids) != num_prompt_blocks:
            raise ValueError(f"{len(remote.block_ids)} remote blocks for a prompt of "
                             f"{len(request.prompt_ids)} tokens ({num_prompt_blocks} blocks)")
        token = data["first_token_id"]
        if not isinstance(token, int) or not 0 <= token < self.engine.processor.limits.vocab_size:
            raise ValueError(f"first token {token!r} is outside the vocabulary")
        logprobs = data.get("first_token_logprobs")
        if request.params.logprobs is not None and logprobs is None:
            raise ValueError("the request asks for logprobs and its prefill did not (send "
                             "the same body to both workers)")
        return Lease(remote, handle, attrs.evolve(own, num_blocks=int(data["num_blocks"])),
                     token, TokenLogprobs.from_json(logprobs) if logprobs else None, source)

    def _handle(self, data: dict[str, Any]) -> MemoryHandle:
        """The prefill pool a tp=1 pair's get reads, checked against this worker's (unless
        this worker's get refuses every pull: it then says why, and the policy decides)."""
        if self.getter.local is None:  # a device pool over shm; a TP pool over mooncake
            return MemoryHandle.from_dict(data["handle"])
        own = self.getter.layout
        if data["fingerprint"] != own.shape.fingerprint() or data["kind"] != own.kind.value:
            raise ValueError(f"its KV blocks are {data['fingerprint']}/{data['kind']}, this "
                             f"worker's {own.shape.fingerprint()}/{own.kind.value}: run both "
                             "with the same model, dtype, --kv-cache-dtype and block size")
        handle = MemoryHandle.from_dict(data["handle"])
        if handle.backend != self.getter.engine.backend:
            raise ValueError(f"it serves KV over {handle.backend}, this worker pulls over "
                             f"{self.getter.engine.backend}: use one --pd-transport")
        return handle

    # ---- while streaming --------------------------------------------------------------------------
    async def pull(self, lease: Lease, rid: str, reserved: Reservation) -> str | None:
        """Get the blocks the reservation lacks, then release the pin; None on success, else
        why not. If the caller is cancelled, the reservation is freed once the get ends."""
        first = reserved.num_cached_tokens // self.getter.layout.shape.block_size
        src_ids, dst_ids = lease.remote.block_ids[first:], reserved.block_ids[first:]
        if lease.source is not None and self.ranks is not None:  # a TP pair: head by head
            move = functools.partial(self.ranks.copy, lease.source, src_ids, dst_ids)
        else:
            move = functools.partial(self.getter.get, lease.handle, lease.layout, src_ids,
                                     dst_ids)
        start = time.perf_counter()
        get = asyncio.ensure_future(asyncio.to_thread(move))
        try:
            num_bytes = await asyncio.shield(get)
        except asyncio.CancelledError:
            self._spawn(self._release_after(get, lease, rid))
            raise
        except TransferTimeoutError as error:  # the engine may still write: keep the blocks
            self._spawn(self._quarantine(rid, lease.remote))
            self._spawn(self.release_remote(lease))
            return f"timeout: {error}"
        except Exception as error:  # noqa: BLE001 - any failed get: the policy decides
            await self.engine.release(rid)
            self._spawn(self.release_remote(lease))
            return f"transfer: {type(error).__name__}: {error}"
        released = await self.release_remote(lease)
        if not released:
            await self.engine.release(rid)
            return "expired: the prefill worker's pin ended before the get was confirmed"
        self.metrics.observe_handoff(time.perf_counter() - start, num_bytes)
        return None

    async def release_remote(self, lease: Lease) -> bool:
        """Tell the prefill worker its pin is done; True if it was pinned until now."""
        try:
            reply = await self._post(lease.remote, "/pd/kv/release",
                                     {"transfer_id": lease.remote.transfer_id})
            return reply.status_code == 200 and reply.json().get("released") is True
        except (_Unavailable, ValueError):
            return False

    async def _post(self, remote: RemotePrefill, path: str, body: dict) -> httpx.Response:
        timeout = httpx.Timeout(self.config.transfer_timeout_s, connect=2.0)
        try:
            content, headers = signed_json(self._secret, path, body)
            return await self.client.post(f"{remote.url}{path}", content=content,
                                          headers=headers, timeout=timeout)
        except httpx.HTTPError as error:
            raise _Unavailable(f"prefill worker at {remote.url} ({path}): "
                               f"{type(error).__name__}: {error}") from None

    async def _release_after(self, get: asyncio.Future, lease: Lease, rid: str) -> None:
        await asyncio.gather(get, return_exceptions=True)
        await self.release_remote(lease)
        await self.engine.release(rid)

    async def _quarantine(self, rid: str, remote: RemotePrefill) -> None:
        """Free ``rid``'s blocks once nothing of its timed-out get can land any more: the get
        has ended in this process's engine (`BlockGetter.busy`), the prefill worker's sockets
        to this host hold no unacknowledged byte on two looks `QUIET_S` apart (or it is gone),
        and this process's hold nothing unread from it (`late_writes`). A TP pair's gets
        (`RankGet.busy`) count as the engine's."""
        self.num_quarantined += 1
        url = httpx.URL(remote.url)
        late = LateWrites(url.host, own_reads_except_port=url.port or 80)
        try:
            peer_settled = await self._peer_quiet(remote)
            while self.getter.busy() or (self.ranks is not None and self.ranks.busy()) \
                    or not late.drained(peer_settled):
                await asyncio.sleep(0.05)
            await self.engine.release(rid)
        finally:
            self.num_quarantined -= 1

    async def _peer_quiet(self, remote: RemotePrefill) -> bool:
        """Poll /pd/kv/backlog until the prefill worker has sent this host nothing it has not
        acknowledged, twice `QUIET_S` apart: True; False once it is gone (refused)."""
        quiet = 0
        while quiet < 2:
            try:
                content, headers = signed_json(self._secret, "/pd/kv/backlog", {})
                reply = await self.client.post(f"{remote.url}/pd/kv/backlog", content=content,
                                               headers=headers, timeout=1.0)
                unacked = reply.json().get("unacked") if reply.status_code == 200 else None
                quiet = quiet + 1 if unacked == 0 else 0
            except httpx.ConnectError:
                return False  # refused: gone
            except (httpx.TransportError, ValueError):
                quiet = 0  # slow or stopped: it may still send; ask again
            await asyncio.sleep(QUIET_S)
        return True

    def count_failure(self, reason: str, detail: str) -> None:
        """Count a failed pull; raise HandoffError when the policy is ``fail``."""
        policy = self.config.policy
        self.metrics.failure(policy.value, reason.split(":")[0])
        log.warning("KV pull failed (%s, policy %s): %s", reason, policy.value, detail)
        if policy is FailurePolicy.FAIL:
            raise HandoffError(f"the KV pull from the prefill worker failed "
                               f"({reason.split(':')[0]}) and this deployment's policy is "
                               "'fail'; retry the request")

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _PulledDecode:
    """One decode request whose prompt KV a prefill worker holds (or recomputes it)."""

    def __init__(self, connector: DecodeConnector, lease: Lease | None) -> None:
        self.connector, self.lease = connector, lease

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        c, rid = self.connector, request.request_id
        path = "local"
        reserved = None
        if self.lease is not None:
            reserved = await c.engine.reserve(request)
            if reserved is None:  # no seat or no blocks now: queue it as a plain request
                await c.release_remote(self.lease)
        if reserved is not None and self.lease is not None:
            failure = await c.pull(self.lease, rid, reserved)
            if failure is None:
                c.metrics.requests.labels(c.metrics.role, "pulled").inc()
                lease = self.lease
                async for out in c.engine.generate_prefilled(rid, lease.first_token_id,
                                                             lease.first_token_logprobs):
                    yield out
                return
            c.count_failure(failure, failure)
            path = "recomputed"
            if failure.startswith("timeout"):  # those blocks are quarantined under rid
                request = attrs.evolve(request, request_id=f"{rid}~recompute")
        elif self.lease is None:
            path = "recomputed"
        c.metrics.requests.labels(c.metrics.role, path).inc()
        async for out in c.engine.generate(request):
            yield attrs.evolve(out, request_id=rid)

    def response_params(self) -> dict[str, Any] | None:
        return None


def _message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:300]
