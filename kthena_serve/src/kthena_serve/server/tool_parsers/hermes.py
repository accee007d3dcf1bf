"""Hermes's tool calls (NousResearch Hermes 2 Pro / 3, Qwen 2.5 / 3 and many fine-tunes),
``--tool-call-parser hermes``, the default::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Blocks may stand anywhere in the output, with content around them.
"""

from __future__ import annotations

from typing import Any

from kthena_serve.server.tool_parsers._stream import (
    WAIT,
    JsonScanner,
    call_of,
    header,
    merged,
    new_id,
    partial,
)

__all__ = ["CLOSE", "OPEN", "HermesParser"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser:
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
        self._header: tuple[str, int] | bool | None = WAIT  # the block's, see header
        self._arguments: JsonScanner | None = None  # a streamed call's
        self._is_kept = False  # the streamed call is sent (not past max_calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Take new text; returns (content to send now, ``tool_calls`` deltas to send now)."""
        self._buffer += text
        content, deltas = "", []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                limit = len(self._buffer) - partial(self._buffer, CLOSE) if end < 0 else end
                self._stream(limit, deltas)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                content += self._end_block(body, True, deltas)
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = partial(self._buffer, OPEN)
                content += self._text(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content += self._text(self._buffer[:start])
            self._space, self._buffer, self._inside = "", self._buffer[start + len(OPEN):], True
            self._header, self._arguments = WAIT, None
        return content, merged(deltas)

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
        return content, merged(deltas)

    def _stream(self, limit: int, deltas: list[dict[str, Any]]) -> None:
        """Inside a block, ``self._buffer[:limit]`` written: a call's header and arguments."""
        body = self._buffer[:limit]
        if self._arguments is None and self._header is WAIT:
            self._header = header(body)
            if isinstance(self._header, tuple) and body[self._header[1]] in "{[":
                name, start = self._header
                self._arguments = JsonScanner(start)
                self._is_kept = self._count_call()
                if self._is_kept:
                    deltas.append({"index": self.num_sent, "id": new_id(), "type": "function",
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
        call = call_of(body.strip())
        if call is None:
            return self._text(OPEN + body + (CLOSE if closed else ""))
        if self._count_call():
            name, arguments = call
            deltas.append({"index": self.num_sent, "id": new_id(), "type": "function",
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
