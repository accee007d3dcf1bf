"""LLMEngine: requests in, outputs out; ``step()`` is schedule -> run -> postprocess.

Single-threaded by contract: one thread calls every method (the async engine's loop thread,
or the caller of ``LLM.generate``). The KV manager checks it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import torch

from kthena_serve.config import EngineConfig
from kthena_serve.errors import InvalidRequestError
from kthena_serve.model import IncrementalDetokenizer
from kthena_serve.model_runner import ModelRunner
from kthena_serve.output_stream import OutputStream
from kthena_serve.request import Request, RequestOutput
from kthena_serve.sampler import Sampler
from kthena_serve.sampling_params import SamplingParams
from kthena_serve.scheduler import ScheduledBatch, Scheduler
from kthena_serve.threads import configure_threads
from mooncake_kv import KVCacheManager, KVCacheStats

__all__ = ["EngineStats", "LLMEngine"]


@attrs.frozen
class EngineStats:
    """Counters since start, a queue snapshot, and the KV manager's stats."""

    num_steps: int
    num_computed_prompt_tokens: int  # prompt (and recomputed) tokens actually run
    num_generated_tokens: int
    num_preemptions: int
    num_waiting: int
    num_running: int
    kv: KVCacheStats


def _make_runner(config: EngineConfig, model, tokenizer):  # noqa: ANN202
    """(runner, tokenizer): TP workers for ``tp > 1``, else the given or loaded model."""
    if config.tp > 1:
        from kthena_serve.tp_runner import TPModelRunner

        runner = TPModelRunner(config)  # pins this process to one core
        return runner, runner.tokenizer
    configure_threads(config.num_threads)
    if model is None:
        from kthena_serve.model import load_model

        model, tokenizer = load_model(config.model, dtype=config.torch_dtype)
    return ModelRunner(model, config), tokenizer


class LLMEngine:
    """Continuous-batching engine over one model and one KV pool.

    Args:
        config: the engine config.
        model, tokenizer: an already loaded pair (tests); loaded from ``config.model`` if None.
    """

    def __init__(self, config: EngineConfig, model=None, tokenizer=None) -> None:
        self.runner, self.tokenizer = _make_runner(config, model, tokenizer)
        self.config = config
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 check_invariants=config.check_invariants)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_prefix_caching=config.enable_prefix_caching)
        self.sampler = Sampler()
        self.max_model_len = min(
            config.max_model_len or self.runner.model.config.max_position_embeddings,
            self.runner.num_blocks * config.block_size)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._num_steps = self._num_prompt_computed = self._num_generated = 0
        self._num_preemptions = 0

    # ---- requests -----------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt (token-id prompts are checked and passed through)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.runner.model.config.vocab_size
        if not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab})", "prompt")
        return ids

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The output budget, checked against the context length.

        Raises:
            InvalidRequestError: empty prompt, prompt or prompt + max_tokens over the context.
        """
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        room = self.max_model_len - num_prompt_tokens
        if room <= 0:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens but the context holds "
                f"{self.max_model_len}; shorten it", "prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} tokens "
                f"exceeds the context length {self.max_model_len}; ask for at most {room}",
                "max_tokens")
        return params.max_tokens if params.max_tokens is not None else room

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    ) -> Request:
        """Queue a request.

        Raises:
            InvalidRequestError: a bad prompt or length (see ``resolve_max_tokens``).
            ValueError: ``request_id`` is already live.
        """
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already live; pick a unique id")
        ids = self.encode(prompt)
        max_tokens = self.resolve_max_tokens(len(ids), params)
        request = Request(request_id, ids, params, cache_salt=cache_salt)
        request.stream = OutputStream(IncrementalDetokenizer(self.tokenizer, ids), params,
                                      self.eos_token_ids, max_tokens)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its blocks go back at once. None if it is not live."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self._finish_output(request)

    def close(self) -> None:
        """Abort what is left and release the pool (and TP workers)."""
        for request_id in self.live_request_ids():
            self.abort_request(request_id)
        self.runner.close()

    def live_request_ids(self) -> list[str]:
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample and stop-check; returns this step's outputs."""
        batch = self.scheduler.schedule()
        logits = self.runner.execute(batch) if batch.requests else None
        return self._postprocess(batch, logits)

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> list[RequestOutput]:
        self._count(batch)
        self.scheduler.update(batch)
        outputs = [self._finish_output(r) for r in batch.rejected]
        sampled = [r for r, s in zip(batch.requests, batch.is_sampled, strict=True) if s]
        if not sampled:
            return outputs
        if len(sampled) < len(batch.requests):
            logits = logits[[i for i, s in enumerate(batch.is_sampled) if s]]
        now = time.perf_counter()
        for request, token_id in zip(sampled, self.sampler(logits, sampled), strict=True):
            request.token_ids.append(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = request.stream.append(token_id)
            if reason is not None:
                self.scheduler.finish(request, reason)
                outputs.append(self._finish_output(request))
            else:
                outputs.append(self._output(request))
        return outputs

    def _count(self, batch: ScheduledBatch) -> None:
        self._num_steps += 1
        self._num_preemptions += len(batch.preempted)
        self._num_generated += sum(batch.is_sampled)
        self._num_prompt_computed += sum(
            n for r, n in zip(batch.requests, batch.num_new_tokens, strict=True) if r.is_prefill)

    def _finish_output(self, request: Request) -> RequestOutput:
        self._requests.pop(request.request_id, None)
        self.sampler.forget(request.request_id)
        return self._output(request)

    def _output(self, request: Request) -> RequestOutput:
        finished = request.finish_reason is not None
        start = request.num_prompt_tokens + request.num_emitted_tokens
        request.num_emitted_tokens = request.num_output_tokens
        stream: OutputStream = request.stream
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tuple(request.token_ids[start:]),
            new_text=stream.take_new_text(finished),
            token_ids=tuple(request.token_ids[request.num_prompt_tokens :]),
            text=stream.text,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
        )

    # ---- observability ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters and a consistent KV snapshot (the KV part is safe from any thread)."""
        return EngineStats(
            num_steps=self._num_steps,
            num_computed_prompt_tokens=self._num_prompt_computed,
            num_generated_tokens=self._num_generated,
            num_preemptions=self._num_preemptions,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv=self.kv.stats(),
        )

    # ---- PD disaggregation hook (kthena_serve.pd) -------------------------------------------
    def add_prefilled_request(self, request_id: str, prompt_ids: Sequence[int],
                              params: SamplingParams, first_token_id: int, *,
                              num_cached_tokens: int = 0, cache_salt: str | None = None,
                              ) -> RequestOutput:
        """Seat a request whose prompt KV another worker already wrote (PD handoff).

        The caller reserved the blocks under ``request_id`` on this engine's thread
        (``kv.match_prefix`` + ``kv.try_allocate`` for the whole prompt) and a prefill worker
        filled them and sampled ``first_token_id``. The prompt blocks are committed (so later
        requests hit them), the request joins the running set as a decoding request, and its
        first output is returned (already finished if that token ends it).

        Raises:
            InvalidRequestError: a bad prompt or length (see ``resolve_max_tokens``).
            ValueError: ``request_id`` is already live.
        """
        from kthena_serve.model import IncrementalDetokenizer
        from kthena_serve.request import RequestStatus

        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already live; pick a unique id")
        ids = list(prompt_ids)
        max_tokens = self.resolve_max_tokens(len(ids), params)
        request = Request(request_id, ids, params, cache_salt=cache_salt)
        request.stream = OutputStream(IncrementalDetokenizer(self.tokenizer, ids), params,
                                      self.eos_token_ids, max_tokens)
        blocks = self.kv.try_allocate(request_id, 0)  # the reserved table, nothing new
        assert blocks is not None, "reserved blocks vanished"
        request.block_ids = blocks.block_ids
        request.num_computed_tokens = len(ids)
        request.num_cached_tokens = num_cached_tokens
        self.kv.commit(request_id, ids)
        request.num_committed_blocks = len(ids) // self.config.block_size
        request.status = RequestStatus.RUNNING
        self._requests[request_id] = request
        self.scheduler.running.append(request)
        request.token_ids.append(first_token_id)
        request.first_token_time = time.perf_counter()
        self._num_generated += 1
        reason = request.stream.append(first_token_id)
        if reason is not None:
            self.scheduler.finish(request, reason)
            return self._finish_output(request)
        return self._output(request)
