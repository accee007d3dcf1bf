"""Tool calls (chat): the request's tools in the prompt, the constraint ``required`` and a named
``tool_choice`` put on the output, in the wire format of the server's ``--tool-call-parser``
(tool_parsers/ holds the parsers that turn the output into OpenAI ``tool_calls``).

The default format is Hermes's (NousResearch Hermes 2 Pro, Qwen 2.5 / 3, and many fine-tunes)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* prompt: a chat template that takes ``tools`` (Hugging Face's convention) gets them, with
  assistant ``tool_calls`` and ``tool`` messages as it expects them. A template without tools
  support (the default SmolLM2's) gets them written into the system message in Hermes's words,
  assistant calls as ``<tool_call>`` blocks and tool results as ``<tool_response>`` blocks; only
  the hermes parser reads what such a prompt asks for (``check_tool_format``).
* ``required``: an xgrammar structural tag holds the output to one or more calls in the parser's
  format (one with ``parallel_tool_calls: false``), each naming a tool and its arguments
  following that tool's parameters' schema; named: exactly one call of that tool. pythonic
  calls are Python, which no grammar here holds to a JSON schema: refused.
* ``auto``: the output is free. Either way the parser splits it into content and calls;
  streamed, a call's name goes out once written and its arguments as they are generated
  (OpenAI's ``tool_calls`` deltas).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import attrs
from pydantic import BaseModel, ConfigDict, Field

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.server.tool_parsers import (
    DEFAULT_PARSER,
    FORMATS,
    add_deltas,
    check_parser_name,
    parse_tool_calls,
)
from kthena_serve.server.tool_parsers.hermes import CLOSE, OPEN
from kthena_serve.server.tool_parsers.hermes import HermesParser as ToolCallParser

__all__ = ["CalledFunction", "NamedToolChoice", "Tool", "ToolCall", "ToolCallParser",
           "add_deltas", "chat_inputs", "check_tool_format", "parse_tool_calls",
           "tool_constraint", "tool_params", "uses_hermes"]

_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class _Part(BaseModel):
    # nested parts of a body: strict types, unknown keys ignored (as message fields are)
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class FunctionDefinition(_Part):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class _ToolName(_Part):
    name: str = Field(min_length=1)


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: _ToolName


class CalledFunction(_Part):
    name: str
    arguments: str | dict[str, Any]  # OpenAI's: JSON text; an object is taken too

    def arguments_object(self, where: str) -> Any:
        """The arguments as a JSON value.

        Raises:
            InvalidRequestError: text that is not JSON (``where`` names the message field).
        """
        if not isinstance(self.arguments, str):
            return self.arguments
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"{where}.function.arguments is not JSON: {error}",
                                      "messages") from None


class ToolCall(_Part):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


# ---- the prompt ---------------------------------------------------------------------------------
class ChatMessage(Protocol):
    """What rendering reads of a message (``protocol.ChatMessage`` has it)."""

    role: str
    name: str | None
    tool_calls: Sequence[ToolCall] | None
    tool_call_id: str | None

    def text(self) -> str: ...


@functools.lru_cache(maxsize=8)
def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template reads a ``tools`` variable (Hugging Face's convention)."""
    if not template:
        return False
    import jinja2
    import jinja2.meta

    return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))


def uses_hermes(template: str | None) -> bool:
    """Whether the hermes parser reads the tool calls of a model with this template: one
    without tools support (the tools go into the system message in Hermes's words) or one that
    writes Hermes's ``<tool_call>`` blocks."""
    return not template_takes_tools(template) or OPEN in (template or "")


def chat_inputs(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages as the template reads them, extra template variables) for a conversation.

    Raises:
        InvalidRequestError: a tool call whose arguments are not JSON.
    """
    native = template_takes_tools(template)
    rendered = [_message(m, i, native) for i, m in enumerate(messages)]
    if not tools:
        return rendered, {}
    specs = [t.model_dump(exclude_none=True) for t in tools]
    if native:
        return rendered, {"tools": specs}
    block = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(s, ensure_ascii=False)
                                                 for s in specs))
    if rendered and rendered[0]["role"] in ("system", "developer"):
        first = rendered[0]
        rendered[0] = {**first, "content": f"{first['content']}\n\n{block}".lstrip()}
    else:
        rendered.insert(0, {"role": "system", "content": block})
    return rendered, {}


def _message(message: ChatMessage, index: int, native: bool) -> dict[str, Any]:
    item: dict[str, Any] = {"role": message.role, "content": message.text()}
    calls = [(c.function.name, c.function.arguments_object(f"messages[{index}].tool_calls[{j}]"),
              c.id) for j, c in enumerate(message.tool_calls or ())]
    if native:
        if message.name is not None:
            item["name"] = message.name
        if calls:
            item["tool_calls"] = [{"id": i, "type": "function",
                                   "function": {"name": n, "arguments": a}} for n, a, i in calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        return item
    if calls:
        blocks = [f"{OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n"
                  f"{CLOSE}" for n, a, _ in calls]
        item["content"] = "\n".join([item["content"], *blocks] if item["content"] else blocks)
    if message.role == "tool":
        item["content"] = f"<tool_response>\n{item['content']}\n</tool_response>"
    return item


# ---- the constraint ---------------------------------------------------------------------------
def tool_constraint(tools: Sequence[Tool], choice: str | NamedToolChoice | None,
                    parallel: bool = True, parser: str = DEFAULT_PARSER,
                    ) -> StructuredOutputsParams | None:
    """The output constraint of ``tool_choice`` in ``parser``'s format, or None (free text).

    ``required``: one or more calls, each of any tool (one with ``parallel`` false); named:
    exactly one call of that tool. hermes: ``<tool_call>`` blocks separated by a newline;
    llama3_json: ``{"name", "parameters"}`` objects separated by ``; ``; mistral:
    ``[TOOL_CALLS][{"name", "arguments"}, ...]``.

    Raises:
        InvalidRequestError: ``required`` or named with the pythonic parser.
    """
    if choice == "required":
        tags = [_call_tag(t.function, parser) for t in tools]
        form: dict[str, Any] = {"type": "tags_with_separator", "tags": tags,
                                "separator": _SEPARATORS[parser],
                                "at_least_one": True, "stop_after_first": not parallel}
    elif isinstance(choice, NamedToolChoice):
        chosen = next(t for t in tools if t.function.name == choice.function.name)
        form = _call_tag(chosen.function, parser)
    else:
        return None
    if parser == "mistral":
        form = {"type": "sequence", "elements": [
            {"type": "const_string", "value": "[TOOL_CALLS]["}, form,
            {"type": "const_string", "value": "]"}]}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": form})


_SEPARATORS = {"hermes": "\n", "llama3_json": "; ", "mistral": ", "}


def _call_tag(function: FunctionDefinition, parser: str) -> dict[str, Any]:
    """One call of ``function`` in ``parser``'s format, its arguments following the schema."""
    if parser not in _SEPARATORS:
        raise InvalidRequestError(
            f"tool_choice required or named: --tool-call-parser {parser} writes calls as "
            "Python, which no grammar here holds to the tools' schemas; send tool_choice auto "
            f"or none (constrained calls need one of {', '.join(_SEPARATORS)})",
            "tool_choice")
    parameters = function.parameters or {"type": "object", "properties": {}}
    name = json.dumps(function.name, ensure_ascii=False)
    key = "parameters" if parser == "llama3_json" else "arguments"
    begin, end = f'{{"name": {name}, "{key}": ', "}"
    if parser == "hermes":
        begin, end = f"{OPEN}\n{begin}", f"}}\n{CLOSE}"
    return {"type": "tag", "begin": begin,
            "content": {"type": "json_schema", "json_schema": parameters}, "end": end}


def tool_params(params: SamplingParams, tools: Sequence[Tool] | None,
                choice: str | NamedToolChoice, parallel: bool, parser: str) -> SamplingParams:
    """A chat's sampling parameters for ``parser`` (the request's own, which hold the hermes
    constraint, for hermes): a ``required`` or named choice constrained in its format, and
    special tokens kept in the text where its marker is one (mistral).

    Raises:
        InvalidRequestError: a constraint the parser's format cannot have (pythonic).
    """
    if parser == DEFAULT_PARSER or not tools or choice == "none":
        return params
    constraint = tool_constraint(tools, choice, parallel, parser)
    if constraint is not None:
        params = attrs.evolve(params, structured_outputs=constraint)
    if FORMATS[parser].keeps_special_tokens:
        params = attrs.evolve(params, skip_special_tokens=False)
    return params


def check_tool_format(template: str | None, parser: str) -> None:
    """Refuse tools whose calls ``parser`` could not read back: a template that takes tools
    but writes no Hermes blocks under the hermes parser, or (any other parser) a template that
    takes no tools, whose prompt asks for Hermes blocks.

    Raises:
        InvalidRequestError: names the parser and what to change (param ``tools``).
    """
    check_parser_name(parser)
    if parser == DEFAULT_PARSER and not uses_hermes(template):
        raise InvalidRequestError(
            "tools: this checkpoint's chat template writes tool calls in a format the hermes "
            "parser does not read (it reads <tool_call> blocks); serve with --tool-call-parser "
            f"{'|'.join(p for p in FORMATS if p != DEFAULT_PARSER)} as fits the model, or send "
            "tool_choice none or leave tools out", "tools")
    if parser != DEFAULT_PARSER and not template_takes_tools(template):
        raise InvalidRequestError(
            f"tools: this checkpoint's chat template takes no tools, so they are described in "
            f"Hermes's words, which --tool-call-parser {parser} does not read; serve it with "
            "--tool-call-parser hermes, or send tool_choice none or leave tools out", "tools")
