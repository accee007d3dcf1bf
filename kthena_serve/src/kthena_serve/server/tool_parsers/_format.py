"""The frame of the parsers after Hermes (llama3_json, mistral, pythonic): text is fed in, a
parser's ``_step`` moves its state on while the text decides something, and what it decides
is content (trailing whitespace held until the next text: it goes only if no call follows) or
calls (``Calls``). Text a format reads and then finds is no call after all (``_raw``) goes back
to content; a call begun stays a call, even if the output ends inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kthena_serve.server.tool_parsers._stream import (
    SPACE,
    Calls,
    JsonScanner,
    call_of,
    header,
    new_id,
)

__all__ = ["FormatParser", "JsonCall"]


class FormatParser:
    """A parser of one choice's text: ``feed`` each new text, ``finish`` at the end; each
    returns (content to send now, ``tool_calls`` deltas to send now).

    Subclasses define ``_step`` (advance on ``self._buffer``; False when it must wait for more
    text, or when ``_is_final`` and nothing is left to decide) and set ``state``.
    """

    make_id: Callable[[], str] = staticmethod(new_id)  # a new call's id

    def __init__(self, max_calls: int | None = None) -> None:
        self.calls = Calls(max_calls, self.make_id)
        self.state = "start"
        self._buffer = ""  # text not yet decided
        self._raw = ""  # text read as a format's frame since the last call (content if no call)
        self._is_final = False
        self._content: list[str] = []
        self._space = ""  # whitespace held back: content unless a call comes next

    @property
    def num_calls(self) -> int:
        return self.calls.num_calls

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buffer += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        self._is_final = True
        while self._step():
            pass
        if not self._is_open_call():
            self._text(self._raw + self._buffer)
        self._raw = self._buffer = ""
        if not self.calls.num_calls:
            self._content.append(self._space)
        self._space = ""
        return self._take()

    # ---- for the formats ----------------------------------------------------------------------
    def _step(self) -> bool:
        raise NotImplementedError

    def _is_open_call(self) -> bool:
        """At the end: whether the text left is a call the output ended inside."""
        return False

    def _take(self) -> tuple[str, list[dict[str, Any]]]:
        content, self._content = "".join(self._content), []
        return content, self.calls.take()

    def _text(self, text: str) -> None:
        """Content, its trailing whitespace held back; only whitespace once calls came: none."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if self.calls.num_calls and not body.strip():
            return
        self._content.append(body)

    def _begin(self, name: str, arguments: str = "") -> None:
        """A call begins: the frame read for it is no content."""
        self._space = self._raw = ""
        self.calls.begin(name, arguments)

    def _read(self, size: int) -> str:
        """Take ``size`` characters of frame from the buffer."""
        part, self._buffer = self._buffer[:size], self._buffer[size:]
        self._raw += part
        return part

    def _skip_space(self) -> bool:
        """Read leading whitespace as frame; whether any text is left after it."""
        size = len(self._buffer) - len(self._buffer.lstrip(SPACE))
        self._read(size)
        return bool(self._buffer)

    def _give_up(self, state: str = "content") -> bool:
        """The format broke here: the frame read since the last call is content, and the
        buffer is read from ``state`` on."""
        self._text(self._raw)
        self._raw = ""
        self.state = state
        return True

    def _scan_call(self, call: JsonCall, then: str) -> bool:
        """Go on with ``call``, the JSON object at the buffer's start: False while it is not
        complete; once it is, consume it and go to state ``then``; give up if it is no call."""
        end = call.scan(self._buffer)
        if end is None:
            return False
        if end is False:
            return self._give_up()
        self._buffer = self._buffer[end:]
        self._raw, self.state = "", then
        return True

    def _wait_for(self, tag: str) -> bool | None:
        """The buffer against ``tag``: True if it begins with it, None while it could still,
        False if it cannot (or the output ended)."""
        if self._buffer.startswith(tag):
            return True
        if tag.startswith(self._buffer) and not self._is_final:
            return None
        return False


class JsonCall:
    """One call's JSON object as it is written, its ``{`` at the buffer's start:
    ``{"name": "<name>", "arguments": {...`` (or ``"parameters"``) streams the name, then the
    arguments as they are written; any other object waits for its end and is a call if it names
    one (``call_of``)."""

    def __init__(self, parser: FormatParser) -> None:
        self._parser = parser
        self._object = JsonScanner(0)
        self._header: tuple[str, int] | bool | None = None
        self._arguments: JsonScanner | None = None

    @property
    def is_streamed(self) -> bool:
        return self._arguments is not None

    def scan(self, body: str) -> int | bool | None:
        """The object's end once it closed as a call, False once it closed as no call, None
        while open."""
        self._object.scan(body, len(body))
        written = body[:self._object.end]
        if self._arguments is None and self._header is None:
            self._header = header(written)
            if isinstance(self._header, tuple) and written[self._header[1]] in "{[":
                name, start = self._header
                self._arguments = JsonScanner(start)
                self._parser._begin(name)
        if self._arguments is not None:
            begin = self._arguments.end
            self._arguments.scan(written, len(written))
            self._parser.calls.extend(written[begin:self._arguments.end])
        if not self._object.is_closed:
            return None
        if self._arguments is not None:
            return self._object.end
        call = call_of(written)
        if call is None:
            return False
        self._parser._begin(*call)
        return self._object.end
