"""Tool-call parsers, one per wire format, chosen by ``--tool-call-parser`` (vLLM's names):

========================  ==========================================================
name                      the model writes
========================  ==========================================================
``hermes`` (default)      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
``llama3_json``           ``{"name": ..., "parameters": {...}}``; several ``;``-separated
``mistral``               ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or
                          ``[TOOL_CALLS]name[ARGS]{...}``
``pythonic``              ``[name(key=literal, ...), ...]``
========================  ==========================================================

Each parser (``ToolParser``) splits one choice's text, as it streams, into content and
OpenAI's ``tool_calls`` deltas; ``parse_tool_calls`` adds a whole text's deltas up, so an
answer and its stream agree. ``FORMATS`` holds what the rest of the server needs to know of
each: whether the tools prompt written in Hermes's words fits it, and whether its marker is a
special token the text must keep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs

from kthena_serve.serve_args import TOOL_CALL_PARSERS
from kthena_serve.serve_args import check_tool_call_parser as check_parser_name
from kthena_serve.server.tool_parsers._stream import add_deltas
from kthena_serve.server.tool_parsers.hermes import HermesParser
from kthena_serve.server.tool_parsers.llama3_json import Llama3JsonParser
from kthena_serve.server.tool_parsers.mistral import MistralParser
from kthena_serve.server.tool_parsers.pythonic import PythonicParser

__all__ = ["DEFAULT_PARSER", "FORMATS", "ToolFormat", "ToolParser", "add_deltas",
           "check_parser_name", "parse_tool_calls"]


class ToolParser(Protocol):
    """One choice's text in, content and ``tool_calls`` deltas out."""

    num_calls: int  # calls seen so far (dropped ones past max_calls too)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Take new text; (content to send now, deltas to send now)."""
        ...

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The output ended: (the rest of the content, the last deltas)."""
        ...


@attrs.frozen
class ToolFormat:
    """One ``--tool-call-parser`` choice.

    Attributes:
        parser: makes a parser of one choice (its argument: ``max_calls``).
        keeps_special_tokens: the format's marker is a special token, so a chat that parses
            tool calls keeps special tokens in its text (Mistral's ``[TOOL_CALLS]``).
    """

    parser: Callable[[int | None], ToolParser]
    keeps_special_tokens: bool = False


DEFAULT_PARSER = "hermes"
FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(HermesParser),
    "llama3_json": ToolFormat(Llama3JsonParser),
    "mistral": ToolFormat(MistralParser, keeps_special_tokens=True),
    "pythonic": ToolFormat(PythonicParser),
}
assert tuple(FORMATS) == TOOL_CALL_PARSERS  # the flag's names, each with its parser


def parse_tool_calls(text: str, max_calls: int | None = None, parser: str = DEFAULT_PARSER,
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole output, as its stream adds up; content None when only
    whitespace (or nothing) remains."""
    split = FORMATS[check_parser_name(parser)].parser(max_calls)
    content, deltas = split.feed(text)
    rest, more = split.finish()
    calls: list[dict[str, Any]] = []
    add_deltas(calls, deltas + more)
    content = (content + rest).strip()
    return content or None, calls
