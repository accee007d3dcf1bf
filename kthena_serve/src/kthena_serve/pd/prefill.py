"""Prefill executor: paged prefill of one request straight into a decode worker's blocks.

Same host (``shm``): the decode worker's pool is a POSIX shared-memory file; this process maps
it once (``KVPool.attach``) and the model's paged prefill writes each new token's K/V at
``slot = block_ids[pos // block_size] * block_size + pos % block_size`` of *that* pool. The
decode worker's cached prefix (``num_cached_tokens``) is read in place as attention context,
so it is neither recomputed nor copied. Nothing but the first token goes back.

Across hosts (``mooncake``): the prefill worker computes into its own pool, with its own prefix
cache (a prefill-side hit skips those tokens), then ``transfer.put_blocks`` moves the blocks
the decode worker lacks into its registered pool (see transfer.py).
"""

from __future__ import annotations

import threading
import time

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

__all__ = ["PrefillExecutor", "check_task"]


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
        config: block size, dtype and the chunk budget (``max_num_batched_tokens``); for the
            mooncake transport also the size of this worker's own pool.
        own_pool: build a local pool and prefix cache (the cross-host path).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, *, own_pool: bool = False
                 ) -> None:
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
            self.runner = ModelRunner(model, create_pool(layout, config))
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
        """Chunked paged prefill of ``token_ids[num_cached:]``; returns the sampled token and,
        if the request asked, its logprobs (from the logits it was sampled from)."""
        ids, start = task.token_ids, num_cached
        budget = self.config.max_num_batched_tokens
        logits = None
        while start < len(ids):
            end = min(len(ids), start + budget)
            seq = ScheduledSeq(task.request_id, ids[start:end], start, tuple(block_ids),
                               end == len(ids))
            logits = runner.execute(ScheduledBatch((seq,)))
            self.num_steps += 1
            start = end
        self.num_computed_tokens += len(ids) - num_cached
        row = _Row(task.request_id, params_from_json(task.params))
        token = self.sampler(logits, [row])[0]
        self.sampler.forget(task.request_id)
        return int(token), gather_logprobs(logits, [row], [token])[0]

    # ---- across hosts: compute into the own pool, then put ---------------------------------------
    def run_local(self, task: PrefillTask, put_blocks) -> PrefillResult:  # noqa: ANN001
        """Prefill into this worker's pool (own prefix cache), then ``put_blocks(src, dst)``.

        ``put_blocks(src_block_ids, dst_block_ids) -> bytes`` moves the blocks the decode worker
        does not hold yet (everything from ``task.num_cached_tokens`` on).
        """
        check_task(task)
        assert self.kv is not None and self.runner is not None
        rid = task.request_id
        salt = ExtraKeys(cache_salt=task.cache_salt) if task.cache_salt else None
        match = self.kv.match_prefix(rid, task.token_ids, salt)
        try:
            blocks = self.kv.try_allocate(rid, len(task.token_ids) - match.num_cached_tokens)
            if blocks is None:
                raise MemoryError("the prefill worker's pool is full; retry or grow it")
            start = time.perf_counter()
            token, logprobs = self._compute(task, self.runner, blocks.block_ids,
                                            match.num_cached_tokens)
            compute_s = time.perf_counter() - start
            self.kv.commit(rid, task.token_ids)
            first = task.num_cached_tokens // task.pool.block_size
            start = time.perf_counter()
            num_bytes = put_blocks(blocks.block_ids[first:], task.block_ids[first:])
            handoff_s = time.perf_counter() - start
        finally:
            self.kv.free(rid)
        return PrefillResult(rid, token, len(task.token_ids) - match.num_cached_tokens,
                             compute_s, handoff_s, num_bytes, match.num_cached_tokens, logprobs)

    def close(self) -> None:
        for runner in self._attached.values():
            runner.close()
        self._attached.clear()
        if self.runner is not None:
            self.runner.close()
