"""Llama 3.1 / 3.2 / 3.3's JSON tool calls, ``--tool-call-parser llama3_json``: the output is
one or more JSON objects, ``;``-separated, optionally after ``<|python_tag|>`` (a special
token, so usually left out of the text)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Calls are read only where the output begins with them (as the model writes them); an output
that begins otherwise is content. An object that is no call (``{"answer": 42}``) is content
from there on, and so is text after the calls that is not ``;`` and another call.
"""

from __future__ import annotations

from kthena_serve.server.tool_parsers._format import FormatParser, JsonCall

__all__ = ["PYTHON_TAG", "Llama3JsonParser"]

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(FormatParser):
    """See the module. States: start -> (tag) -> object -> after -> (``;``) object ... ;
    content once the format breaks."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._object: JsonCall | None = None

    def _step(self) -> bool:
        if self.state == "content":
            self._text(self._buffer)
            self._buffer = ""
            return False
        if not self._skip_space():
            return False
        if self.state in ("start", "tag"):
            if self.state == "start":
                tag = self._wait_for(PYTHON_TAG)
                if tag is None:
                    return False
                if tag:
                    self._read(len(PYTHON_TAG))
                    self.state = "tag"
                    return True
            if not self._buffer.startswith("{"):
                return self._give_up()
            self.state, self._object = "object", JsonCall(self)
        if self.state == "object":
            assert self._object is not None
            return self._scan_call(self._object, "after")
        # after a call: "; {" goes on, anything else is content
        if self._buffer.startswith(";"):
            self._read(1)
            self.state = "tag"
            return True
        return self._give_up()

    def _is_open_call(self) -> bool:
        return self.state == "object" and self._object is not None and self._object.is_streamed
