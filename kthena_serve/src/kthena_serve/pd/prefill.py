"""Prefill executor: paged prefill of one request straight into a decode worker's blocks.

Same host (``shm``): the decode worker's pool is a POSIX shared-memory file; this process maps
it once (``KVPool.attach``) and the model's paged prefill writes each new token's K/V at
``slot = block_ids[pos // block_size] * block_size + pos % block_size`` of *that* pool. The
decode worker's cached prefix (``num_cached_tokens``) is read in place as attention context,
so it is neither recomputed nor copied. Nothing but the first token goes back.

Across hosts (``mooncake``): the prefill worker computes into its own pool, with its own prefix
cache (a prefill-side hit skips those tokens), then ``transfer.put_blocks`` moves the blocks
the decode worker lacks into its registered pool (see transfer.py).

Behind the Kthena router (``run_owned``): the prefill comes first and names no decode worker,
so the prompt goes into the own pool and its blocks stay held until a decode worker has pulled
them (one-sided get) or a timeout passes (pins.py, prefill_api.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from kthena_serve.config import EngineConfig
from kthena_serve.engine import create_kv_manager
from kthena_serve.logprobs import TokenLogprobs, gather_logprobs
from kthena_serve.model_runner import ModelRunner, create_pool, kv_layout_for
from kthena_serve.pd.protocol import PoolRef, PrefillResult, PrefillTask, params_from_json
from kthena_serve.sampler import Sampler
from kthena_serve.sampling_params import SamplingParams
from kthena_serve.scheduler import ScheduledBatch, ScheduledSeq
from mooncake_kv import ExtraKeys, KVCacheManager
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool, KVPoolHandle

__all__ = ["OwnedPrefill", "PrefillExecutor", "check_task"]


@attrs.frozen
class OwnedPrefill:
    """A prompt prefilled into the worker's own pool; its blocks are held until ``free``."""

    token_id: int
    logprobs: TokenLogprobs | None
    block_ids: tuple[int, ...]
    num_cached_tokens: int  # what this worker's own prefix cache supplied
    compute_s: float


@attrs.frozen
class _Row:
    """What the sampler reads for a prompt's first token (no engine request exists here)."""

    request_id: str
    params: SamplingParams
    output_token_ids: tuple[int, ...] = ()


def check_task(task: PrefillTask) -> None:
    """Raise ValueError for a task whose block table cannot hold its prompt."""
    size = task.pool.block_size
    num_tokens = len(task.token_ids)
    if not 0 <= task.num_cached_tokens < num_tokens or task.num_cached_tokens % size:
        raise ValueError(f"num_cached_tokens={task.num_cached_tokens} must be a multiple of "
                         f"{size} below the prompt length {num_tokens}")
    if len(task.block_ids) != -(-num_tokens // size):
        raise ValueError(f"{len(task.block_ids)} blocks cannot hold exactly {num_tokens} tokens")
    if any(not 0 <= b < task.pool.num_blocks for b in task.block_ids):
        raise ValueError(f"block ids must lie in [0, {task.pool.num_blocks})")


class PrefillExecutor:
    """Runs prefill tasks one at a time on the calling thread (the worker's compute thread).

    Args:
        model: the loaded model (same weights and dtype as the decode worker's).
        config: block size, dtype and the chunk budget (``max_num_batched_tokens``); also the
            size of this worker's own pool.
        own_pool: build a local pool and prefix cache (the cross-host path, and the prompts a
            decode worker pulls: ``run_owned``); True makes a private pool, a callable
            ``layout -> KVPool`` makes it where the caller wants (a served shm segment).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, *,
                 own_pool: bool | Callable[[KVLayout], KVPool] = False) -> None:
        self.model = model
        self.config = config
        self.sampler = Sampler(config.device)
        self._attached: dict[str, ModelRunner] = {}
        self._lock = threading.Lock()
        self.runner: ModelRunner | None = None
        self.kv: KVCacheManager | None = None
        self.num_steps = self.num_computed_tokens = 0  # reported in /pd/state
        if own_pool:
            layout = self.layout_for(config.num_kv_blocks or 1024)
            make = own_pool if callable(own_pool) else lambda lay: create_pool(lay, config)
            self.runner = ModelRunner(model, make(layout))
            self.kv = create_kv_manager(config, layout.num_blocks)

    @property
    def pool(self) -> KVPool | None:
        """This worker's own pool (the cross-host path), or None."""
        return self.runner.pool if self.runner is not None else None

    def layout_for(self, num_blocks: int, block_size: int | None = None,
                   dtype: str | None = None) -> KVLayout:
        cfg = EngineConfig(model=self.config.model, dtype=dtype or self.config.dtype,
                           block_size=block_size or self.config.block_size,
                           num_kv_blocks=num_blocks)
        m = self.model
        return kv_layout_for(m.config.num_hidden_layers, m.num_kv_heads_per_rank, m.head_dim, cfg)

    # ---- same host: compute into the decode worker's pool ---------------------------------------
    def run_shared(self, task: PrefillTask) -> PrefillResult:
        """Prefill into the decode pool named by ``task.pool.shm_name`` (zero copy)."""
        check_task(task)
        runner = self._attach(task.pool)
        start = time.perf_counter()
        token, logprobs = self._compute(task, runner, task.block_ids, task.num_cached_tokens)
        compute_s = time.perf_counter() - start
        return PrefillResult(task.request_id, token, len(task.token_ids) - task.num_cached_tokens,
                             compute_s, 0.0, 0, first_token_logprobs=logprobs)

    def _attach(self, ref: PoolRef) -> ModelRunner:
        """A runner over the decode worker's shared pool (mapped once per pool name)."""
        if ref.shm_name is None:
            raise ValueError("the task names no shared pool; use the mooncake transport")
        with self._lock:
            runner = self._attached.get(ref.shm_name)
            if runner is None:
                layout = self.layout_for(ref.num_blocks, ref.block_size, ref.dtype)
                pool = KVPool.attach(KVPoolHandle(ref.shm_name, layout))
                for old in self._attached.values():  # a restarted decode worker: new name
                    old.close()  # unmaps; the creator owns (and unlinks) the name
                runner = ModelRunner(self.model, pool)
                self._attached = {ref.shm_name: runner}
            return runner

    # ---- the forward passes --------------------------------------------------------------------
    def _compute(self, task: PrefillTask, runner: ModelRunner, block_ids: tuple[int, ...],
                 num_cached: int) -> tuple[int, TokenLogprobs | None]:
        return self._forward(task.request_id, task.token_ids, params_from_json(task.params),
                             runner, block_ids, num_cached)

    def _forward(self, rid: str, ids: Sequence[int], params: SamplingParams,
                 runner: ModelRunner, block_ids: tuple[int, ...], num_cached: int,
                 ) -> tuple[int, TokenLogprobs | None]:
        """Chunked paged prefill of ``ids[num_cached:]``; returns the sampled token and, if the
        request asked, its logprobs (from the logits it was sampled from)."""
        ids, start = tuple(ids), num_cached
        budget = self.config.max_num_batched_tokens
        logits = None
        while start < len(ids):
            end = min(len(ids), start + budget)
            seq = ScheduledSeq(rid, ids[start:end], start, tuple(block_ids), end == len(ids))
            logits = runner.execute(ScheduledBatch((seq,)))
            self.num_steps += 1
            start = end
        self.num_computed_tokens += len(ids) - num_cached
        row = _Row(rid, params)
        token = self.sampler(logits, [row])[0]
        self.sampler.forget(rid)
        return int(token), gather_logprobs(logits, [row], [token])[0]

    # ---- into the own pool: the blocks stay held until free() --------------------------------
    def run_owned(self, rid: str, token_ids: Sequence[int], params: SamplingParams,
                  cache_salt: str | None = None) -> OwnedPrefill:
        """Prefill into this worker's pool (its prefix cache honoured) and sample one token.

        The prompt's blocks stay held by ``rid`` (committed, so later prompts can share them)
        until ``free(rid)``: a decode worker pulls them in between. Compute thread only.

        Raises:
            MemoryError: the pool has no room for the prompt now.
        """
        assert self.kv is not None and self.runner is not None
        salt = ExtraKeys(cache_salt=cache_salt) if cache_salt else None
        match = self.kv.match_prefix(rid, token_ids, salt)
        try:
            blocks = self.kv.try_allocate(rid, len(token_ids) - match.num_cached_tokens)
            if blocks is None:
                raise MemoryError("the prefill worker's pool is full; retry or grow it")
            start = time.perf_counter()
            token, logprobs = self._forward(rid, token_ids, params, self.runner,
                                            blocks.block_ids, match.num_cached_tokens)
            compute_s = time.perf_counter() - start
            self.kv.commit(rid, token_ids)
        except BaseException:
            self.kv.free(rid)
            raise
        return OwnedPrefill(token, logprobs, blocks.block_ids, match.num_cached_tokens,
                            compute_s)

    def free(self, rid: str) -> None:
        """Give back the blocks ``run_owned`` left held (compute thread only)."""
        assert self.kv is not None
        self.kv.free(rid)

    # ---- across hosts: compute into the own pool, then put ---------------------------------------
    def run_local(self, task: PrefillTask, put_blocks) -> PrefillResult:  # noqa: ANN001
        """Prefill into this worker's pool (own prefix cache), then ``put_blocks(src, dst)``.

        ``put_blocks(src_block_ids, dst_block_ids) -> bytes`` moves the blocks the decode worker
        does not hold yet (everything from ``task.num_cached_tokens`` on).
        """
        check_task(task)
        rid = task.request_id
        owned = self.run_owned(rid, task.token_ids, params_from_json(task.params),
                               task.cache_salt)
        try:
            first = task.num_cached_tokens // task.pool.block_size
            start = time.perf_counter()
            num_bytes = put_blocks(owned.block_ids[first:], task.block_ids[first:])
            handoff_s = time.perf_counter() - start
        finally:
            self.free(rid)
        return PrefillResult(rid, owned.token_id, len(task.token_ids) - owned.num_cached_tokens,
                             owned.compute_s, handoff_s, num_bytes, owned.num_cached_tokens,
                             owned.logprobs)

    def close(self) -> None:
        for runner in self._attached.values():
            runner.close()
        self._attached.clear()
        if self.runner is not None:
            self.runner.close()
