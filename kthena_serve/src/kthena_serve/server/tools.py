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
* ``required``: an xgrammar structural tag holds the output to one or more such blocks (one
  with ``parallel_tool_calls: false``), each naming a tool and its arguments following that
  tool's parameters' schema; named: exactly one block of that tool.
* ``auto``: the output is free. Either way ``ToolCallParser`` splits it into content and calls;
  streamed, a call's name goes out once written and its arguments as they are generated
  (OpenAI's ``tool_calls`` deltas).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.structured_output import StructuredOutputsParams

__all__ = ["CalledFunction", "NamedToolChoice", "Tool", "ToolCall", "ToolCallParser",
           "add_deltas", "chat_inputs", "parse_tool_calls", "tool_constraint", "uses_hermes"]

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
                    parallel: bool = True) -> StructuredOutputsParams | None:
    """The output constraint of ``tool_choice``, or None (free text).

    ``required``: one or more calls, each of any tool (one with ``parallel`` false), blocks
    separated by a newline; named: exactly one call of that tool.
    """
    if choice == "required":
        tags = [_call_tag(t.function) for t in tools]
        form: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                "at_least_one": True, "stop_after_first": not parallel}
    elif isinstance(choice, NamedToolChoice):
        chosen = next(t for t in tools if t.function.name == choice.function.name)
        form = _call_tag(chosen.function)
    else:
        return None
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
def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole block's JSON, or None if it is not a call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return data["name"], arguments


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


_SPACE = " \t\r\n"
_WAIT = None  # _header's "the text so far could still become a header"


def _header(body: str) -> tuple[str, int] | bool | None:
    """Where a block's text so far stands against ``{"name": "<name>", "arguments": ``
    (or ``"parameters"``): ``(name, where the arguments value starts)`` once written whole,
    None while the text could still become it, False once it cannot."""
    at, name = 0, ""
    for part in ("{", '"name"', ":", "<name>", ",", ('"arguments"', '"parameters"'), ":"):
        while at < len(body) and body[at] in _SPACE:
            at += 1
        rest = body[at:]
        if part == "<name>":
            end = _string_end(rest)
            if end is None or end is False:
                return end
            try:
                name = json.loads(rest[:end])
            except json.JSONDecodeError:
                return False
            at += end
            continue
        options = part if isinstance(part, tuple) else (part,)
        whole = next((o for o in options if rest.startswith(o)), None)
        if whole is None:
            return _WAIT if any(o.startswith(rest) for o in options) else False
        at += len(whole)
    while at < len(body) and body[at] in _SPACE:
        at += 1
    return (name, at) if at < len(body) else _WAIT


def _string_end(text: str) -> int | bool | None:
    """The end of the JSON string ``text`` begins with: its length with the quotes, None if it
    is not closed yet, False if ``text`` begins with no string."""
    if not text:
        return _WAIT
    if text[0] != '"':
        return False
    at = 1
    while at < len(text):
        if text[at] == "\\":
            at += 2
        elif text[at] == '"':
            return at + 1
        else:
            at += 1
    return _WAIT


class _Arguments:
    """Scans a streamed call's arguments (a JSON object or array) as they are written: how far
    they go so far, and whether they closed."""

    def __init__(self, start: int) -> None:
        self.end = start  # text scanned up to here is arguments
        self.is_closed = False
        self._depth = 0
        self._in_string = self._escaped = False

    def scan(self, body: str, limit: int) -> None:
        """Move ``end`` through ``body[:limit]``, stopping where the value closes."""
        while self.end < limit and not self.is_closed:
            char = body[self.end]
            self.end += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                self.is_closed = self._depth == 0


class ToolCallParser:
    """Splits one choice's text, as it streams, into content and Hermes tool calls in OpenAI's
    streamed shape (``tool_calls`` deltas).

    Content is handed out as soon as it cannot be the start of a block (a tail that may begin
    ``<tool_call>``, or trailing whitespace, waits for the next text). A block that begins
    ``{"name": "<name>", "arguments": {`` is a call from there on: its first delta carries
    ``index``, ``id``, ``type: "function"`` and ``function: {name, arguments: <what is written
    of them>}``, the next ones ``index`` and ``function.arguments`` fragments as the arguments
    are written, until their object closes (what follows up to ``</tool_call>`` is the block's
    end). Any other block waits for its end: JSON naming a function is a call sent in one delta
    (its arguments as JSON text), anything else stays content. Whitespace next to calls is
    dropped. ``parse_tool_calls`` adds the deltas up, so an answer and a stream agree.

    Args:
        max_calls: calls kept at most (``parallel_tool_calls: false``: 1); later ones dropped.
    """

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.num_calls = 0  # calls seen, dropped ones too
        self.num_sent = 0  # calls sent (the next one's index)
        self._buffer = ""  # outside a block: text not yet sorted out; inside: the block's text
        self._space = ""  # whitespace held back: content unless a call comes next
        self._inside = False
        self._header: tuple[str, int] | bool | None = _WAIT  # the block's, see _header
        self._arguments: _Arguments | None = None  # a streamed call's
        self._is_kept = False  # the streamed call is sent (not past max_calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Take new text; returns (content to send now, ``tool_calls`` deltas to send now)."""
        self._buffer += text
        content, deltas = "", []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                limit = len(self._buffer) - _partial(self._buffer, CLOSE) if end < 0 else end
                self._stream(limit, deltas)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                content += self._end_block(body, True, deltas)
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _partial(self._buffer, OPEN)
                content += self._text(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content += self._text(self._buffer[:start])
            self._space, self._buffer, self._inside = "", self._buffer[start + len(OPEN):], True
            self._header, self._arguments = _WAIT, None
        return content, _merged(deltas)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest at the end of the output: (content, deltas)."""
        deltas: list[dict[str, Any]] = []
        if self._inside:
            self._stream(len(self._buffer), deltas)
            content = self._end_block(self._buffer, False, deltas)
        else:
            content = self._text(self._buffer)
        self._buffer, self._inside = "", False
        if not self.num_calls:
            content += self._space
        self._space = ""
        return content, _merged(deltas)

    def _stream(self, limit: int, deltas: list[dict[str, Any]]) -> None:
        """Inside a block, ``self._buffer[:limit]`` written: a call's header and arguments."""
        body = self._buffer[:limit]
        if self._arguments is None and self._header is _WAIT:
            self._header = _header(body)
            if isinstance(self._header, tuple) and body[self._header[1]] in "{[":
                name, start = self._header
                self._arguments = _Arguments(start)
                self._is_kept = self._count_call()
                if self._is_kept:
                    deltas.append({"index": self.num_sent, "id": _new_id(), "type": "function",
                                   "function": {"name": name, "arguments": ""}})
                    self.num_sent += 1
        if self._arguments is not None:
            begin = self._arguments.end
            self._arguments.scan(body, limit)
            if self._is_kept and self._arguments.end > begin:
                deltas.append({"index": self.num_sent - 1, "function": {
                    "arguments": body[begin:self._arguments.end]}})

    def _end_block(self, body: str, closed: bool, deltas: list[dict[str, Any]]) -> str:
        """A block ended (``closed``: by ``</tool_call>``, else by the output's end): content
        for one that is no call."""
        self._inside = False
        if self._arguments is not None:  # streamed: it is a call, however it ends
            self._arguments = None
            return ""
        call = _call(body.strip())
        if call is None:
            return self._text(OPEN + body + (CLOSE if closed else ""))
        if self._count_call():
            name, arguments = call
            deltas.append({"index": self.num_sent, "id": _new_id(), "type": "function",
                           "function": {"name": name, "arguments": arguments}})
            self.num_sent += 1
        return ""

    def _count_call(self) -> bool:
        """A call begins: whether it is kept (within ``max_calls``)."""
        self._space = ""
        self.num_calls += 1
        return self.max_calls is None or self.num_sent < self.max_calls

    def _text(self, text: str) -> str:
        """Content between blocks, its trailing whitespace held back."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if self.num_calls and not body.strip():
            return ""
        return body


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas of one step with those of the same call joined (one entry per call)."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if out and out[-1]["index"] == delta["index"]:
            out[-1]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            out.append({**delta, "function": dict(delta["function"])})
    return out


def add_deltas(calls: list[dict[str, Any]], deltas: Sequence[dict[str, Any]]) -> None:
    """Fold ``tool_calls`` deltas into whole calls, as an OpenAI client does."""
    for delta in deltas:
        if delta["index"] == len(calls):
            calls.append({"id": delta["id"], "type": delta["type"],
                          "function": {"name": delta["function"]["name"], "arguments": ""}})
        calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]


def parse_tool_calls(text: str, max_calls: int | None = None,
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole output, as its stream adds up; content None when only calls
    remain."""
    parser = ToolCallParser(max_calls)
    content, deltas = parser.feed(text)
    rest, more = parser.finish()
    calls: list[dict[str, Any]] = []
    add_deltas(calls, deltas + more)
    content = (content + rest).strip()
    return content or None, calls
