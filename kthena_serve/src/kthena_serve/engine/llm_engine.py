"""LLMEngine: requests in, outputs out; ``step()`` is schedule -> run -> postprocess (the room's
map is in ``kthena_serve/engine/__init__.py``).

Single-threaded by contract: one thread calls every method (the async engine's loop thread,
or the caller of ``LLM.generate``). The KV manager checks it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import torch

from kthena_serve.engine.admission import KVOutlook
from kthena_serve.engine.assembly import build_runner, create_kv_manager
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.grammar import Grammars
from kthena_serve.engine.input_processor import EngineLimits, InputProcessor
from kthena_serve.engine.kv_outlook import KVOutlookMeter
from kthena_serve.engine.logprobs import TokenLogprobs, gather_logprobs, prompt_logprobs
from kthena_serve.engine.model_runner import Runner, kv_dtype_name
from kthena_serve.engine.output_stream import OutputStream
from kthena_serve.engine.request import EngineRequest, FinishReason, Request, RequestOutput
from kthena_serve.engine.sampler import Sampler
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.scheduled import Reservation, ScheduledBatch
from kthena_serve.engine.scheduler import Scheduler
from kthena_serve.engine.stats import EngineStats
from kthena_serve.engine.step_cost import DecodeProtectingBudget, StepCostModel, StepShape
from kthena_serve.engine.step_times import StepClock
from kthena_serve.model import IncrementalDetokenizer, Tokenizer
from mooncake_kv import KVCacheManager

__all__ = ["LLMEngine"]

log = logging.getLogger(__name__)
T = TypeVar("T")

FAILED_MESSAGE = ("the engine failed while generating this request (other requests were not "
                  "affected); retry it, and report it if it fails again")


class LLMEngine:
    """Continuous-batching engine over one model and one KV pool.

    Args:
        config: the engine config.
        runner: a ``Runner`` (``ModelRunner`` or ``ParallelModelRunner``) over its KV pool;
            owned from now on.
        tokenizer: the model's tokenizer.
        kv: the KV cache manager over the runner's blocks (default: from ``config``).
        scheduler: the scheduler over ``kv`` (default: from ``config``).
        step_cost: the step cost model every step's time refits and the default scheduler's
            prefill budget reads (default with ``config.target_step_ms``: a ``StepCostModel``
            from ``DEFAULT_SEED``; without it, none is kept).
    """

    def __init__(self, config: EngineConfig, runner: Runner, tokenizer: Tokenizer, *,
                 kv: KVCacheManager | None = None, scheduler: Scheduler | None = None,
                 step_cost: StepCostModel | None = None) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.kv = kv or create_kv_manager(config, runner.num_blocks)
        self.offloader = None  # --kv-offload: tiers below the pool (kthena_serve.engine.kv_offload)
        if config.kv_offload is not None:
            from kthena_serve.engine.kv_offload import open_offloader

            if scheduler is not None:
                raise ValueError("config.kv_offload opens an offloader for the engine's own "
                                 "scheduler; with an injected scheduler, give it the offloader "
                                 "and leave kv_offload None")

            self.offloader = open_offloader(config, runner, self.kv)  # tp > 1: every rank's
        # target_step_ms: every step's time refits the cost model the prefill budget reads;
        # max_queue_delay_s: the admission bound's rate starts from its prefill capacity
        self.step_cost = step_cost or (StepCostModel() if config.target_step_ms
                                       or config.max_queue_delay_s else None)
        self.scheduler = scheduler or Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching, offloader=self.offloader,
            promote_timeout_s=(config.kv_offload.promote_timeout_s
                               if config.kv_offload is not None else 5.0),
            prefill_budget=self._prefill_budget(),
            burst_window_s=(config.target_step_ms or 0.0) / 1e3)
        self.sampler = Sampler(runner.device, eos_token_ids=tokenizer.eos_token_ids)
        model_config = runner.model.config
        self.processor = InputProcessor(tokenizer, EngineLimits.for_engine(
            config, max_position_embeddings=model_config.max_position_embeddings,
            vocab_size=model_config.shape.vocab_size, num_kv_blocks=runner.num_blocks,
            kv_cache_dtype=kv_dtype_name(config), kernels=_kernel_labels(runner.model),
            prompt_logprobs=hasattr(runner, "execute_prompt_logits")),
            config.chat_special_tokens,
            # a batch's grammar rows are filled on the engine's threads (idle meanwhile)
            Grammars(tokenizer, model_config.shape.vocab_size, max_threads=torch.get_num_threads()))
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._num_steps = self._num_prompt_computed = self._num_generated = 0
        self._num_preemptions = 0
        self._outlook = KVOutlookMeter()  # kv_outlook's: blocks released per second, output length
        self._clock = StepClock()

    def _prefill_budget(self) -> DecodeProtectingBudget | None:
        if self.step_cost is None or not self.config.target_step_ms:
            return None
        return DecodeProtectingBudget(self.step_cost, self.config.target_step_ms / 1e3,
                                      min_tokens=self.config.block_size,
                                      max_tokens=self.config.max_num_batched_tokens)

    @classmethod
    def from_config(cls, config: EngineConfig, *, model: torch.nn.Module | None = None,
                    tokenizer: Tokenizer | None = None, shared_pool: bool = False) -> LLMEngine:
        """The engine with its default parts (see ``build_runner`` for the arguments)."""
        runner, tokenizer = build_runner(config, model, tokenizer, shared_pool=shared_pool)
        return cls(config, runner, tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.processor.limits.max_model_len

    # ---- requests -----------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> Request:
        """Queue a request the ``InputProcessor`` made (it is not validated again).

        Raises:
            ValueError: ``request.request_id`` is already live.
        """
        live = self._new(request)
        self.scheduler.add(live)
        return live

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    ) -> Request:
        """Validate and queue a request (``add(processor.make_request(...))``).

        Raises:
            InvalidRequestError: a bad prompt or length.
            ValueError: ``request_id`` is already live.
        """
        return self.add(self.processor.make_request(request_id, prompt, params,
                                                    cache_salt=cache_salt))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request (waiting, reserved or running); its blocks go back at once.

        Returns None if it is not live.
        """
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self._finish_output(request)

    def close(self) -> None:
        """Abort what is left and release the pool (and the parallel ranks)."""
        for request_id in self.live_request_ids():
            self.abort_request(request_id)
        if self.offloader is not None:
            from kthena_serve.engine.kv_offload import close_offloader

            close_offloader(self.offloader)  # its threads read the pool: stop them first
        self.runner.close()

    def live_request_ids(self) -> list[str]:
        return list(self._requests)

    def not_started(self) -> set[str]:
        """The requests still waiting for their first prompt chunk (a preempted one, which
        had started, is not among them)."""
        return {r.request_id for r in self.scheduler.waiting
                if r.num_computed_tokens == 0 and r.num_preemptions == 0}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def has_runnable_requests(self) -> bool:
        """Whether ``step()`` has anything to run (paused requests do not count)."""
        return self.scheduler.has_runnable_work()

    def pause(self, request_id: str) -> bool:
        """Stop decoding a running request until ``resume`` (it keeps its blocks); False if it
        is not live."""
        if request_id not in self._requests:
            return False
        self.scheduler.pause(request_id)
        return True

    def resume(self, request_id: str) -> None:
        self.scheduler.resume(request_id)

    # ---- PD admission: the prompt's KV comes from another worker -------------------------------
    def reserve(self, request: EngineRequest) -> Reservation | None:
        """Hold blocks for the prompt (cached prefix matched); None if the pool is full now."""
        live = self._new(request)
        reservation = self.scheduler.reserve(live)
        if reservation is None:
            del self._requests[request.request_id]
        return reservation

    def wait_reserved(self, request_id: str) -> None:
        """Wait (any thread) for a reservation's promotion from the offload tiers to end, at
        most ``promote_timeout_s``; returns at once when it has none."""
        self.scheduler.promoting.wait_reserved(request_id)

    def settle_reserved(self, request_id: str) -> Reservation:
        """End a reservation's promotion: the reservation with what arrived counted cached.

        Raises:
            KeyError: ``request_id`` holds no reservation.
        """
        return self.scheduler.settle_reserved(request_id)

    def admit_prefilled(self, request_id: str, first_token_id: int,
                        logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """Start decoding a reserved request whose prompt KV was written; its first output.

        Args:
            logprobs: the first token's logprobs, as the prefill worker gathered them (needed
                when the request asked for logprobs).

        Raises:
            KeyError: ``request_id`` holds no reservation.
            ValueError: the request asked for logprobs and none came with the first token.
        """
        live = self._requests.get(request_id)
        if live is not None and live.logprobs is not None and logprobs is None:
            raise ValueError(f"request {request_id!r} asked for logprobs, but its first token "
                             "came without them; the prefill worker must gather them")
        request = self.scheduler.admit_prefilled(request_id)
        self._num_generated += 1
        return self._append_token(request, first_token_id, time.perf_counter(), logprobs)

    def release(self, request_id: str) -> bool:
        """Give back a reservation that will not be admitted; False if there is none."""
        request = self._requests.get(request_id)
        if request is None or not self.scheduler.release(request_id):
            return False
        self._finish_output(request)
        return True

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample and stop-check; returns this step's outputs.

        A failure that belongs to one request (sampling it, detokenising it) ends that request
        alone, with ``RequestOutput.error`` set; a failed forward ends the step's requests.

        Raises:
            RankDiedError: the forward failed because a parallel rank's process has died.
        """
        self._clock.start()
        batch = self.scheduler.schedule()
        self._clock.scheduled(has_prefill=self._has_prefill(batch))
        try:
            logits = self._execute(batch) if batch.seqs else None
        except Exception as error:  # noqa: BLE001 - the batch's requests fail; the engine goes on
            self._raise_if_a_rank_died(error)
            log.exception("forward of %d sequences failed", len(batch.seqs))
            return [self._fail(self._requests[s.request_id]) for s in batch.seqs]
        self._clock.forwarded()
        outputs = self._postprocess(batch, logits)
        self._observe_step(batch, self._clock.stop())
        return outputs

    def _raise_if_a_rank_died(self, error: Exception) -> None:
        """Raise ``RankDiedError`` (from ``error``) when a parallel rank's process has died: no
        forward runs without every rank, so every request fails, not just the step's."""
        dead_rank = getattr(self.runner, "dead_rank", None)
        died = dead_rank() if dead_rank is not None else None
        if died is not None:
            raise died from error

    def _has_prefill(self, batch: ScheduledBatch) -> bool:
        """Whether any of the batch's requests computes prompt tokens (a prefill forward)."""
        return any(self._requests[s.request_id].is_prefill for s in batch.seqs)

    def _execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """The runner's forward; chunks of prompts that want prompt logprobs get logits at every
        position, turned into their entries here."""
        wanted = {s.request_id: s for s in batch.seqs
                  if self._requests[s.request_id].prompt_logprobs is not None
                  and s.start < self._requests[s.request_id].num_prompt_tokens - 1}
        if not wanted:
            return self.runner.execute(batch)
        logits, chunks = self.runner.execute_prompt_logits(batch, set(wanted))
        for rid, seq in wanted.items():
            request = self._requests[rid]
            prompt = request.token_ids[: request.num_prompt_tokens]
            targets = prompt[seq.start + 1 : seq.start + 1 + len(seq.token_ids)]
            del request.prompt_logprobs[seq.start + 1 :]  # a recomputed chunk replaces its own
            request.prompt_logprobs += prompt_logprobs(chunks[rid], targets,
                                                       request.params.prompt_logprobs)
        return logits

    def _observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """Feed a step's time to the cost model (what a decode waits for: forward + sampling)."""
        if self.step_cost is not None and batch.seqs:
            self.step_cost.observe(StepShape.of(batch), seconds)

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> list[RequestOutput]:
        self._count(batch)
        self.scheduler.update(batch)
        outputs = [self._finish_output(self._requests[rid]) for rid in batch.rejected]
        sampled = [self._requests[s.request_id] for s in batch.seqs if s.is_sampled]
        if not sampled:
            return outputs
        now = time.perf_counter()
        tokens = self._sample(logits, sampled)
        logprobs = self._logprobs(logits, sampled, tokens)
        for request, token_id, entry in zip(sampled, tokens, logprobs, strict=True):
            if token_id is None or (request.logprobs is not None and entry is None):
                outputs.append(self._fail(request))
            else:
                outputs.append(self._append_token(request, token_id, now, entry))
        return outputs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int | None]:
        """One token per request, grammars' bitmasks applied; a request the sampler fails on
        gets None (the rest do not)."""
        grammars = self.processor.grammars
        return _by_rows(lambda rows: self.sampler(
            logits[rows], requests[rows], grammars.fill_bitmask([r.grammar for r in requests[rows]])),
            requests, "sampling request %s failed")

    def _logprobs(self, logits: torch.Tensor, requests: list[Request],
                  tokens: list[int | None]) -> list[TokenLogprobs | None]:
        """Logprobs for the requests that asked, from the logits the sampler read (a request
        they cannot be gathered for gets None, and fails alone)."""
        return _by_rows(lambda rows: gather_logprobs(logits[rows], requests[rows], tokens[rows]),
                        requests, "logprobs of request %s failed")

    def _append_token(self, request: Request, token_id: int, now: float,
                      logprobs: TokenLogprobs | None = None) -> RequestOutput:
        try:
            request.token_ids.append(token_id)
            if request.logprobs is not None:
                request.logprobs.append(logprobs)
            if request.first_token_time is None:
                request.first_token_time = now
            completed = _advance_grammar(request, token_id)
            reason = request.stream.append(token_id) or (FinishReason.STOP if completed else None)
        except Exception:  # noqa: BLE001 - this request's stream alone is broken
            log.exception("stop-checking request %s failed", request.request_id)
            return self._fail(request)
        if reason is None:
            return self._output(request)
        self.scheduler.finish(request, reason)
        return self._finish_output(request)

    def _fail(self, request: Request) -> RequestOutput:
        """End one request with an error: its blocks go back, its stream gets the error."""
        self.scheduler.finish(request, FinishReason.ABORT)
        return attrs.evolve(self._finish_output(request), error=FAILED_MESSAGE)

    def _count(self, batch: ScheduledBatch) -> None:
        self._num_steps += 1
        self._num_preemptions += len(batch.preempted)
        self._num_generated += len(batch.sampled_rows)
        self._num_prompt_computed += sum(
            len(s.token_ids) for s in batch.seqs if self._requests[s.request_id].is_prefill)

    def _new(self, request: EngineRequest) -> Request:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already live; "
                             "pick a unique id")
        live = Request(request.request_id, request.prompt_ids, request.params,
                       cache_salt=request.cache_salt)
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_ids,
                                             request.params.skip_special_tokens)
        live.stream = OutputStream(detokenizer, request.params, self.eos_token_ids,
                                   request.max_tokens)
        if request.params.structured_outputs is not None:  # compiled at the edge: a cache hit
            live.grammar = self.processor.grammars.matcher(request.params.structured_outputs)
        self._requests[request.request_id] = live
        return live

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
            logprobs=tuple(request.logprobs) if request.logprobs is not None else None,
            prompt_logprobs=(tuple(request.prompt_logprobs)
                             if request.prompt_logprobs is not None else None),
        )

    # ---- observability ----------------------------------------------------------------------
    def prefill_capacity(self, rows: int | None = None) -> float | None:
        """Prompt tokens per second the step cost model predicts with ``rows`` requests running
        (default: those running now; steps of the prefill budget, or
        ``max_num_batched_tokens``); None without a cost model. The admission bound's prior
        rate (``kthena_serve.engine.admission``)."""
        if self.step_cost is None:
            return None
        rows = len(self.scheduler.running) if rows is None else rows
        budget = self.scheduler.prefill_budget
        tokens = budget(rows) if budget is not None and rows else self.config.max_num_batched_tokens
        return self.step_cost.prefill_tokens_per_s(rows, max(1, tokens))

    def prefill_slowdown(self, num_queued: int) -> float:
        """How much slower than now the queue's prompts will compute once the ``num_queued``
        requests admitted ahead decode beside them (each becomes a decode row that takes step
        time from the prefills behind it): the cost model's capacity with as many rows as the
        larger of those running and those queued (at most ``max_num_seqs``) over its capacity
        now, at most 1 (1 without a cost model)."""
        now = self.prefill_capacity()
        rows = min(self.config.max_num_seqs, max(len(self.scheduler.running), num_queued))
        later = self.prefill_capacity(rows)
        if now is None or later is None or not now > 0:
            return 1.0
        return min(1.0, later / now)

    def kv_outlook(self) -> KVOutlook:
        """What the pool holds in store for the queue (``kthena_serve.engine.admission``): free blocks,
        the blocks waiting prompts and running outputs will still take, and the measured rate
        finished requests give blocks back at. Outputs count at the mean length of the last
        finished ones (decayed), at most their ``max_tokens``; prefix hits are not subtracted,
        so the demand errs high. The engine's thread only."""
        return self._outlook.read(self.scheduler, self.kv.num_free_blocks)

    def stats(self) -> EngineStats:
        """Counters and a consistent KV snapshot (the KV part is safe from any thread; the
        leak report reads the engine's requests, so only the engine's thread calls this)."""
        leaked = {rid: n for rid, n in self.kv.holders().items() if rid not in self._requests}
        return EngineStats(
            num_steps=self._num_steps,
            num_computed_prompt_tokens=self._num_prompt_computed,
            num_generated_tokens=self._num_generated,
            num_preemptions=self._num_preemptions,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv=self.kv.stats(),
            kv_tiers=self.kv_tier_stats(),
            num_leaked_requests=len(leaked),
            num_leaked_blocks=sum(leaked.values()),
            step_times=self._clock.times,
        )

    def kv_tier_stats(self) -> tuple:
        """Per-tier ``KVTierStats`` of ``--kv-offload`` (empty without it); any thread."""
        if self.offloader is None:
            return ()
        from kthena_serve.engine.kv_offload import tier_stats

        return tier_stats(self.offloader.snapshot())


def _by_rows(run: Callable[[slice], list[T]], requests: list[Request],
             failed: str) -> list[T | None]:
    """``run`` over all the requests' rows at once; if that raises, row by row to find the
    culprits: a row that fails gets None (logged as ``failed % request_id``), the rest do not."""
    try:
        return run(slice(None))
    except Exception:  # noqa: BLE001 - find the culprit row by row
        results: list[T | None] = []
        for row, request in enumerate(requests):
            try:
                results += run(slice(row, row + 1))
            except Exception:  # noqa: BLE001
                log.exception(failed, request.request_id)
                results.append(None)
        return results


def _advance_grammar(request: Request, token_id: int) -> bool:
    """Feed a sampled token to the request's grammar; True once the grammar has ended (its
    stop token taken). A request without one: False.

    Raises:
        ValueError: the grammar refuses the token (the sampler samples under the grammar's
            mask, alone where the other masks left it no token: a defect if this is reached).
    """
    if request.grammar is None:
        return False
    if not request.grammar.accept_token(token_id):
        raise ValueError(f"token {token_id} does not continue the request's structured output "
                         "(its other masks left the grammar no token)")
    return request.grammar.is_terminated()


def _kernel_labels(model: torch.nn.Module) -> dict[str, str]:
    """The labels of the kernels the model's loader chose ({} for a model built otherwise),
    with how its decode steps run the layers (``decode_step``: fused or ops)."""
    choice = getattr(model, "kernel_choice", None)
    if choice is None:
        return {}
    step = getattr(model, "decode_step", None)
    return choice.labels() | ({} if step is None else {"decode_step": step.name})
