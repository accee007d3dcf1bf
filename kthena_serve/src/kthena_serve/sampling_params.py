"""SamplingParams: how one request picks its tokens and when it stops (a frozen value)."""

from __future__ import annotations

import math

import attrs

from kthena_serve.errors import InvalidRequestError

__all__ = ["MAX_LOGPROBS", "MAX_SEED", "MAX_TOP_K", "MIN_SEED", "SamplingParams",
           "check_num_logprobs"]

MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what a torch generator takes
MAX_TOP_K = 2**31 - 1  # larger means "all" anyway (the sampler clamps to the vocabulary)
MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default max_logprobs; OpenAI's chat)


def _check_range(low: float | None, high: float | None, *, low_open: bool = False):
    def check(instance: object, attribute: attrs.Attribute, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{attribute.name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            left = "(" if low_open else "["
            raise ValueError(f"{attribute.name} must be in {left}{low}, {high}], got {value!r}")

    return check


def _check_max_tokens(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_tokens must be a positive int or None, got {value!r}")


def _check_min_tokens(instance: SamplingParams, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"min_tokens must be an int >= 0, got {value!r}", "min_tokens")
    if instance.max_tokens is not None and value > instance.max_tokens:
        raise InvalidRequestError(f"min_tokens={value} exceeds max_tokens="
                                  f"{instance.max_tokens}; ask for at most max_tokens",
                                  "min_tokens")


def _check_top_k(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1)
            or value > MAX_TOP_K):
        raise ValueError(f"top_k must be -1 (off) or an int in [1, {MAX_TOP_K}], got {value!r}")


def _check_seed(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_SEED <= value <= MAX_SEED:
        raise ValueError(f"seed must be an int in [-2**63, 2**64 - 1], got {value!r}")


def check_num_logprobs(value: int | None, name: str = "logprobs") -> None:
    """Check a count of top alternatives per token (None: no logprobs).

    Raises:
        InvalidRequestError: not None and not an int in [0, MAX_LOGPROBS]; ``param`` is ``name``.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(f"{name}={value!r} is out of range: {name} must be an int in "
                                  f"[0, {MAX_LOGPROBS}]", name)


def _check_logprobs(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    check_num_logprobs(value)


def _strings(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {value!r}")
    return items


def _ints(value: object) -> tuple[int, ...]:
    items = tuple(value or ())  # type: ignore[arg-type]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in items):
        raise ValueError(f"stop_token_ids must be ints in [0, 2**63), got {value!r}")
    return items


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Decoding settings of one request.

    Attributes:
        temperature: 0 is greedy; higher flattens the distribution.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens (-1: all).
        seed: makes sampling reproducible for this request, whatever else is batched with it.
        max_tokens: tokens to generate at most (None: up to the context length).
        stop: strings that end generation; they are not part of the returned text.
        stop_token_ids: token ids that end generation (besides the model's EOS).
        ignore_eos: keep going past EOS (benchmarks).
        presence_penalty, frequency_penalty: OpenAI's penalties on already generated tokens.
        repetition_penalty: vLLM's (and Hugging Face's): the logit of every token already in
            the prompt or the output is divided by it when positive, multiplied when
            negative; 1 is off, above 1 discourages repeats.
        min_p: keep only tokens whose probability (after temperature) is at least ``min_p``
            times the most likely one's; 0 is off.
        min_tokens: vLLM's: tokens generated before EOS or a ``stop_token_ids`` id may be
            sampled (they are masked until then) and before a stop string ends the output.
        logprobs: None: no logprobs; k: each output token's log-probability and the ``k`` most
            likely alternatives (``RequestOutput.logprobs``), from the model's raw
            distribution (before penalties, temperature, top-k / top-p).
    """

    temperature: float = attrs.field(default=1.0, validator=_check_range(0.0, None))
    top_p: float = attrs.field(default=1.0, validator=_check_range(0.0, 1.0, low_open=True))
    top_k: int = attrs.field(default=-1, validator=_check_top_k)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    max_tokens: int | None = attrs.field(default=16, validator=_check_max_tokens)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    ignore_eos: bool = False
    presence_penalty: float = attrs.field(default=0.0, validator=_check_range(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_check_range(-2.0, 2.0))
    repetition_penalty: float = attrs.field(default=1.0,
                                            validator=_check_range(0.0, None, low_open=True))
    min_p: float = attrs.field(default=0.0, validator=_check_range(0.0, 1.0))
    min_tokens: int = attrs.field(default=0, validator=_check_min_tokens)
    logprobs: int | None = attrs.field(default=None, validator=_check_logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
