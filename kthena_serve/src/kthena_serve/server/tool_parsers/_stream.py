"""What every tool-call parser shares: the calls of one choice as OpenAI streams them
(``Calls``: a call's first delta with ``index``, ``id``, ``type`` and ``function.name``, then
``function.arguments`` fragments), and the scanners that find where a JSON call's header, its
arguments and its object end in text that is still being written.

A scanner answers "not yet" (None) while more text could change its answer, so a parser's
decisions depend on the text only, never on how it was cut into deltas.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Calls", "JsonScanner", "add_deltas", "call_of", "header", "merged", "mistral_id",
           "new_id", "partial"]

SPACE = " \t\r\n"
WAIT = None  # header's "the text so far could still become a header"


def new_id() -> str:
    """An OpenAI-style call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_id() -> str:
    """A Mistral call id: nine letters and digits (Mistral's chat templates refuse others when
    the call comes back in a later turn)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def partial(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def call_of(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole call's JSON ``{"name", "arguments"}`` (or
    ``"parameters"``), or None if it is not one."""
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


def header(body: str) -> tuple[str, int] | bool | None:
    """Where a call's JSON so far stands against ``{"name": "<name>", "arguments": ``
    (or ``"parameters"``): ``(name, where the arguments value starts)`` once written whole,
    None while the text could still become it, False once it cannot."""
    at, name = 0, ""
    for part in ("{", '"name"', ":", "<name>", ",", ('"arguments"', '"parameters"'), ":"):
        while at < len(body) and body[at] in SPACE:
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
            return WAIT if any(o.startswith(rest) for o in options) else False
        at += len(whole)
    while at < len(body) and body[at] in SPACE:
        at += 1
    return (name, at) if at < len(body) else WAIT


def _string_end(text: str) -> int | bool | None:
    """The end of the JSON string ``text`` begins with: its length with the quotes, None if it
    is not closed yet, False if ``text`` begins with no string."""
    if not text:
        return WAIT
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
    return WAIT


class JsonScanner:
    """Scans a JSON object or array as it is written: how far it goes so far (``end``), and
    whether it closed (``is_closed``)."""

    def __init__(self, start: int) -> None:
        self.end = start  # text scanned up to here belongs to the value
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


class Calls:
    """One choice's calls as deltas: a call begins with its name (``begin``) and grows by
    argument fragments (``extend``); past ``max_calls`` a call is counted but not sent.

    Args:
        max_calls: calls sent at most (``parallel_tool_calls: false``: 1); None: all.
        make_id: a new call's id.
    """

    def __init__(self, max_calls: int | None, make_id: Callable[[], str] = new_id) -> None:
        self.max_calls = max_calls
        self.num_calls = 0  # calls begun, dropped ones too
        self.num_sent = 0  # calls sent (the next one's index)
        self._make_id = make_id
        self._is_kept = False
        self._deltas: list[dict[str, Any]] = []

    def begin(self, name: str, arguments: str = "") -> None:
        self.num_calls += 1
        self._is_kept = self.max_calls is None or self.num_sent < self.max_calls
        if self._is_kept:
            self._deltas.append({"index": self.num_sent, "id": self._make_id(),
                                 "type": "function",
                                 "function": {"name": name, "arguments": arguments}})
            self.num_sent += 1

    def extend(self, fragment: str) -> None:
        """More of the current call's arguments."""
        if self._is_kept and fragment:
            self._deltas.append({"index": self.num_sent - 1,
                                 "function": {"arguments": fragment}})

    def take(self) -> list[dict[str, Any]]:
        """The deltas since the last ``take``, one entry per call."""
        out, self._deltas = merged(self._deltas), []
        return out


def merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
