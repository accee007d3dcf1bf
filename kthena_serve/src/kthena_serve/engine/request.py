"""Request: one generation's mutable state inside the engine, and what the engine hands back.

Token bookkeeping (``n`` = ``num_computed_tokens``)::

    token_ids:  p0 p1 p2 ... p(P-1) | o0 o1 ... o(k-1)
                └──── KV written: first n tokens ────┘└ not yet fed to the model
    prefill: n < P     decode: n == len(token_ids) - 1 (the last sampled token is fed next)

After a step feeds ``m`` tokens, ``n += m``; if then ``n == len(token_ids)`` the step's logits
give the next token. Preemption sets ``n = 0`` and keeps the tokens: re-admission recomputes
them (the prefix cache usually hands most of them back).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kthena_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kthena_serve.engine.logprobs import TokenLogprobs

__all__ = ["EngineRequest", "FinishReason", "Request", "RequestOutput", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RESERVED = "reserved"  # PD decode: blocks held while a prefill worker fills them
    RUNNING = "running"
    FINISHED = "finished"


@attrs.frozen
class EngineRequest:
    """A request validated once, at the edge (``InputProcessor.make_request``): plain data.

    Everything behind the edge (the engine thread, a PD decode worker's engine) trusts it: the
    prompt ids lie in the vocabulary and ``max_tokens`` is the resolved output budget.

    Attributes:
        request_id: unique among live requests.
        prompt_ids: the prompt's token ids (non-empty).
        params: sampling parameters.
        max_tokens: the output budget, checked against the context length.
        cache_salt: keys the prefix cache (tenant isolation), or None.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    cache_salt: str | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller (or its client went away)


@attrs.frozen
class RequestOutput:
    """What a request produced in one step (streaming) or in total (``LLM.generate``).

    Attributes:
        request_id: the caller's id.
        new_token_ids, new_text: produced since the previous output of this request.
        token_ids, text: everything produced so far (text minus any stop string).
        finish_reason: None while running.
        num_prompt_tokens, num_cached_tokens: prompt length and how much of it came from
            the prefix cache at first admission.
        arrival_time, first_token_time, finish_time: ``time.perf_counter`` stamps.
        error: set (with ``finish_reason`` ABORT) when the engine failed on this request alone.
        logprobs: one entry per token of ``token_ids`` if the request asked for logprobs
            (``SamplingParams.logprobs``), else None; ``new_logprobs`` are those of
            ``new_token_ids``.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt token
            (None for the first, which nothing predicts), in every output; else None.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def new_logprobs(self) -> tuple[TokenLogprobs, ...] | None:
        """The logprobs of ``new_token_ids`` (the tail of ``logprobs``), or None."""
        if self.logprobs is None:
            return None
        return self.logprobs[len(self.logprobs) - len(self.new_token_ids):]


class Request:
    """Engine-side state of one request (owned by the engine thread)."""

    __slots__ = (
        "arrival_time", "block_ids", "cache_salt", "first_token_time", "finish_reason",
        "finish_time", "grammar", "logprobs", "num_cached_tokens", "num_committed_blocks",
        "prompt_logprobs",
        "num_computed_tokens", "num_emitted_tokens", "num_preemptions", "num_prompt_tokens",
        "params", "request_id", "status", "stream", "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # set at first admission
        self.num_committed_blocks = 0
        self.num_emitted_tokens = 0  # output tokens already handed to the caller
        self.num_preemptions = 0
        self.block_ids: tuple[int, ...] = ()
        self.stream = None  # the OutputStream (detokenizer + stop checks), set by the engine
        # With structured_outputs: its xgrammar GrammarMatcher, advanced with every output
        # token (set by the engine; kept on preemption, like the tokens)
        self.grammar = None
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # One entry per output token when the request asked for logprobs (kept on preemption:
        # recomputing the prompt does not resample the tokens).
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # With prompt_logprobs: [None] (the first prompt token), then one entry per prompt token
        # as its chunk runs (reset on preemption: the prompt is computed again)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefill(self) -> bool:
        """True until every token but the last sampled one has its KV written."""
        return self.num_computed_tokens < self.num_tokens - 1 or self.num_output_tokens == 0

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
