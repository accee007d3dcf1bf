"""Mistral's tool calls, ``--tool-call-parser mistral``, in both of its tokenizers' forms::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(the first: Mistral 7B v0.3, Mixtral, Nemo; the second: tokenizers v11 and later). Text
before ``[TOOL_CALLS]`` is content. ``[TOOL_CALLS]`` is a special token: the server keeps special
tokens in the text of a chat that parses tool calls with this parser (as vLLM does). Call ids
are nine letters and digits, the only ids Mistral's templates take back.
"""

from __future__ import annotations

import re

from kthena_serve.server.tool_parsers._format import FormatParser, JsonCall
from kthena_serve.server.tool_parsers._stream import JsonScanner, mistral_id, partial

__all__ = ["ARGS", "TOOL_CALLS", "MistralParser"]

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralParser(FormatParser):
    """See the module. States: content -> marker -> list (object, ``,`` ... ``]``) or name ->
    arguments; content again after the calls (where another ``[TOOL_CALLS]`` may begin)."""

    make_id = staticmethod(mistral_id)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.state = "content"
        self._object: JsonCall | None = None
        self._arguments: JsonScanner | None = None
        self._in_list = False  # the calls are a JSON list
        self._name = ""  # the name of a [ARGS] call

    def _step(self) -> bool:
        state = self.state
        if state == "content":
            return self._content_step()
        if state == "object":
            return self._object_step()
        if state == "arguments":
            return self._arguments_step()
        if not self._skip_space():
            return False
        if state == "marker":
            if self._buffer[0] == "[":
                self._read(1)
                self.state, self._in_list = "item", True
                return True
            if self._buffer[0] == "{":  # one call, no list
                self.state, self._object = "object", JsonCall(self)
                return True
            self.state = "name"
            return True
        if state == "item":
            if not self._buffer.startswith("{"):
                return self._give_up()
            self.state, self._object = "object", JsonCall(self)
            return True
        if state == "next":  # after a call in the list
            if self._buffer[0] == ",":
                self._read(1)
                self.state = "item"
                return True
            if self._buffer[0] == "]":  # the list's end: the frame read is no content
                self._buffer = self._buffer[1:]
                self._raw, self.state = "", "content"
                return True
            return self._give_up()
        return self._name_step()

    def _content_step(self) -> bool:
        start = self._buffer.find(TOOL_CALLS)
        if start < 0:
            keep = 0 if self._is_final else partial(self._buffer, TOOL_CALLS)
            self._text(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._text(self._buffer[:start])
        self._buffer = self._buffer[start:]
        self._read(len(TOOL_CALLS))
        self.state, self._in_list = "marker", False
        return True

    def _object_step(self) -> bool:
        assert self._object is not None
        return self._scan_call(self._object, "next" if self._in_list else "content")

    def _name_step(self) -> bool:
        """``name[ARGS]``: the name once ``[ARGS]`` follows it."""
        name = _NAME.match(self._buffer).group()  # type: ignore[union-attr]
        rest = self._buffer[len(name):]
        if rest.startswith(ARGS) and name:
            self._read(len(name) + len(ARGS))
            self._name, self.state = name, "arguments"
            return True
        if ARGS.startswith(rest) and not self._is_final:
            return False
        return self._give_up()

    def _arguments_step(self) -> bool:
        if self._arguments is None:
            if not self._skip_space():
                return False
            if self._buffer[0] not in "{[":
                return self._give_up()
            self._begin(self._name)
            self._arguments = JsonScanner(0)
        begin = self._arguments.end
        self._arguments.scan(self._buffer, len(self._buffer))
        self.calls.extend(self._buffer[begin:self._arguments.end])
        if not self._arguments.is_closed:
            return False
        self._buffer = self._buffer[self._arguments.end:]
        self._arguments, self.state = None, "content"
        return True

    def _is_open_call(self) -> bool:
        if self.state == "arguments":
            return self._arguments is not None
        return self.state == "object" and self._object is not None and self._object.is_streamed
