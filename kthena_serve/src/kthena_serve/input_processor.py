"""InputProcessor: the edge where a request is tokenised and validated, once.

Everything behind it (``LLMEngine.add``, the engine thread, a PD decode worker's engine) takes
the ``EngineRequest`` it makes as is. The in-process engine and the PD router build one each
over the same tokenizer and limits, so both answer a bad request the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kthena_serve.client import EngineLimits
from kthena_serve.errors import InvalidRequestError
from kthena_serve.request import EngineRequest
from kthena_serve.sampling_params import SamplingParams

__all__ = ["InputProcessor"]


class InputProcessor:
    """Tokenises prompts and checks them against an engine's limits.

    Args:
        tokenizer: the model's ``Tokenizer``.
        limits: the engine's limits (context length, vocabulary, ``n``).
        chat_special_tokens: ``"text"``: special tokens typed in chat content stay text (no
            forged turns); ``"control"``: they act as control tokens (Hugging Face's default).
    """

    def __init__(self, tokenizer, limits: EngineLimits,  # noqa: ANN001
                 chat_special_tokens: str = "text") -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.chat_special_tokens = chat_special_tokens

    def encode(self, prompt: str | Sequence[int], *, add_special_tokens: bool = False,
               ) -> list[int]:
        """Token ids of a text prompt (token-id prompts are checked and passed through).

        Args:
            add_special_tokens: add the tokenizer's special tokens (e.g. BOS) to a text prompt.

        Raises:
            InvalidRequestError: text that is not valid Unicode, or ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return _check_ids(prompt, self.limits.vocab_size, "prompt")

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, add_special_tokens: bool = False,
                    ) -> list[int]:
        """Token ids of the chat template applied to ``messages``, by default ending with the
        assistant's turn (special tokens in the content follow ``chat_special_tokens``).

        Raises:
            InvalidRequestError: content that is not valid Unicode text.
        """
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                _check_text(content, "messages")
        return self.tokenizer.encode_chat(
            messages, special_tokens_in_content=self.chat_special_tokens,
            add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens)

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
        return params.max_tokens if params.max_tokens is not None else room

    def make_request(self, request_id: str, prompt: str | Sequence[int],
                     params: SamplingParams | None = None, *,
                     cache_salt: str | None = None) -> EngineRequest:
        """Encode and check one request (the only validation it gets).

        Raises:
            InvalidRequestError: see ``encode`` and ``check``.
        """
        params = params or SamplingParams()
        ids = self.encode(prompt)
        return EngineRequest(request_id, tuple(ids), params, self.check(ids, params), cache_salt)


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
