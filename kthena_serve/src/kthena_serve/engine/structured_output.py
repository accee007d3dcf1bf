"""StructuredOutputsParams: the shape a request's output must take (a frozen value; vLLM's).

Exactly one constraint per request, with vLLM's names: a JSON schema (``json``), any JSON
object (``json_object``), a regular expression (``regex``), one of a list of strings
(``choice``), an EBNF grammar (``grammar``, xgrammar's GBNF dialect) or an xgrammar structural
tag (``structural_tag``, what tool calls are constrained by). It is plain data, so it travels
inside ``SamplingParams`` (and PD's JSON between workers); ``grammar.py`` compiles it.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.schema_check import check_json_schema

__all__ = ["CONSTRAINTS", "StructuredOutputsParams", "structured_outputs"]

CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
PARAM = "structured_outputs"


def _decoded(value: Any, name: str) -> Any:
    """A schema (or a structural tag) decoded: a string must hold JSON, of an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"{name} is not valid JSON: {error}",
                                      f"{PARAM}.{name}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(f"{name} must be a JSON object (or its text), got "
                                  f"{type(value).__name__}", f"{PARAM}.{name}")
    return value


def _json_text(value: Any, name: str) -> str | None:
    """A schema (or a structural tag) as compact JSON text, keys in the order given (it is the
    order the output's properties follow)."""
    if value is None:
        return None
    return json.dumps(_decoded(value, name), ensure_ascii=False, separators=(",", ":"))


def _schema(value: Any) -> str | None:
    """A JSON schema's text, refused (``check_json_schema``) where it is not one this server
    serves: a remote ``$ref``, a contradictory ``allOf``, a keyword of the wrong type."""
    if value is None:
        return None
    schema = _decoded(value, "json")
    check_json_schema(schema, f"{PARAM}.json")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _tag(value: Any) -> str | None:
    return _json_text(value, "structural_tag")


def _text(name: str):
    def convert(value: Any) -> str | None:
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}",
                                      f"{PARAM}.{name}")
        return value

    return convert


def _choice(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = tuple(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(item, str) for item in items):
        raise InvalidRequestError(f"choice must be a non-empty list of strings, got {value!r}",
                                  f"{PARAM}.choice")
    return items


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """One output constraint (set exactly one of the first six fields).

    Attributes:
        json: a JSON schema (a dict, or its JSON text; stored as compact text).
        json_object: True: any JSON object (vLLM's meaning of ``{"type": "json_object"}``).
        regex: the output matches it in full.
        choice: the output is one of these strings.
        grammar: an EBNF grammar (xgrammar's GBNF dialect, rule ``root`` first).
        structural_tag: an xgrammar structural tag (JSON text or a dict; vLLM's field): text
            whose tagged parts follow their schemas.
        disable_any_whitespace: ``json`` / ``json_object`` output without optional
            whitespace (vLLM's name). None (the default): the server's choice, which the
            OpenAI server fills in from ``--structured-outputs-config`` (compact unless it
            says otherwise); a ``Grammars`` given None compiles compact JSON (vLLM's default
            is False: a grammar that allows whitespace anywhere lets a model emit it for
            ever, up to ``max_tokens``). False allows any whitespace between JSON's tokens.

    Raises:
        InvalidRequestError: not exactly one constraint, or one of the wrong type.
    """

    json: str | None = attrs.field(default=None, converter=_schema)
    json_object: bool | None = None
    regex: str | None = attrs.field(default=None, converter=_text("regex"))
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choice)
    grammar: str | None = attrs.field(default=None, converter=_text("grammar"))
    structural_tag: str | None = attrs.field(default=None, converter=_tag)
    disable_any_whitespace: bool | None = None

    def __attrs_post_init__(self) -> None:
        named = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(named) != 1:
            which = f"{len(named)} are specified ({', '.join(named)})" if named else "none is"
            raise InvalidRequestError(f"structured outputs take exactly one constraint of "
                                      f"{', '.join(CONSTRAINTS)}; {which}", PARAM)
        if self.json_object is not None and self.json_object is not True:
            raise InvalidRequestError("json_object must be true (or left out)",
                                      f"{PARAM}.json_object")
        if self.disable_any_whitespace is not None and not isinstance(
                self.disable_any_whitespace, bool):
            raise InvalidRequestError("disable_any_whitespace must be a bool (or null: the "
                                      "server's default)",
                                      f"{PARAM}.disable_any_whitespace")

    @property
    def kind(self) -> str:
        """The constraint's name (``"json"``, ``"regex"`` ...)."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)


def structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """``SamplingParams.structured_outputs``'s converter: the value, or its dict (PD's wire)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in attrs.fields(StructuredOutputsParams)})
        if unknown:
            raise InvalidRequestError(f"unknown structured output fields {unknown}", PARAM)
        return StructuredOutputsParams(**value)
    raise InvalidRequestError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                              f"got {type(value).__name__}", PARAM)
