"""InputProcessor: the edge where a request is tokenised and validated, once.

Everything behind it (``LLMEngine.add``, the engine thread, a PD decode worker's engine) takes
the ``EngineRequest`` it makes as is. The in-process engine and the PD router build one each
over the same tokenizer and limits, so both answer a bad request the same way.

The encode rule (vLLM's), the same on every path that turns text into ids: the HTTP app,
``/tokenize``, the DP router (``dp.frontend.routing_prompt``), ``LLM.generate`` and the PD
router::

    a text prompt      the tokenizer's special tokens (its BOS) added, unless the request
                       says add_special_tokens=false          (TEXT_ADDS_SPECIAL_TOKENS)
    a chat             only what the chat template writes, unless add_special_tokens=true
                                                              (CHAT_ADDS_SPECIAL_TOKENS)
    token ids          taken as given (checked against the vocabulary)

So with a tokenizer that adds a BOS, the ids a router hashes are the ids the engine runs, caches
and announces in its KV events.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.grammar import Grammars
from kthena_serve.engine.request import EngineRequest
from kthena_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.model import Tokenizer

__all__ = ["CHAT_ADDS_SPECIAL_TOKENS", "TEXT_ADDS_SPECIAL_TOKENS", "EngineLimits", "InputProcessor"]

TEXT_ADDS_SPECIAL_TOKENS = True  # a text prompt gets the tokenizer's BOS (vLLM, /tokenize)
CHAT_ADDS_SPECIAL_TOKENS = False  # a chat's template writes its special tokens itself


@attrs.frozen
class EngineLimits:
    """What a client may ask of an engine.

    Attributes:
        max_model_len: prompt + output tokens at most.
        vocab_size: token ids lie in ``[0, vocab_size)``.
        max_n: choices per API call at most.
        num_kv_blocks, block_size: the KV pool (summed over PD decode workers).
        kv_cache_dtype: the pool's element type (``"bf16"``, ``"fp16"``, ``"fp32"`` or
            ``"int8"``); None where no pool has reported it (a PD frontend before its workers).
        kernels: the kernels the engine runs (``mooncake_ops.selection.KernelChoice.labels``;
            the ``kthena_kernels_info`` gauge); {} where the model chose none (an injected one).
        prompt_logprobs: whether ``SamplingParams.prompt_logprobs`` (and ``echo`` with
            logprobs) can be served: a single-rank colocated engine (not tp x pp ranks, not PD,
            whose prompts run on prefill workers).
    """

    max_model_len: int
    vocab_size: int
    max_n: int
    num_kv_blocks: int
    block_size: int
    kv_cache_dtype: str | None = None
    kernels: Mapping[str, str] = attrs.field(factory=dict)
    prompt_logprobs: bool = False

    @classmethod
    def for_engine(cls, config: EngineConfig, *, max_position_embeddings: int,
                   vocab_size: int, num_kv_blocks: int = 0,
                   kv_cache_dtype: str | None = None,
                   kernels: Mapping[str, str] | None = None,
                   prompt_logprobs: bool = False) -> EngineLimits:
        """One engine's limits: the context is the model's, capped by ``config.max_model_len``
        and by what the pool holds (``num_kv_blocks``; 0: no pool known yet, no cap)."""
        max_model_len = min(config.max_model_len or max_position_embeddings,
                            max_position_embeddings)
        if num_kv_blocks:
            max_model_len = min(max_model_len, num_kv_blocks * config.block_size)
        return cls(max_model_len=max_model_len, vocab_size=vocab_size, max_n=config.max_n,
                   num_kv_blocks=num_kv_blocks, block_size=config.block_size,
                   kv_cache_dtype=kv_cache_dtype, kernels=dict(kernels or {}),
                   prompt_logprobs=prompt_logprobs)

    @classmethod
    def combine(cls, parts: Sequence[EngineLimits]) -> EngineLimits:
        """What a deployment of several engines (PD decode workers) offers: the smallest
        context and vocabulary, the summed pools.

        Raises:
            ValueError: no part.
        """
        if not parts:
            raise ValueError("combine the limits of at least one engine")
        return cls(max_model_len=min(p.max_model_len for p in parts),
                   vocab_size=min(p.vocab_size for p in parts), max_n=parts[0].max_n,
                   num_kv_blocks=sum(p.num_kv_blocks for p in parts),
                   block_size=parts[0].block_size, kv_cache_dtype=parts[0].kv_cache_dtype,
                   kernels=parts[0].kernels,
                   prompt_logprobs=all(p.prompt_logprobs for p in parts))


class InputProcessor:
    """Tokenises prompts and checks them against an engine's limits.

    Args:
        tokenizer: the model's ``Tokenizer``.
        limits: the engine's limits (context length, vocabulary, ``n``), or a function that
            returns them now (a PD router's change as its decode workers report).
        chat_special_tokens: ``"text"``: special tokens typed in chat content stay text (no
            forged turns); ``"control"``: they act as control tokens (Hugging Face's default).
        grammars: the compiled-grammar cache ``structured_outputs`` are checked with (and the
            engine's matchers made from); default: one over ``tokenizer`` and the limits'
            vocabulary.
    """

    def __init__(self, tokenizer: Tokenizer, limits: EngineLimits | Callable[[], EngineLimits],
                 chat_special_tokens: str = "text", grammars: Grammars | None = None) -> None:
        self.tokenizer = tokenizer
        self._limits = limits
        self.chat_special_tokens = chat_special_tokens
        self.grammars = grammars or Grammars(tokenizer, lambda: self.limits.vocab_size)

    @property
    def limits(self) -> EngineLimits:
        """The limits requests are checked against (read anew each time)."""
        return self._limits if isinstance(self._limits, EngineLimits) else self._limits()

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The bytes each token stands for (logprobs name their tokens with these)."""
        return self.tokenizer.token_bytes(token_ids)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's vocabulary entry (``'Ġworld'``), as vLLM's /tokenize returns them."""
        return self.tokenizer.token_strs(token_ids)

    def encode(self, prompt: str | Sequence[int], *,
               add_special_tokens: bool = TEXT_ADDS_SPECIAL_TOKENS) -> list[int]:
        """Token ids of a text prompt (token-id prompts are checked and passed through).

        Args:
            add_special_tokens: add the tokenizer's special tokens (e.g. BOS) to a text prompt
                (default: yes, the module's encode rule).

        Raises:
            InvalidRequestError: text that is not valid Unicode, or ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return _check_ids(prompt, self.limits.vocab_size, "prompt")

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True,
                    add_special_tokens: bool = CHAT_ADDS_SPECIAL_TOKENS,
                    continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of the chat template applied to ``messages``, by default ending with the
        assistant's turn (special tokens in the content follow ``chat_special_tokens``;
        ``continue_final_message`` and ``template_kwargs``: see ``Tokenizer.encode_chat``).

        Raises:
            InvalidRequestError: content that is not valid Unicode text.
        """
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                _check_text(content, "messages")
        return self.tokenizer.encode_chat(
            messages, special_tokens_in_content=self.chat_special_tokens,
            add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens included (as vLLM's /detokenize).

        Raises:
            InvalidRequestError: ids outside the vocabulary (the tokenizer's, which may be
                smaller than the model's padded one: those ids have no text).
        """
        vocab = min(self.limits.vocab_size, self.tokenizer.vocab_size)
        return self.tokenizer.decode(_check_ids(token_ids, vocab, "tokens"),
                                     skip_special_tokens=False)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """The output budget, checked against the context length.

        Raises:
            InvalidRequestError: empty prompt, prompt or prompt + max_tokens over the context.
        """
        num_prompt = len(prompt_ids)
        context = self.limits.max_model_len
        if params.prompt_logprobs is not None and not self.limits.prompt_logprobs:
            raise InvalidRequestError(
                "prompt logprobs (prompt_logprobs, or echo with logprobs) are computed by a "
                "single-rank colocated engine only; this deployment runs prompts on parallel "
                "ranks or PD prefill workers: leave them out", "prompt_logprobs")
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        room = context - num_prompt
        if room <= 0:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens but the context holds {context}; "
                "shorten it", "prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt} tokens "
                f"exceeds the context length {context}; ask for at most {room}", "max_tokens")
        budget = params.max_tokens if params.max_tokens is not None else room
        if params.min_tokens > budget:
            raise InvalidRequestError(
                f"min_tokens={params.min_tokens} exceeds the output budget {budget} (the "
                f"context left after the prompt's {num_prompt} tokens); ask for at most "
                f"{budget}", "min_tokens")
        return budget

    def prepare(self, prompt_ids: Sequence[int], params: SamplingParams,
                ) -> tuple[list[int], SamplingParams]:
        """What the tokenizer and the limits settle before a request is checked: the prompt
        cut to ``truncate_prompt_tokens`` (its last k tokens, as vLLM), ``bad_words`` as token
        runs, and the ids of ``logit_bias`` / ``allowed_token_ids`` within the vocabulary.

        Raises:
            InvalidRequestError: an id outside the vocabulary, or ``truncate_prompt_tokens``
                over the context length.
        """
        ids = list(prompt_ids)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            context = self.limits.max_model_len
            if keep > context:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens={keep} exceeds the context length {context}; ask "
                    f"for at most {context} (or -1: as many as the context holds)",
                    "truncate_prompt_tokens")
            ids = ids[-(context if keep == -1 else keep):]
        vocab = self.limits.vocab_size
        _check_ids([t for t, _ in params.logit_bias], vocab, "logit_bias")
        _check_ids(params.allowed_token_ids or (), vocab, "allowed_token_ids")
        if params.bad_words and not params.bad_words_token_ids:
            params = attrs.evolve(params, bad_words_token_ids=self._bad_word_runs(params.bad_words))
        return ids, params

    def _bad_word_runs(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens as it starts a text, and (where the tokenizer spells it with its
        own first token and as many tokens) after a space, so it is barred mid-text too."""
        runs: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip()))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip()))
            runs.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                runs.append(spaced)
        return tuple(runs)

    def compile_grammar(self, params: SamplingParams, param: str = "structured_outputs") -> None:
        """Compile ``params.structured_outputs`` into the cache the engine's matchers come from
        (slow on a miss: the server calls it off the event loop and the engine thread).

        Raises:
            InvalidRequestError: the constraint does not compile (``param`` names the field).
        """
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs, param)

    def make_request(self, request_id: str, prompt: str | Sequence[int],
                     params: SamplingParams | None = None, *,
                     cache_salt: str | None = None) -> EngineRequest:
        """Encode (a text prompt by the module's rule: BOS added) and check one request (the
        only validation it gets), its grammar compiled.

        Raises:
            InvalidRequestError: see ``encode``, ``check`` and ``compile_grammar``.
        """
        ids, params = self.prepare(self.encode(prompt), params or SamplingParams())
        budget = self.check(ids, params)
        self.compile_grammar(params)
        return EngineRequest(request_id, tuple(ids), params, budget, cache_salt)


def _check_ids(token_ids: Sequence[int], vocab: int, param: str) -> list[int]:
    ids = list(token_ids)
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise InvalidRequestError(
                f"{param} token id {token!r} at position {position} is not an int in "
                f"[0, {vocab}); send ids from this model's vocabulary", param)
    return ids


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"the {param} text is not valid Unicode (a lone surrogate at character "
            f"{error.start}); send UTF-8 text", param) from None
