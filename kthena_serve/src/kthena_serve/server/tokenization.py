"""vLLM's ``/tokenize`` and ``/detokenize``: bodies and answers, over any ``EngineClient``.

``POST /tokenize`` takes a text (``prompt``; special tokens such as BOS added by default) or a
conversation (``messages``, rendered with the chat template; special tokens not added by
default) and answers ``{count, max_model_len, tokens, token_strs}``; ``POST /detokenize`` takes
``tokens`` and answers ``{prompt}``. Field names and defaults are vLLM's
(``TokenizeCompletionRequest`` / ``TokenizeChatRequest`` as one body: exactly one of
``prompt`` and ``messages``). Tokenising goes through the engine's ``InputProcessor``, so the
ids are those a completion of the same input would run on (in PD too: the router tokenises).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from kthena_serve.client import EngineClient
from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.model.errors import ChatTemplateError
from kthena_serve.server.protocol import ChatMessage
from kthena_serve.server.request_parts import Strict, refuse
from kthena_serve.server.tools import Tool, chat_inputs

__all__ = ["DetokenizeRequest", "TokenizeRequest", "detokenize", "tokenize"]

_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template",
              "chat_template_kwargs", "tools")


class TokenizeRequest(Strict):
    """vLLM's two tokenize bodies in one: a ``prompt`` or ``messages``, not both."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's default: true for prompt, false for messages
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless null
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None  # rendered as chat renders them

    def check(self) -> None:
        """Raise InvalidRequestError for a body that is not exactly one of the two forms, or
        sets what is not implemented (naming the field)."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send either prompt (a text) or messages (a chat), "
                                      "exactly one of them", "prompt")
        if self.prompt is not None:
            for name in _CHAT_ONLY:
                if name in self.model_fields_set:
                    raise InvalidRequestError(f"{name} applies to messages only; leave it "
                                              "out with a prompt", name)
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt are "
                                      "both true: continuing the last message opens no new "
                                      "turn; set add_generation_prompt to false",
                                      "continue_final_message")
        if self.chat_template is not None:
            refuse("chat_template", self.chat_template, "the checkpoint's template is used")


class DetokenizeRequest(Strict):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


def tokenize(engine: EngineClient, body: TokenizeRequest) -> dict[str, Any]:
    """``{count, max_model_len, tokens, token_strs}`` (``token_strs`` null unless asked).

    Raises:
        InvalidRequestError: see ``TokenizeRequest.check``, and text that is not valid Unicode.
    """
    body.check()
    if body.messages is not None:
        # as the chat route renders them: tools, assistant tool_calls, tool messages
        messages, extra = chat_inputs(body.messages, body.tools,
                                      engine.processor.tokenizer.chat_template)
        try:
            ids = engine.processor.encode_chat(
                messages, add_generation_prompt=body.add_generation_prompt,
                add_special_tokens=bool(body.add_special_tokens),
                continue_final_message=body.continue_final_message,
                template_kwargs={**(body.chat_template_kwargs or {}), **extra})
        except ChatTemplateError as error:
            raise InvalidRequestError(str(error), "messages") from None
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = engine.processor.encode(body.prompt or "", add_special_tokens=special)
    return {"count": len(ids), "max_model_len": engine.processor.limits.max_model_len, "tokens": ids,
            "token_strs": engine.processor.token_strs(ids) if body.return_token_strs else None}


def detokenize(engine: EngineClient, body: DetokenizeRequest) -> dict[str, str]:
    """``{prompt}``: the text of ``tokens``, special tokens included.

    Raises:
        InvalidRequestError: an id outside the vocabulary.
    """
    return {"prompt": engine.processor.decode(body.tokens)}
