"""SamplingParams: how one request picks its tokens and when it stops (a frozen value)."""

from __future__ import annotations

import math

import attrs

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.engine.structured_output import structured_outputs as _structured_outputs

__all__ = ["MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_SEED", "MAX_TOP_K", "MIN_SEED",
           "SamplingParams", "check_num_logprobs"]

MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what a torch generator takes
MAX_TOP_K = 2**31 - 1  # larger means "all" anyway (the sampler clamps to the vocabulary)
MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default max_logprobs; OpenAI's chat)
MAX_LOGIT_BIAS = 100.0  # a bias is clamped into [-100, 100] (OpenAI's range; vLLM clamps too)


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


def _check_prompt_logprobs(instance: object, attribute: attrs.Attribute,
                           value: int | None) -> None:
    check_num_logprobs(value, "prompt_logprobs")


def _strings(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {value!r}")
    for item in items:
        _check_unicode(item, "stop")
    return items


def _check_unicode(text: str, name: str) -> None:
    """Refuse text no output can contain (a lone surrogate), which JSON between PD workers
    cannot carry either."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(f"{name} text is not valid Unicode (a lone surrogate at "
                                  f"character {error.start}); send UTF-8 text", name) from None


def _ints(value: object) -> tuple[int, ...]:
    items = tuple(value or ())  # type: ignore[arg-type]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in items):
        raise ValueError(f"stop_token_ids must be ints in [0, 2**63), got {value!r}")
    return items


def _token_id(value: object, name: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():  # JSON object keys are strings
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise InvalidRequestError(f"{name} takes token ids (ints >= 0), got {value!r}", name)
    return value


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or its pairs) -> sorted pairs, each bias clamped into +-100."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, dict) else value
    out = {}
    for token, bias in pairs:  # type: ignore[misc]
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise InvalidRequestError(f"logit_bias[{token!r}]={bias!r}: a bias is a finite "
                                      "number (clamped into [-100, 100])", "logit_bias")
        out[_token_id(token, "logit_bias")] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(bias)))
    return tuple(sorted(out.items()))


def _allowed(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = tuple(_token_id(t, "allowed_token_ids") for t in value)  # type: ignore[attr-defined]
    if not ids:
        raise InvalidRequestError("allowed_token_ids is empty: no token could be sampled; "
                                  "leave it out or list at least one id", "allowed_token_ids")
    return ids


def _words(value: object) -> tuple[str, ...]:
    items = tuple(value or ())  # type: ignore[arg-type]
    if not all(isinstance(w, str) and w.strip() for w in items):
        raise InvalidRequestError(f"bad_words must be a list of non-blank strings, got "
                                  f"{value!r}", "bad_words")
    for word in items:
        _check_unicode(word, "bad_words")
    return items


def _id_runs(value: object) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(_token_id(t, "bad_words") for t in run) for run in value or ()  # type: ignore[attr-defined]
                 if run)


def _check_truncate(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (the context length) or "
                                  f"an int >= 1, got {value!r}", "truncate_prompt_tokens")


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
        include_stop_str_in_output: keep the stop string that ended the output (and the text
            of a ``stop_token_ids`` token, as ``skip_special_tokens`` renders it).
        skip_special_tokens: leave special tokens out of the returned text (vLLM's default).
        spaces_between_special_tokens: vLLM's; accepted either way: this server's fast
            tokenizer joins special tokens without spaces, as vLLM's fast tokenizers do.
        logit_bias: {token id: bias} added to the logits before sampling (OpenAI's; each bias
            clamped into [-100, 100]); stored as sorted pairs.
        allowed_token_ids: only these ids may be sampled (vLLM's); None: all.
        bad_words: vLLM's: words never generated; ``bad_words_token_ids`` holds their token
            runs (filled by the input processor, which has the tokenizer): a run's last token
            is masked whenever the output ends with the rest of the run.
        truncate_prompt_tokens: vLLM's: keep only the prompt's last k tokens (-1: as many as
            the context holds); None: a prompt over the context is refused.
        prompt_logprobs: vLLM's: None, or each prompt token's log-probability given the tokens
            before it and the ``k`` most likely tokens at its place
            (``RequestOutput.prompt_logprobs``; the first token has none). Such a prompt is
            computed in full (its cached prefix is not reused: cached blocks have no logits).
        structured_outputs: vLLM's: the output follows this constraint (a JSON schema, a
            regex, a choice, a grammar ...; a dict of its fields is taken too): tokens that
            cannot continue it are masked in the sampler, and the request ends ("stop") once
            it is complete. None: free text.
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_allowed)
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_words)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_id_runs)
    truncate_prompt_tokens: int | None = attrs.field(default=None, validator=_check_truncate)
    prompt_logprobs: int | None = attrs.field(default=None, validator=_check_prompt_logprobs)
    structured_outputs: StructuredOutputsParams | None = attrs.field(default=None,
                                                                   converter=_structured_outputs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def changes_logits(self) -> bool:
        """Whether the sampler edits this request's logits row (penalties, bias, masks)."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids) or self.structured_outputs is not None)
