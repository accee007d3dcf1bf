"""Tool calls (chat): the request's tools in the prompt, the constraint ``required`` and a named
``tool_choice`` put on the output, and the Hermes ``<tool_call>`` parser that turns the output
into OpenAI ``tool_calls``.

One wire format, Hermes's (NousResearch Hermes 2 Pro, Qwen 2.5 / 3, and many fine-tunes)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* prompt: a chat template that takes ``tools`` (Hugging Face's convention) gets them, with
  assistant ``tool_calls`` and ``tool`` messages as it expects them. A template without tools
  support (the default SmolLM2's) gets them written into the system message in Hermes's words,
  assistant calls as ``<tool_call>`` blocks and tool results as ``<tool_response>`` blocks.
* ``required`` / named: an xgrammar structural tag holds the output to exactly one such block
  whose name is a tool's (the named one) and whose arguments follow its parameters' schema.
* ``auto``: the output is free; ``ToolCallParser`` splits it into content and calls (streamed:
  content as it comes, each call as one delta once its block closes).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kthena_serve.errors import InvalidRequestError
from kthena_serve.structured_output import StructuredOutputsParams

__all__ = ["CalledFunction", "NamedToolChoice", "Tool", "ToolCall", "ToolCallParser",
           "chat_inputs", "parse_tool_calls", "tool_constraint", "uses_hermes"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"

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
    """Whether this server can parse the tool calls of a model with this template: one without
    tools support (the tools go into the system message in Hermes's words) or one that writes
    Hermes's ``<tool_call>`` blocks."""
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
                    ) -> StructuredOutputsParams | None:
    """The output constraint of ``tool_choice``: ``required``: one call of any tool; named:
    one call of that tool; otherwise None (free text)."""
    if choice == "required":
        chosen = list(tools)
    elif isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name][:1]
    else:
        return None
    tags = [_call_tag(t.function) for t in chosen]
    form = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": form})


def _call_tag(function: FunctionDefinition) -> dict[str, Any]:
    """A Hermes block of one function: the JSON ``{"name": ..., "arguments": <schema>}``."""
    parameters = function.parameters or {"type": "object", "properties": {}}
    return {"type": "tag",
            "begin": f'{OPEN}\n{{"name": {json.dumps(function.name, ensure_ascii=False)}, '
                     '"arguments": ',
            "content": {"type": "json_schema", "json_schema": parameters},
            "end": f"}}\n{CLOSE}"}


# ---- the parser -------------------------------------------------------------------------------
def _call(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON inside a block, or None if it is not one."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"], "arguments": arguments}}


def _partial_open(text: str) -> int:
    """Length of the longest tail of ``text`` that could begin ``<tool_call>``."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser:
    """Splits one choice's text, as it streams, into content and Hermes tool calls.

    Content is handed out as soon as it cannot be the start of a block (a tail that may begin
    ``<tool_call>``, or trailing whitespace, waits for the next text); a block becomes a call
    once it closes (or at the end, unclosed, if its JSON is whole). A block that is not a call
    stays content. Whitespace next to calls is dropped.

    Args:
        max_calls: calls kept at most (``parallel_tool_calls: false``: 1); later ones dropped.
    """

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.num_calls = 0
        self._buffer = ""  # text not yet sorted out
        self._space = ""  # whitespace held back: content unless a call comes next
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Take new text; returns (content to send now, calls completed now)."""
        self._buffer += text
        content, calls = "", []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._inside = False
                content += self._block(body, True, calls)
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _partial_open(self._buffer)
                content += self._text(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content += self._text(self._buffer[:start])
            self._space, self._buffer, self._inside = "", self._buffer[start + len(OPEN):], True
        return content, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest at the end of the output: (content, calls)."""
        calls: list[dict[str, Any]] = []
        if self._inside:
            content = self._block(self._buffer, False, calls)
        else:
            content = self._text(self._buffer)
        self._buffer, self._inside = "", False
        if not self.num_calls:
            content += self._space
        self._space = ""
        return content, calls

    def _text(self, text: str) -> str:
        """Content between blocks, its trailing whitespace held back."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if self.num_calls and not body.strip():
            return ""
        return body

    def _block(self, body: str, closed: bool, calls: list[dict[str, Any]]) -> str:
        call = _call(body.strip())
        if call is None:
            return self._text(OPEN + body + (CLOSE if closed else ""))
        self._space = ""
        if self.max_calls is None or self.num_calls < self.max_calls:
            calls.append(call)
        self.num_calls += 1
        return ""


def parse_tool_calls(text: str, max_calls: int | None = None,
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole output; content None when only calls remain."""
    parser = ToolCallParser(max_calls)
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    content = (content + rest).strip()
    return content or None, calls + more
