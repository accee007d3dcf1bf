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

import torch

from kthena_serve.config import EngineConfig
from kthena_serve.model_inputs import build_inputs
from kthena_serve.model_runner import kv_layout_for
from kthena_serve.pd.protocol import PoolRef, PrefillResult, PrefillTask, params_from_json
from kthena_serve.request import Request
from kthena_serve.sampler import Sampler
from kthena_serve.scheduler import ScheduledBatch
from mooncake_kv import ExtraKeys, KVCacheManager
from mooncake_kv.layout import KVLayout
from mooncake_kv.pool import KVPool, KVPoolHandle

__all__ = ["PrefillExecutor", "check_task"]

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


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
        self.sampler = Sampler()
        self._attached: dict[str, tuple[KVPool, KVCaches]] = {}
        self._lock = threading.Lock()
        self.pool: KVPool | None = None
        self.kv: KVCacheManager | None = None
        if own_pool:
            self.pool = KVPool.create(self.layout_for(config.num_kv_blocks or 1024))
            self.kv = KVCacheManager(self.pool.layout.num_blocks, config.block_size)

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
        caches = self._attach(task.pool)
        start = time.perf_counter()
        token = self._compute(task, caches, task.block_ids, task.num_cached_tokens)
        compute_s = time.perf_counter() - start
        return PrefillResult(task.request_id, token, len(task.token_ids) - task.num_cached_tokens,
                             compute_s, 0.0, 0)

    def _attach(self, ref: PoolRef) -> KVCaches:
        if ref.shm_name is None:
            raise ValueError("the task names no shared pool; use the mooncake transport")
        with self._lock:
            entry = self._attached.get(ref.shm_name)
            if entry is None:
                layout = self.layout_for(ref.num_blocks, ref.block_size, ref.dtype)
                pool = KVPool.attach(KVPoolHandle(ref.shm_name, layout))
                caches = [(pool.k_cache(i), pool.v_cache(i))
                          for i in range(layout.shape.num_layers)]
                for old in self._attached.values():  # a restarted decode worker: new name
                    old[0].close()
                self._attached = {ref.shm_name: (pool, caches)}
                entry = self._attached[ref.shm_name]
            return entry[1]

    # ---- the forward passes --------------------------------------------------------------------
    @torch.inference_mode()
    def _compute(self, task: PrefillTask, caches: KVCaches, block_ids: tuple[int, ...],
                 num_cached: int) -> int:
        """Chunked paged prefill of ``token_ids[num_cached:]``; returns the sampled token."""
        request = Request(task.request_id, list(task.token_ids), params_from_json(task.params),
                          cache_salt=task.cache_salt)
        request.block_ids = tuple(block_ids)
        request.num_computed_tokens = num_cached
        budget = self.config.max_num_batched_tokens
        logits = None
        while request.num_computed_tokens < request.num_tokens:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            batch = ScheduledBatch((request,), (num_new,),
                                   (request.num_computed_tokens + num_new == request.num_tokens,))
            inputs = build_inputs(batch, self.config.block_size)
            logits = self.model(inputs.input_ids, inputs.positions, inputs.attention, caches)
            request.num_computed_tokens += num_new
        token = self.sampler(logits, [request])[0]
        self.sampler.forget(task.request_id)
        return int(token)

    # ---- across hosts: compute into the own pool, then put ---------------------------------------
    def run_local(self, task: PrefillTask, put_blocks) -> PrefillResult:  # noqa: ANN001
        """Prefill into this worker's pool (own prefix cache), then ``put_blocks(src, dst)``.

        ``put_blocks(src_block_ids, dst_block_ids) -> bytes`` moves the blocks the decode worker
        does not hold yet (everything from ``task.num_cached_tokens`` on).
        """
        check_task(task)
        assert self.kv is not None and self.pool is not None
        rid = task.request_id
        salt = ExtraKeys(cache_salt=task.cache_salt) if task.cache_salt else None
        match = self.kv.match_prefix(rid, task.token_ids, salt)
        try:
            blocks = self.kv.try_allocate(rid, len(task.token_ids) - match.num_cached_tokens)
            if blocks is None:
                raise MemoryError("the prefill worker's pool is full; retry or grow it")
            caches = [(self.pool.k_cache(i), self.pool.v_cache(i))
                      for i in range(self.pool.layout.shape.num_layers)]
            start = time.perf_counter()
            token = self._compute(task, caches, blocks.block_ids, match.num_cached_tokens)
            compute_s = time.perf_counter() - start
            self.kv.commit(rid, task.token_ids)
            first = task.num_cached_tokens // task.pool.block_size
            start = time.perf_counter()
            num_bytes = put_blocks(blocks.block_ids[first:], task.block_ids[first:])
            handoff_s = time.perf_counter() - start
        finally:
            self.kv.free(rid)
        return PrefillResult(rid, token, len(task.token_ids) - match.num_cached_tokens,
                             compute_s, handoff_s, num_bytes, match.num_cached_tokens)

    def close(self) -> None:
        for pool, _ in self._attached.values():
            pool.close()
        self._attached.clear()
        if self.pool is not None:
            self.pool.close()
