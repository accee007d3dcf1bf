"""vLLM's ``/tokenize`` and ``/detokenize``: bodies and answers, over any ``EngineClient``.

``POST /tokenize`` takes a text (``prompt``; special tokens such as BOS added by default) or a
conversation (``messages``, rendered with the chat template; special tokens not added by
default) and answers ``{count, max_model_len, tokens, token_strs}``; ``POST /detokenize`` takes
``tokens`` and answers ``{prompt}``. Field names and defaults are vLLM's
(``TokenizeCompletionRequest`` / ``TokenizeChatRequest`` as one body: exactly one of
``prompt`` and ``messages``). Tokenising goes through the engine's ``InputProcessor`` and its
encode rule (``TEXT_ADDS_SPECIAL_TOKENS`` / ``CHAT_ADDS_SPECIAL_TOKENS``), so the ids are those
a completion of the same input would run on (in PD too: the router tokenises).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, Field

from kthena_serve.client import EngineClient
from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.input_processor import CHAT_ADDS_SPECIAL_TOKENS, TEXT_ADDS_SPECIAL_TOKENS
from kthena_serve.model.errors import ChatTemplateError
from kthena_serve.server.protocol import ChatMessage
from kthena_serve.server.request_parts import Strict, refuse
from kthena_serve.server.tools import Tool, chat_inputs

if TYPE_CHECKING:
    from kthena_serve.engine.input_processor import InputProcessor

__all__ = ["DetokenizeRequest", "TokenizeRequest", "chat_ids", "detokenize", "tokenize"]

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
        ids = chat_ids(engine.processor, body.messages, body.tools,
                       add_generation_prompt=body.add_generation_prompt,
                       add_special_tokens=body.add_special_tokens,
                       continue_final_message=body.continue_final_message,
                       template_kwargs=body.chat_template_kwargs)
    else:
        ids = engine.processor.encode(
            body.prompt or "", add_special_tokens=_or(body.add_special_tokens,
                                                      TEXT_ADDS_SPECIAL_TOKENS))
    return {"count": len(ids), "max_model_len": engine.processor.limits.max_model_len, "tokens": ids,
            "token_strs": engine.processor.token_strs(ids) if body.return_token_strs else None}


def chat_ids(processor: InputProcessor, messages: Sequence[ChatMessage],
             tools: Sequence[Tool] | None, *, add_generation_prompt: bool = True,
             add_special_tokens: bool | None = None, continue_final_message: bool = False,
             template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The ids of a conversation as the chat route renders it (tools, assistant ``tool_calls``
    and tool messages: ``tools.chat_inputs``), by the encode rule: the template's special
    tokens only, unless ``add_special_tokens`` (None: the rule's default).

    Raises:
        InvalidRequestError: the template refuses the conversation (``messages``), a tool
            call's arguments are not JSON, or content is not valid Unicode.
    """
    rendered, extra = chat_inputs(messages, tools, processor.tokenizer.chat_template)
    try:
        return processor.encode_chat(
            rendered, add_generation_prompt=add_generation_prompt,
            add_special_tokens=_or(add_special_tokens, CHAT_ADDS_SPECIAL_TOKENS),
            continue_final_message=continue_final_message,
            template_kwargs={**(template_kwargs or {}), **extra})
    except ChatTemplateError as error:
        raise InvalidRequestError(str(error), "messages") from None


def detokenize(engine: EngineClient, body: DetokenizeRequest) -> dict[str, str]:
    """``{prompt}``: the text of ``tokens``, special tokens included.

    Raises:
        InvalidRequestError: an id outside the vocabulary.
    """
    return {"prompt": engine.processor.decode(body.tokens)}


def _or(value: bool | None, default: bool) -> bool:
    return default if value is None else value
