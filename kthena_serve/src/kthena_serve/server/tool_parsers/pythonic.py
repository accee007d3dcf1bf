"""Pythonic tool calls (Llama 3.2 / Llama 4 pythonic templates, and others),
``--tool-call-parser pythonic``: the output begins with a Python list of calls, keyword
arguments only, each value a literal::

    [get_weather(city="Paris", unit="celsius"), get_time()]

optionally inside Llama 4's ``<|python_start|>`` ... ``<|python_end|>``. Values are read with
``ast.literal_eval`` (never evaluated): strings, numbers, True / False / None, lists, tuples
and dicts with string keys; they become the arguments' JSON. Each argument is sent once read
whole (the first with the call's name): ``{"city": "Paris"``, then ``, "unit": "celsius"``,
then ``}``, which add up to ``json.dumps`` of the arguments.

An output that does not begin with ``[name(`` and a valid first argument (or ``)``) is
content; past a valid call, what breaks the form is content from there on, and a call whose
argument breaks it ends with the arguments read so far.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from kthena_serve.server.tool_parsers._format import FormatParser

__all__ = ["PYTHON_END", "PYTHON_START", "PythonicParser", "python_literal"]

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*)\s*\(")
_MAYBE_CALL = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\s*\Z")
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)(.*)\Z", re.DOTALL)


def python_literal(source: str) -> Any:
    """The JSON value of a Python literal's source.

    Raises:
        ValueError: not a literal, or one JSON has no value for (bytes, sets, complex numbers,
            inf / nan, dict keys that are not strings).
    """
    try:
        value = ast.literal_eval(source.strip())
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as error:
        raise ValueError(f"not a Python literal: {error}") from None
    return _json_value(value)


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} has no JSON value")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("a dict's keys must be strings")
        return {k: _json_value(v) for k, v in value.items()}
    raise ValueError(f"a {type(value).__name__} has no JSON value")


class _Scanner:
    """Finds the end of one argument of a call as its text is written: the ``,`` or ``)`` at
    depth 0 outside strings (single, double and triple quotes, backslash escapes)."""

    def __init__(self) -> None:
        self.at = 0
        self._depth = 0
        self._quote = ""
        self._escaped = False

    def scan(self, text: str, is_final: bool) -> int | None:
        """Where the argument ends (the index of its terminator), or None if not yet."""
        while self.at < len(text):
            char = text[self.at]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif text.startswith(self._quote, self.at):
                    self.at += len(self._quote)
                    self._quote = ""
                    continue
                elif len(self._quote) == 3 and char == self._quote[0] and not is_final \
                        and len(text) - self.at < 3:
                    return None  # may begin the closing quotes
                self.at += 1
                continue
            if char in "'\"":
                rest = text[self.at:self.at + 3]
                if len(rest) < 3 and rest == char * len(rest) and not is_final:
                    return None  # '' or ''' : not known yet
                self._quote = char * 3 if rest == char * 3 else char
                self.at += len(self._quote)
                continue
            if char in "([{":
                self._depth += 1
            elif char in ")]}" or char == ",":
                if self._depth == 0:
                    return self.at
                if char != ",":
                    self._depth -= 1
            self.at += 1
        return None


class PythonicParser(FormatParser):
    """See the module. States: start -> (tag) -> list -> call -> argument ... -> after ->
    (``,``) call ... (``]``) content; content once the form breaks."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._name = ""
        self._arguments: list[str] = []  # this call's arguments read, as JSON "key": value
        self._keys: set[str] = set()
        self._scanner = _Scanner()
        self._is_begun = False  # this call's first delta went out

    def _step(self) -> bool:
        if self.state == "content":
            self._text(self._buffer)
            self._buffer = ""
            return False
        if self.state == "argument":
            return self._argument_step()
        if not self._skip_space():
            return False
        if self.state == "start":
            tag = self._wait_for(PYTHON_START)
            if tag is None:
                return False
            if tag:
                self._read(len(PYTHON_START))
            self.state = "list"
            return True
        if self.state == "list":
            if not self._buffer.startswith("["):
                return self._give_up()
            self._read(1)
            self.state = "call"
            return True
        if self.state == "call":
            return self._call_step()
        if self.state == "end":
            return self._end_step()
        return self._after_step()

    def _call_step(self) -> bool:
        if self.calls.num_calls and self._buffer.startswith("]"):  # [f(), ]
            return self._end_list()
        match = _CALL.match(self._buffer)
        if match is None:
            if _MAYBE_CALL.match(self._buffer) and not self._is_final:
                return False
            return self._give_up()
        self._read(match.end())
        self._name, self._arguments, self._keys = match.group(1), [], set()
        self._scanner, self._is_begun, self.state = _Scanner(), False, "argument"
        return True

    def _argument_step(self) -> bool:
        end = self._scanner.scan(self._buffer, self._is_final)
        if end is None:
            return False
        text, terminator = self._buffer[:end], self._buffer[end]
        if terminator == ")" and not text.strip() and not self._arguments:
            self._read(end + 1)
            self._emit("{}")
            self.state = "after"
            return True
        pair = self._keyword(text) if terminator in ",)" else None
        if pair is None:
            if self._is_begun:
                self.calls.extend("}")
                self._raw = ""
            return self._give_up()
        self._read(end + 1)
        self._emit(("{" if not self._arguments else ", ") + pair)
        self._arguments.append(pair)
        self._scanner = _Scanner()
        if terminator == ")":
            self.calls.extend("}")
            self.state = "after"
        return True

    def _keyword(self, text: str) -> str | None:
        """``key=literal`` as JSON ``"key": value``, or None if it is not one."""
        match = _KEYWORD.match(text)
        if match is None or match.group(1) in self._keys:
            return None
        try:
            value = python_literal(match.group(2))
        except ValueError:
            return None
        self._keys.add(match.group(1))
        return f"{json.dumps(match.group(1))}: {json.dumps(value, ensure_ascii=False)}"

    def _emit(self, fragment: str) -> None:
        if self._is_begun:
            self.calls.extend(fragment)
        else:
            self._begin(self._name, fragment)
            self._is_begun = True

    def _after_step(self) -> bool:
        if self._buffer.startswith(","):
            self._read(1)
            self.state = "call"
            return True
        if self._buffer.startswith("]"):
            return self._end_list()
        return self._give_up()

    def _end_list(self) -> bool:
        self._read(1)
        self._raw, self.state = "", "end"
        return True

    def _end_step(self) -> bool:
        """After the list: Llama 4's ``<|python_end|>`` if it follows, then content."""
        tag = self._wait_for(PYTHON_END)
        if tag is None:
            return False
        if tag:
            self._read(len(PYTHON_END))
        self._raw, self.state = "", "content"
        return True

    def _is_open_call(self) -> bool:
        return self.state == "argument" and self._is_begun
