"""Prefill executor: chunked paged prefills of several requests batched into one forward.

Same host (``shm``): the decode worker's pool is a POSIX shared-memory file (on cuda: its device
memory, through CUDA IPC); this process maps it once (decode_pools.py, over pool_share.py's
``open_pool``, the one device-specific piece) and the model's paged prefill writes each new
token's K/V at ``slot = block_ids[pos // block_size] * block_size + pos % block_size`` of
*that* pool. The decode worker's cached prefix (``num_cached_tokens``) is read in place as
attention context, so it is neither recomputed nor copied. Nothing but the first token goes
back.

Across hosts (``mooncake``): the prefill worker computes into its own pool, with its own prefix
cache (a prefill-side hit skips those tokens), then ``put_blocks`` moves the blocks the decode
worker lacks into its registered pool (see transfer.py).

Behind the Kthena router (``submit_owned``): the prefill comes first and names no decode
worker, so the prompt goes into the own pool and its blocks stay held until a decode worker has
pulled them (one-sided get) or a timeout passes (pins.py, prefill_connector.py).

Batching. Every prefill is a request of the engine's one ``Scheduler`` (scheduler.py), run
by steps on the worker's single compute thread (the owner of the own pool's KV manager), with
the scheduler's PD prefill policy::

    step: schedule  a decode worker's prompt runs over the block table it sent (external: no
                    KV verb here); an own-pool prompt is admitted with its prefix matched and
                    its blocks allocated chunk by chunk; a step holds prompts of one pool only;
                    max_num_batched_tokens and max_num_seqs as in the engine
          run       one ModelRunner.execute(batch)   (the engine's runner)
          finish    each prompt whose last chunk ran samples its first token, is set aside from
                    the schedule and hands off alone: shm -> the result; owned -> commit,
                    blocks held until ``free``; mooncake -> commit, then put + free on a
                    hand-off thread (the next forward does not wait for the put)

A job fails alone: a pool too small for it even when every block that will come back has
(rejected: MemoryError), its hand-off (put), or its cancellation (dropped at the next step
boundary, its blocks freed) touch no batch-mate; only a failed forward fails the jobs in it.
Each step is its own compute-thread call, so frees and other calls queued there run between
steps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kthena_serve.engine.assembly import create_kv_manager
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.grammar import Grammars
from kthena_serve.engine.logprobs import TokenLogprobs, gather_logprobs
from kthena_serve.engine.model_runner import ModelRunner, Runner, create_pool
from kthena_serve.engine.request import Request
from kthena_serve.engine.sampler import Sampler
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.scheduled import ScheduledBatch, ScheduledSeq
from kthena_serve.engine.scheduler import Scheduler
from kthena_serve.pd.decode_pools import DecodePools
from kthena_serve.pd.prefill_job import PrefillJob
from kthena_serve.pd.protocol import PoolRef, PrefillResult, PrefillTask, params_from_json
from kthena_serve.pd.transfer import BlockPush
from mooncake_kv import KVCacheManager
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool

if TYPE_CHECKING:
    from kthena_serve.engine.stats import KVTierStats
    from mooncake_kv.tiers import AsyncOffloader

__all__ = ["ExecutorClosedError", "OwnedPrefill", "PrefillCancelled", "PrefillExecutor"]


class PrefillCancelled(Exception):
    """The prefill was cancelled (``PrefillExecutor.cancel``) before it finished."""


class ExecutorClosedError(RuntimeError):
    """The executor is closing (the worker stops): no prefill is taken or finished."""


@attrs.frozen
class OwnedPrefill:
    """A prompt prefilled into the worker's own pool; its blocks are held until ``free``."""

    token_id: int
    logprobs: TokenLogprobs | None
    block_ids: tuple[int, ...]
    num_cached_tokens: int  # what this worker's own prefix cache supplied
    compute_s: float


class PrefillExecutor:
    """Runs prefill jobs in batched steps on its one compute thread (see the module docs).

    Args:
        model: the loaded model (same weights and dtype as the decode worker's).
        config: block size, dtype, the step budget (``max_num_batched_tokens``, and at most
            ``max_num_seqs`` prompts per forward); also the size of this worker's own pool.
        own_pool: the local pool and prefix cache (the cross-host path, and the prompts a
            decode worker pulls: ``submit_owned``); True makes a private pool, a callable
            ``layout -> KVPool`` makes it where the caller wants (a served shm segment).
        on_batch: called after every forward with (prompts in it, tokens computed): metrics.
        eos_token_ids: the tokenizer's EOS ids (masked while a request is short of its
            ``min_tokens``, as the engine's sampler does).
        grammars: the model's compiled-grammar cache (``grammar.Grammars``): a request with
            ``structured_outputs`` samples its first token under its grammar (the decode
            worker's matcher then starts from that token); None: such requests fail.
        runner: the own pool's runner, built by the caller (a TP worker's
            ``ParallelModelRunner``, whose ranks hold the own pool); ``own_pool`` is then not
            used. Its jobs are own-pool jobs (``submit_local``, ``submit_owned``) only.

    Raises:
        ValueError: no own pool.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, *,
                 own_pool: bool | Callable[[KVLayout], KVPool] = True,
                 on_batch: Callable[[int, int], None] | None = None,
                 eos_token_ids: Sequence[int] = (), grammars: Grammars | None = None,
                 runner: Runner | None = None) -> None:
        self.model = model
        self.config = config
        self.sampler = Sampler(config.device, eos_token_ids=eos_token_ids)
        self.grammars = grammars
        self.on_batch = on_batch
        self._pools = DecodePools(model, config)  # shm: the decode pools mapped here
        self._lock = threading.RLock()  # the queue, the in-flight set, the decode pools
        self._queue: list[PrefillJob] = []
        self._in_flight: frozenset[str] = frozenset()
        self._step_pending = False
        self._closing: str | None = None
        self._compute = concurrent.futures.ThreadPoolExecutor(1, "kthena-prefill")
        self._handoff = concurrent.futures.ThreadPoolExecutor(4, "kthena-prefill-handoff")
        # submit_local's pushes until none of their puts may land any more (see cancel)
        self._pushes: dict[str, BlockPush] = {}
        self._handing_off: set[str] = set()  # rids whose hand-off has not returned
        self.num_steps = self.num_computed_tokens = 0  # reported in /pd/state
        if not own_pool:
            raise ValueError("a prefill executor needs its own pool (own_pool=True or a "
                             "layout -> KVPool function): its scheduler's KV manager")
        if runner is not None:
            self.runner: Runner = runner
            layout = runner.pool.layout
        else:
            layout = self.layout_for(config.num_kv_blocks or 1024)
            make = own_pool if callable(own_pool) else lambda lay: create_pool(lay, config)
            self.runner = ModelRunner(model, make(layout))
        self.kv: KVCacheManager = create_kv_manager(config, layout.num_blocks)
        self.offloader = _open_offloader(config, self.runner, self.kv)
        self._jobs: dict[str, PrefillJob] = {}  # the scheduler's requests (compute thread)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   offloader=self.offloader,
                                   promote_timeout_s=(config.kv_offload.promote_timeout_s
                                                      if config.kv_offload else 5.0),
                                   batch_key=lambda request: id(self._jobs[request.request_id]
                                                                .runner))

    @property
    def pool(self) -> KVPool:
        """This worker's own pool."""
        return self.runner.pool

    def layout_for(self, num_blocks: int, block_size: int | None = None,
                   dtype: str | None = None, kv_cache_dtype: str | None = None) -> KVLayout:
        """The layout of a pool of ``num_blocks`` (``DecodePools.layout_for``: a decode
        worker's block size, dtype and KV dtype, this worker's own where not given).

        Raises:
            ValueError: the pool's KV dtype is not the one this worker computes.
        """
        return self._pools.layout_for(num_blocks, block_size, dtype, kv_cache_dtype)

    def kv_tier_stats(self) -> tuple[KVTierStats, ...]:
        """Per-tier numbers of the own pool's ``--kv-offload`` (empty without it); any thread."""
        if self.offloader is None:
            return ()
        from kthena_serve.engine.kv_offload import tier_stats

        return tier_stats(self.offloader.snapshot())

    def num_queued_running(self) -> tuple[int, int]:
        """(jobs waiting for their first chunk, jobs with a chunk picked) (any thread)."""
        with self._lock:
            running = sum(j.started is not None for j in self._queue)
            return len(self._queue) - running, running

    # ---- submitting (any thread) ---------------------------------------------------------------
    def submit_shared(self, task: PrefillTask) -> concurrent.futures.Future:
        """Prefill into the decode pool ``task.pool`` names on this host (zero copy: a shm
        file, or CUDA memory through CUDA IPC; pool_share.py opens it).

        Returns a future of the ``PrefillResult``. Raises ValueError for a bad task.
        """
        task.check()
        runner = self._attach(task.pool)
        request = Request(task.request_id, task.token_ids, params_from_json(task.params))
        request.num_computed_tokens = request.num_cached_tokens = task.num_cached_tokens
        return self._submit(PrefillJob(request, runner, self._finish_shared,
                                       concurrent.futures.Future(), tuple(task.block_ids),
                                       task.num_cached_tokens))

    def submit_local(self, task: PrefillTask, push: BlockPush) -> concurrent.futures.Future:
        """Prefill into this worker's pool (own prefix cache) and ``push`` the blocks the decode
        worker does not hold yet (everything from ``task.num_cached_tokens`` on) into
        ``task.block_ids``: layer by layer while the prefill runs (``push.layerwise``), or all
        at once after it; a failed push fails this request alone. Returns a future of the
        ``PrefillResult`` (set once the last put has landed).
        """
        task.check()

        def finish(job: PrefillJob, token: int, logprobs: TokenLogprobs | None) -> PrefillResult:
            return self._finish_local(job, token, logprobs, task, push)

        job = self._owned_job(task.request_id, task.token_ids, params_from_json(task.params),
                              task.cache_salt, finish)
        if push.layerwise:
            job.push, job.push_dst = push, tuple(task.block_ids)
            job.num_pushed = task.num_cached_tokens // task.pool.block_size
        future = self._submit(job)
        with self._lock:
            for rid in [rid for rid in self._pushes if not self._is_writing(rid)]:
                del self._pushes[rid]
            self._pushes[task.request_id] = push
        return future

    def submit_owned(self, rid: str, token_ids: Sequence[int], params: SamplingParams,
                     cache_salt: str | None = None) -> concurrent.futures.Future:
        """Prefill into this worker's pool (its prefix cache honoured) and sample one token.

        Returns a future of the ``OwnedPrefill``; it raises MemoryError when the pool has no
        room for the prompt. The prompt's blocks stay held by ``rid`` (committed, so later
        prompts can share them) until ``free(rid)``: a decode worker pulls them in between.
        """
        return self._submit(self._owned_job(rid, token_ids, params, cache_salt,
                                            self._finish_owned))

    def _owned_job(self, rid: str, token_ids: Sequence[int], params: SamplingParams,
                   cache_salt: str | None, finish: Callable) -> PrefillJob:
        request = Request(rid, token_ids, params, cache_salt=cache_salt)
        return PrefillJob(request, self.runner, finish, concurrent.futures.Future())

    def _submit(self, job: PrefillJob) -> concurrent.futures.Future:
        with self._lock:
            if self._closing is not None:
                raise ExecutorClosedError(self._closing)
            if any(j.rid == job.rid for j in self._queue):
                raise ValueError(f"request id {job.rid!r} is already being prefilled; "
                                 "pick a unique id")
            self._queue.append(job)
            self._kick()
        return job.future

    def cancel(self, rid: str) -> bool:
        """Drop ``rid`` at the next step boundary (its future raises ``PrefillCancelled``).

        Returns True while a forward that writes its KV is running, or a put of its KV into
        a decode pool may still land (its hand-off runs, or a put it gave up waiting for
        still does: a partitioned link delivers it when it heals); ask again. False once
        nothing of it runs any more (or it is not here): only then may its blocks be reused.
        """
        with self._lock:
            queued = False
            for job in self._queue:
                if job.rid == rid:
                    queued = job.cancelled = True
                    if rid not in self._in_flight:
                        self._kick()
            writing = self._is_writing(rid)
            if not writing and not queued:
                self._pushes.pop(rid, None)
            return rid in self._in_flight or writing

    def _is_writing(self, rid: str) -> bool:
        """Whether a put of ``rid``'s KV may be running or about to start (holding ``_lock``)."""
        push = self._pushes.get(rid)
        return push is not None and (rid in self._handing_off or not push.settled())

    def call(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the compute thread, between steps (the own KV manager's owner)."""
        return self._compute.submit(fn, *args)

    def free(self, rid: str) -> None:
        """Give back the blocks ``submit_owned`` left held (compute thread only: ``call``)."""
        with self._lock:
            self.scheduler.free_set_aside(rid)
            self._kick()  # a prompt may wait for these blocks

    def _attach(self, ref: PoolRef) -> ModelRunner:
        """A runner over the decode worker's pool (mapped once per pool: decode_pools.py)."""
        key, layout = self._pools.check(ref)  # PoolShareError (a ValueError): no pool here
        with self._lock:
            return self._pools.runner(ref, key, layout, {id(j.runner) for j in self._queue})

    # ---- one step (compute thread) -------------------------------------------------------------
    def _kick(self) -> None:
        """Queue a step on the compute thread unless one is queued (holding ``_lock``)."""
        if self._queue and not self._step_pending and self._closing is None:
            self._step_pending = True
            self._compute.submit(self._step)

    def _step(self) -> None:
        """Schedule a batch, run one forward, finish the jobs whose last chunk ran."""
        with self._lock:  # held throughout: a cancel sees either "in flight" or "dropped"
            self._step_pending = False
            dropped = [j for j in self._queue if j.cancelled]
            for job in dropped:
                self._queue.remove(job)
                self._unschedule(job)
            for job in self._queue:
                if not job.in_scheduler:
                    self._schedule(job)
            batch = self.scheduler.schedule()
            jobs = [self._jobs[seq.request_id] for seq in batch.seqs]
            now = time.perf_counter()
            for job in jobs:
                job.started = job.started or now  # running from now on
            self._in_flight = frozenset(job.rid for job in jobs)
        for job in dropped:
            self._end(job, PrefillCancelled(f"prefill of {job.rid} was cancelled"))
        for rid in batch.rejected:  # the scheduler has let it go, blocks and all
            job = self._jobs[rid]
            job.in_scheduler = False
            self._end(job, MemoryError("the prefill worker's pool is full; retry or grow it"))
        try:
            if batch.seqs:
                self._run(batch, jobs)
        finally:
            with self._lock:
                self._in_flight = frozenset()
                # a promotion under way: the next schedule takes it once done (or waits for
                # it); else every job waits for blocks, and a free kicks again
                if batch.seqs or dropped or batch.rejected or self.scheduler.promoting:
                    self._kick()

    def _schedule(self, job: PrefillJob) -> None:
        """Hand ``job``'s request to the scheduler (compute thread, holding ``_lock``)."""
        self._jobs[job.rid] = job
        if job.shared_blocks is not None:
            self.scheduler.add_external(job.request, job.shared_blocks)
        else:
            self.scheduler.add(job.request)
        job.in_scheduler = True

    def _unschedule(self, job: PrefillJob) -> None:
        """Take ``job`` out of the scheduler, freeing its own-pool blocks (compute thread)."""
        if job.in_scheduler:
            self.scheduler.abort(job.rid)
        elif job.holds_blocks:
            self.scheduler.free_set_aside(job.rid)
        job.in_scheduler = job.holds_blocks = False

    def _run(self, batch: ScheduledBatch, jobs: list[PrefillJob]) -> None:
        start = time.perf_counter()
        try:
            logits = self._execute(jobs[0].runner, batch, self._layer_pushes(batch.seqs, jobs))
        except Exception as error:  # noqa: BLE001 - the forward's jobs fail, the worker goes on
            for job in jobs:
                self._end(job, error)
            return
        self.scheduler.update(batch)
        ended = time.perf_counter()
        spent = ended - start
        self.num_steps += 1
        self.num_computed_tokens += batch.num_tokens
        if self.on_batch is not None:
            self.on_batch(len(batch.seqs), batch.num_tokens)
        row = 0
        for seq, job in zip(batch.seqs, jobs, strict=True):
            job.compute_s += spent
            job.forward_end = ended
            if seq.is_sampled:
                if not job.cancelled:  # a cancelled one is dropped at the next step
                    self._complete(job, logits[row : row + 1])
                row += 1

    @staticmethod
    def _execute(runner, batch: ScheduledBatch,  # noqa: ANN001 - a Runner
                 pushes: list[tuple[BlockPush, tuple[int, ...], tuple[int, ...]]],
                 ) -> torch.Tensor:
        """The step's forward with its layer-wise pushes: in the model's per-layer hook, or, on
        a TP runner (``takes_layer_copies``), as copies its ranks run in their own forwards
        (``ReshardCopy.layer_copy``; settled again once the forward has returned)."""
        if not pushes or not getattr(runner, "takes_layer_copies", False):
            return runner.execute(batch, _layer_hook(pushes))
        try:
            return runner.execute(batch, copies=[push.layer_copy(src, dst)
                                                 for push, src, dst in pushes])
        finally:
            for push, _src, _dst in pushes:
                push.step_done()

    def _layer_pushes(self, seqs: Sequence[ScheduledSeq], jobs: list[PrefillJob],
                      ) -> list[tuple[BlockPush, tuple[int, ...], tuple[int, ...]]]:
        """This step's layer-wise pushes: (push, source blocks, destination blocks).

        A job pushes the blocks this step completes (all its blocks on its last chunk): each
        block of each layer goes out once, after its last token's K/V is written.
        """
        pushes = []
        size = self.config.block_size
        for seq, job in zip(seqs, jobs, strict=True):
            if job.push is None:
                continue
            end = seq.start + len(seq.token_ids)
            stop = -(-end // size) if end == len(job.token_ids) else end // size
            if stop > job.num_pushed:
                pushes.append((job.push, job.block_ids[job.num_pushed:stop],
                               job.push_dst[job.num_pushed:stop]))
                job.num_pushed = stop
        return pushes

    def _complete(self, job: PrefillJob, logits: torch.Tensor) -> None:
        """Sample the job's first token and hand it off; any failure is this job's alone."""
        try:
            token = int(self.sampler(logits, [job.request], self._bitmask(job))[0])
            logprobs = gather_logprobs(logits, [job.request], [token])[0]
            result = job.finish(job, token, logprobs)
        except Exception as error:  # noqa: BLE001 - reported through its future
            self._end(job, error)
            return
        finally:
            self.sampler.forget(job.rid)
        self._end(job, None, result)

    def _bitmask(self, job: PrefillJob) -> torch.Tensor | None:
        """The first token's bitmask under the job's grammar (None without one)."""
        spec = job.params.structured_outputs
        if spec is None:
            return None
        if self.grammars is None:
            raise ValueError("this prefill executor has no grammars for structured_outputs")
        return self.grammars.fill_bitmask([self.grammars.matcher(spec)])

    def _end(self, job: PrefillJob, error: BaseException | None, result: Any = None) -> None:
        """Take the job off the queue and settle its future; a failed job leaves the scheduler
        (its own-pool blocks freed). Compute thread."""
        with self._lock:
            if job in self._queue:
                self._queue.remove(job)
            if error is not None:
                self._unschedule(job)
            self._jobs.pop(job.rid, None)
        if job.future.done():  # failed by close() meanwhile
            return
        if error is not None:
            job.future.set_exception(error)
        elif isinstance(result, concurrent.futures.Future):  # a hand-off still running
            result.add_done_callback(lambda done: _settle(job.future, done))
        else:
            job.future.set_result(result)

    # ---- how each kind of job ends (compute thread) --------------------------------------------
    def _finish_shared(self, job: PrefillJob, token: int, logprobs: TokenLogprobs | None,
                       ) -> PrefillResult:
        self._set_aside(job, returning=False)  # the decode worker's blocks: nothing held here
        return PrefillResult(job.rid, token, len(job.token_ids) - job.num_cached, job.compute_s,
                             0.0, 0, first_token_logprobs=logprobs)

    def _finish_owned(self, job: PrefillJob, token: int, logprobs: TokenLogprobs | None, *,
                      returning: bool = False) -> OwnedPrefill:
        self.kv.commit(job.rid, job.token_ids)
        job.num_cached = job.request.num_cached_tokens or 0
        self._set_aside(job, returning=returning)
        return OwnedPrefill(token, logprobs, job.block_ids, job.num_cached, job.compute_s)

    def _set_aside(self, job: PrefillJob, *, returning: bool) -> None:
        """Off the schedule, its own-pool blocks still held (pinned, or until the handoff)."""
        self.scheduler.set_aside(job.rid, returning=returning)
        job.in_scheduler, job.holds_blocks = False, job.is_owned

    def _finish_local(self, job: PrefillJob, token: int, logprobs: TokenLogprobs | None,
                      task: PrefillTask, push: BlockPush) -> concurrent.futures.Future:
        """Commit, then finish the push on a hand-off thread (the next forward does not wait
        for it: it puts the blocks, or waits for the layer puts) and free the blocks (also
        when the push fails)."""
        owned = self._finish_owned(job, token, logprobs, returning=True)
        first = task.num_cached_tokens // task.pool.block_size
        with self._lock:
            self._handing_off.add(job.rid)

        def handoff() -> PrefillResult:  # handoff_s: from the end of its last forward
            try:
                num_bytes = push.finish(owned.block_ids[first:], task.block_ids[first:])
            finally:
                with self._lock:
                    self._handing_off.discard(job.rid)
                with contextlib.suppress(RuntimeError, concurrent.futures.CancelledError):  # stopping
                    self.call(self.free, job.rid).result()
            return PrefillResult(job.rid, token, len(job.token_ids) - job.num_cached,
                                 job.compute_s, time.perf_counter() - job.forward_end, num_bytes,
                                 job.num_cached, logprobs)

        future = self._handoff.submit(handoff)
        job.holds_blocks = False  # the hand-off frees them from here on
        return future

    def close(self) -> None:
        """Fail what is queued, stop the compute thread, unmap and close the pools."""
        with self._lock:
            self._closing = "the prefill worker is stopping"
            queue, self._queue = self._queue, []
        for job in queue:
            if not job.future.done():
                job.future.set_exception(ExecutorClosedError(self._closing))
        self._compute.shutdown(wait=True, cancel_futures=True)
        self._handoff.shutdown(wait=True, cancel_futures=True)
        if self.offloader is not None:
            from kthena_serve.engine.kv_offload import close_offloader

            close_offloader(self.offloader)  # its threads read the own pool: stop them first
        self._pools.close()
        self.runner.close()


def _open_offloader(config: EngineConfig, runner: Runner, kv: KVCacheManager,
                    ) -> AsyncOffloader | None:
    """The own pool's ``--kv-offload`` tiers (None without): blocks this worker commits go
    to them (to the store at once: PD takes ``write=through``), and an own-pool prompt whose
    blocks miss here is promoted from them before it is computed (the scheduler's
    ``Promotions``). A TP worker's blocks go in the one-rank layout, merged from its ranks'
    pools (``engine.rank_blocks``), so a worker of any TP size reads them. A /pd/prefill over
    shm writes the decode worker's pool, whose engine offloads those blocks itself."""
    if config.kv_offload is None:
        return None
    from kthena_serve.engine.kv_offload import open_offloader

    return open_offloader(config, runner, kv)


def _settle(future: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
    """Give ``future`` the outcome of ``done`` (a finished hand-off)."""
    if future.done():
        return
    if done.cancelled():
        future.set_exception(ExecutorClosedError("the prefill worker is stopping"))
    elif done.exception() is not None:
        future.set_exception(done.exception())
    else:
        future.set_result(done.result())


def _layer_hook(pushes: Sequence[tuple[BlockPush, Sequence[int], Sequence[int]]],
                ) -> Callable[[int], None] | None:
    """The model's per-layer hook that starts each push's layer (None: no push)."""
    if not pushes:
        return None

    def on_layer(layer: int) -> None:
        for push, src, dst in pushes:
            push.push_layer(layer, src, dst)

    return on_layer
