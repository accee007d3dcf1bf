"""The router: worker registry, health checks, KV-aware and load-aware picks, the PD decider.

::

    score(prefill p) = w_overlap * cached_blocks(p) / prompt_blocks
                     - w_load    * (running + waiting)(p) / max over prefill workers
                     - w_kv      * kv_usage(p)
    score(decode d)  = the same formula over decode workers: a returning conversation goes to
                       the decode worker that holds its prefix unless load outweighs it
    decider          : uncached tokens (prompt - decode's cached prefix) < threshold
                       -> no prefill worker, the decode worker computes the prompt

    with a shared store (--kv-offload ...,store=mooncake@...,write=through):
    cached_blocks(w) = pool(w) + STORE_CREDIT * (store - pool(w))   where store > pool(w)
                       for a worker whose /pd/state reports a store tier (it promotes
                       those blocks instead of computing them); the decider's cached prefix
                       is max(pool(d), store): a prompt the store holds but its last
                       blocks is short, and the decode worker promotes and computes it

Cached-block counts come from a ``ClusterPrefixIndex`` fed by every worker's KV events, which
the health loop polls (``/pd/state?since=seq``; a DP replica's ``/dp/state``) with each
worker's load (the reply: ``state_reply`` in cluster/worker.py).

Store residency is learnt from the same events (``shared_store``: a PD deployment whose
workers write their blocks through to one Mooncake Store): a worker that reports a store tier
puts each block it caches into the store, so its ``BlockStored`` events also go to the index under
``STORE`` (its ``BlockRemoved`` do not: a block evicted from a pool stays in the store). The
store evicts by itself and tells no one, and a worker that stops removes the keys it put, so
these counts are a hint: the router forgets them all when such a worker restarts, and an
entry the store dropped costs a worse pick (the worker computes the block), never wrong KV.

A worker that fails a poll or a request is marked down (no traffic) until a poll succeeds
again; a restarted worker (new incarnation) is forgotten in the index and re-learned from its
events. Every poll sends the deployment secret (cluster/auth.py).

``pick`` is the same score for workers that are whole engines (the data-parallel replicas of
``kthena serve --dp``): prefix overlap, then load, then KV usage, ties to the worker picked
least. There the router also counts what it sent and has not seen end (``done``), so load is
current between polls, and with ``remember`` it records a prompt's blocks on the worker it
picked at once, before that worker's events confirm them (or remove them, on eviction); a
worker that answers with an error drops them (``forget_remembered``), and the index's LRU
bound (``index_max_entries``) drops the rest if they are never confirmed.

The router reads three settings (``RouterSettings``: score weights, the decider's threshold,
the poll interval) of whatever config it is given; ``PDConfig`` has them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from typing import Protocol

import attrs
import httpx

from kthena_serve.cluster.auth import auth_headers
from kthena_serve.cluster.config import RouterWeights
from kthena_serve.cluster.events import event_from_json
from kthena_serve.cluster.metrics import RouterMetrics
from mooncake_kv import BlockRemoved, BlockStored, ClusterPrefixIndex, ExtraKeys
from mooncake_kv.cluster import DEFAULT_MAX_ENTRIES
from mooncake_kv.hashing import DEFAULT_HASH_ALGO

__all__ = ["STORE", "STORE_CREDIT", "Decision", "Pick", "Router", "RouterSettings",
           "WorkerState"]

log = logging.getLogger(__name__)

STORE = "mooncake_store"  # the index's instance for blocks in the shared Mooncake Store
STORE_CREDIT = 0.5  # a block promoted from the store counts half a pool hit (it is copied)


class RouterSettings(Protocol):
    """What the router reads of its config (``PDConfig`` has these fields)."""

    @property
    def weights(self) -> RouterWeights:
        """The score's weights."""

    @property
    def pd_threshold_tokens(self) -> int:
        """``choose``: a prompt with fewer uncached tokens skips the prefill worker."""

    @property
    def health_interval_s(self) -> float:
        """Seconds between two polls of every worker."""


@attrs.define
class WorkerState:
    name: str
    role: str
    url: str
    is_up: bool = False
    incarnation: str | None = None
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    seq: int = 0
    kv: dict = attrs.field(factory=dict)
    stats: dict | None = None  # the worker's EngineStats as JSON (measured there)
    limits: dict | None = None  # a decode worker's EngineLimits as JSON
    num_in_flight: int = 0  # requests ``pick`` sent here that have not been ``done`` yet
    num_picked: int = 0  # times ``pick`` chose it (the tie-break)
    has_store: bool = False  # its stats report a Mooncake Store tier (it promotes from it)

    @property
    def load(self) -> int:
        """Running + waiting as last polled; at least what the router sent and saw no end of
        (the poll lags by an interval)."""
        return max(self.num_running + self.num_waiting, self.num_in_flight)


@attrs.frozen
class Decision:
    decode: WorkerState
    prefill: WorkerState | None
    reason: str  # disaggregated | short_prompt | no_prefill_worker
    num_cached_blocks: int  # on the decode worker
    num_store_blocks: int = 0  # more leading blocks it can promote from the store


@attrs.frozen
class Pick:
    worker: WorkerState
    num_cached_blocks: int  # leading blocks of the prompt the index has on it
    reason: str  # prefix (it holds part of the prompt) | load
    remembered: tuple = ()  # block hashes ``remember`` recorded on it (``refused`` drops them)


class Router:
    """Chooses workers for each request (see module docs). Thread-safe.

    Args:
        workers: (name, role, url) of each worker (``ProcessLauncher.endpoints()``).
        config: the router's settings (a ``PDConfig``, or any ``RouterSettings``).
        block_size: tokens per KV block, as on the workers.
        metrics: where router metrics go (default: a registry of its own).
        secret: the deployment secret sent on every poll (``ProcessLauncher.secret``).
        state_path: the workers' state route (``/pd/state``; DP replicas: ``/dp/state``).
        hash_algo: the workers' block-hash algorithm (``EngineConfig.hash_algorithm``).
        index_max_entries: (worker, block) entries the prefix index keeps at most (its LRU
            bound; evictions the workers announce remove entries before that).
        shared_store: the workers write every block they cache through to one store (PD
            with ``--kv-offload ...,store=...,write=through``): count its blocks (module docs).
    """

    def __init__(self, workers: list[tuple[str, str, str]], config: RouterSettings,
                 block_size: int, metrics: RouterMetrics | None = None, *,
                 secret: str | None = None, state_path: str = "/pd/state",
                 hash_algo: str = DEFAULT_HASH_ALGO,
                 index_max_entries: int = DEFAULT_MAX_ENTRIES,
                 shared_store: bool = False) -> None:
        self.config = config
        self.shared_store = shared_store
        self.block_size = block_size
        self.metrics = metrics or RouterMetrics("router")
        self.state_path = state_path
        self.index = ClusterPrefixIndex(block_size, hash_algo, max_entries=index_max_entries)
        self.workers = {name: WorkerState(name, role, url) for name, role, url in workers}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = httpx.Client(timeout=2.0, headers=auth_headers(secret))

    # ---- health loop ------------------------------------------------------------------------
    def start(self) -> Router:
        """Poll every worker once, then on a daemon thread every ``health_interval_s``."""
        self.poll_all()
        self._thread = threading.Thread(target=self._loop, name="kthena-pd-health", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop polling and close the HTTP client."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._client.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            self.poll_all()

    def poll_all(self) -> None:
        """Poll every worker now."""
        for worker in list(self.workers.values()):
            self.poll(worker)

    def poll(self, worker: WorkerState) -> None:
        """Read ``worker``'s state and KV events since the last poll; down if that fails."""
        try:
            reply = self._client.get(f"{worker.url}{self.state_path}",
                                    params={"since": worker.seq})
            reply.raise_for_status()
            state = reply.json()
        except (httpx.HTTPError, ValueError):
            self.mark_down(worker.name)
            return
        with self._lock:
            restarted = worker.incarnation is not None \
                and state["incarnation"] != worker.incarnation
            if state["incarnation"] != worker.incarnation or state["first_seq"] > worker.seq + 1:
                if worker.name in self.index.instances():  # restarted, or events were lost
                    self.index.remove_instance(worker.name)
                worker.incarnation, worker.seq = state["incarnation"], 0
                state["events"] = [] if state["first_seq"] > 1 else state["events"]
            if worker.name not in self.index.instances():
                self.index.add_instance(worker.name)
            events = [event_from_json(e) for e in state["events"]]
            self.index.apply_all(worker.name, events)
            worker.seq = state["last_seq"]
            worker.num_running, worker.num_waiting = state["num_running"], state["num_waiting"]
            kv = state.get("kv") or {}
            worker.kv = kv
            worker.kv_usage = kv.get("num_used_blocks", 0) / max(kv.get("num_blocks", 1), 1)
            worker.stats = state.get("stats", worker.stats)
            self._learn_store(worker, events, restarted)
            worker.limits = state.get("limits", worker.limits)
            worker.is_up = bool(state.get("alive", True))
        self.metrics.set_up(worker.name, worker.is_up)

    def _learn_store(self, worker: WorkerState, events: list, restarted: bool) -> None:
        """Its stored blocks are in the store too (see module docs); holding ``_lock``."""
        worker.has_store = self.shared_store and any(
            t.get("tier") == STORE for t in (worker.stats or {}).get("kv_tiers", ()))
        if not worker.has_store:
            return
        if restarted and STORE in self.index.instances():  # it removed its keys on the way
            self.index.remove_instance(STORE)
        self.index.apply_all(STORE, [e for e in events if isinstance(e, BlockStored)])

    def mark_down(self, name: str) -> None:
        """No traffic to ``name`` until a poll of it succeeds."""
        with self._lock:
            worker = self.workers[name]
            if worker.is_up:
                log.warning("worker %s is down", name)
            worker.is_up = False
        self.metrics.set_up(name, False)

    def set_url(self, name: str, url: str) -> None:
        """Where ``name`` listens now (a restarted worker: ``ProcessLauncher.on_restart``)."""
        with self._lock:
            self.workers[name].url = url

    # ---- choosing -----------------------------------------------------------------------------
    def up(self, role: str) -> list[WorkerState]:
        """The workers of ``role`` that are up."""
        return [w for w in self.workers.values() if w.role == role and w.is_up]

    def choose(self, prompt_ids: list[int], cache_salt: str | None = None) -> Decision:
        """Pick (decode, prefill or None) for a prompt: the PD decider.

        Raises:
            LookupError: no decode worker is up.
        """
        decision = self.preview(prompt_ids, cache_salt)
        self.metrics.decision(decision.reason)
        return decision

    def preview(self, prompt_ids: list[int], cache_salt: str | None = None) -> Decision:
        """What ``choose`` would pick now, counting nothing (the PD router's admission asks
        which path, a prefill worker or the decode worker's own core, a prompt will take).

        Raises:
            LookupError: no decode worker is up.
        """
        with self._lock:
            decodes, prefills = self.up("decode"), self.up("prefill")
            if not decodes:
                raise LookupError("no decode worker is up")
            cached = self.index.match(prompt_ids, _salt(cache_salt))
            num_blocks = self._num_blocks(prompt_ids)
            decode = max(decodes, key=lambda w: self._score(
                w, decodes, _overlap(w, cached) / num_blocks))
            decode_cached = cached.get(decode.name, 0)
            from_store = max(0, cached.get(STORE, 0) - decode_cached) if decode.has_store else 0
            uncached = len(prompt_ids) - (decode_cached + from_store) * self.block_size
            if not prefills:
                reason, prefill = "no_prefill_worker", None
            elif uncached < self.config.pd_threshold_tokens:
                reason, prefill = "short_prompt", None
            else:
                reason = "disaggregated"
                prefill = max(prefills, key=lambda w: self._score(
                    w, prefills, _overlap(w, cached) / num_blocks))
        return Decision(decode, prefill, reason, decode_cached, from_store)

    def _score(self, worker: WorkerState, peers: list[WorkerState], overlap: float) -> float:
        w = self.config.weights
        max_load = max(max(p.load for p in peers), 1)
        return w.overlap * overlap - w.load * worker.load / max_load - w.kv_usage * worker.kv_usage

    def pick(self, role: str, prompt_ids: list[int], cache_salt: str | None = None, *,
             remember: bool = False, exclude: Collection[str] = ()) -> Pick:
        """The worker of ``role`` with the best score for a prompt (ties: the one picked least),
        counted in flight until ``done``.

        Args:
            remember: record the prompt's full blocks as held by the chosen worker now (its
                KV events confirm them, or remove them when it evicts them).
            exclude: names not to pick (a replica that refused the request, or reports a queue
                past its bound).

        Raises:
            LookupError: no worker of ``role`` is up (or every one is excluded).
        """
        with self._lock:
            peers = [w for w in self.up(role) if w.name not in exclude]
            if not peers:
                raise LookupError(f"no {role} worker is up")
            hashes = self.index.hasher.hash_tokens(prompt_ids, _salt(cache_salt))
            cached = self.index.match_hashes(hashes)
            num_blocks = self._num_blocks(prompt_ids)
            best = max(peers, key=lambda w: (
                self._score(w, peers, _overlap(w, cached) / num_blocks), -w.num_picked))
            best.num_picked += 1
            best.num_in_flight += 1
            num_cached = cached.get(best.name, 0)
            remembered = tuple(hashes[num_cached:]) if remember else ()
            if remembered:
                self.index.apply(best.name, BlockStored(tuple(hashes), None, (),
                                                        self.block_size, ()))
        return Pick(best, num_cached, "prefix" if num_cached else "load", remembered)

    def done(self, name: str) -> None:
        """A request ``pick`` sent to ``name`` has ended (finished, failed or cancelled)."""
        with self._lock:
            worker = self.workers[name]
            worker.num_in_flight = max(0, worker.num_in_flight - 1)

    def refused(self, pick: Pick) -> None:
        """``pick``'s worker refused the request before doing any of it (its queue is past its
        bound): it is not in flight there, and the blocks ``pick`` recorded on it are dropped."""
        self.done(pick.worker.name)
        self.forget_remembered(pick)

    def forget_remembered(self, pick: Pick) -> None:
        """Drop the blocks ``pick`` recorded on its worker: the worker answered without
        computing the prompt (a 4xx or 5xx), so it will never store (nor evict) them."""
        if pick.remembered:
            self.index.apply(pick.worker.name, BlockRemoved(pick.remembered, ()))

    def _num_blocks(self, prompt_ids: list[int]) -> int:
        return max(1, -(-len(prompt_ids) // self.block_size))


def _overlap(worker: WorkerState, cached: dict[str, int]) -> float:
    """Leading prompt blocks ``worker`` need not compute, the store's counted at
    ``STORE_CREDIT`` where it has a store tier (module docs)."""
    own = cached.get(worker.name, 0)
    if not worker.has_store:
        return own
    return own + STORE_CREDIT * max(0, cached.get(STORE, 0) - own)


def _salt(cache_salt: str | None) -> ExtraKeys | None:
    return ExtraKeys(cache_salt=cache_salt) if cache_salt else None
