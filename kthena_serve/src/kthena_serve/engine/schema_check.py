"""The JSON schemas this server refuses before compiling them: not a schema (a keyword of the
wrong type), a ``$ref`` it would have to fetch, an ``allOf`` no value can satisfy.

xgrammar compiles a schema as far as it understands it and skips the rest, so each of these
would otherwise be served silently: a remote ``$ref`` (never fetched, rightly) constrains
nothing, and an ``allOf`` of an object and a string gives a grammar of one of them. A tool's
``parameters`` under ``tool_choice: auto`` is never compiled at all, so this check is the only
one it gets.
"""

from __future__ import annotations

from typing import Any

from kthena_serve.engine.errors import InvalidRequestError

__all__ = ["JSON_TYPES", "check_json_schema"]

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")

# keyword -> what its value must be (JSON Schema 2020-12's meta-schema, the keywords it types)
_SCHEMA_KEYS = ("items", "not", "additionalProperties", "additionalItems", "contains",
                "propertyNames", "if", "then", "else", "unevaluatedProperties",
                "unevaluatedItems")  # each a schema
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")  # each an object of schemas
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")  # each a non-empty list of schemas
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")  # each an integer >= 0
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRINGS = ("pattern", "format", "$ref", "title", "description", "$id", "$schema")
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples"})  # values, never walked


def check_json_schema(schema: Any, param: str, what: str = "the JSON schema") -> None:
    """Refuse ``schema`` if it is not a JSON schema, reaches outside itself, or contradicts
    itself in an ``allOf``.

    Args:
        schema: the decoded schema (a dict or a bool).
        param: the request field the error names.
        what: how the message names the schema (``"tool 'get_weather': its parameters"``).

    Raises:
        InvalidRequestError: naming the keyword's path inside the schema and what is allowed.
    """
    _walk(schema, "", param, what)


def _fail(param: str, what: str, path: str, why: str) -> None:
    raise InvalidRequestError(f"{what} is refused at {path or '/'}: {why}", param)


def _walk(node: Any, path: str, param: str, what: str) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        _fail(param, what, path, f"a schema is an object or a boolean, got "
                                 f"{type(node).__name__}")
    _check_keywords(node, path, param, what)
    for key in _SCHEMA_KEYS:
        if key in node and not (key == "items" and isinstance(node[key], list)):
            _walk(node[key], f"{path}/{key}", param, what)
    if isinstance(node.get("items"), list):  # draft 4-7's tuple form
        for i, item in enumerate(node["items"]):
            _walk(item, f"{path}/items/{i}", param, what)
    for key in _SCHEMA_MAPS:
        for name, child in node.get(key, {}).items():
            _walk(child, f"{path}/{key}/{name}", param, what)
    for key in _SCHEMA_LISTS:
        for i, child in enumerate(node.get(key, ())):
            _walk(child, f"{path}/{key}/{i}", param, what)
    if "allOf" in node:
        _check_all_of(node["allOf"], f"{path}/allOf", param, what)


def _check_keywords(node: dict[str, Any], path: str, param: str, what: str) -> None:
    """Each keyword's value has the type the meta-schema gives it."""
    def bad(key: str, allowed: str) -> None:
        _fail(param, what, f"{path}/{key}", f"{key} must be {allowed}, got {node[key]!r:.60}")

    kind = node.get("type")
    names = kind if isinstance(kind, list) else [kind]
    if "type" in node and (not names or not all(n in JSON_TYPES for n in names)):
        bad("type", f"one of {', '.join(JSON_TYPES)} (or a list of them)")
    for key in _SCHEMA_MAPS:
        if key in node and not isinstance(node[key], dict):
            bad(key, "an object of schemas")
    for key in _SCHEMA_LISTS:
        if key in node and not (isinstance(node[key], list) and node[key]):
            bad(key, "a non-empty array of schemas")
    for key in _COUNTS:
        value = node.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            bad(key, "an integer >= 0")
    for key in _NUMBERS:
        if key in node and (isinstance(node[key], bool) or
                            not isinstance(node[key], (int, float))):
            bad(key, "a number")
    for key in _STRINGS:
        if key in node and not isinstance(node[key], str):
            bad(key, "a string")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        bad("required", "an array of property names")
    if "enum" in node and not isinstance(node["enum"], list):
        bad("enum", "an array of values")
    ref = node.get("$ref")
    if ref is not None and not ref.startswith("#"):
        _fail(param, what, f"{path}/$ref", f"$ref {ref!r} is not in this schema; only local "
                                           "references (#/$defs/...) are followed, nothing is "
                                           "fetched: put the referenced schema under $defs")


def _types(node: Any) -> set[str] | None:
    """The JSON types a schema's values may have (None: any); ``integer`` counts as a
    ``number``."""
    if not isinstance(node, dict):
        return None if node is not False else set()
    allowed: set[str] | None = None
    if "type" in node:
        kind = node["type"]
        allowed = set(kind if isinstance(kind, list) else [kind])
    values = [node["const"]] if "const" in node else node.get("enum")
    if values is not None:
        of_values = {_type_of(v) for v in values}
        allowed = of_values if allowed is None else {t for t in of_values if t in allowed or
                                                     (t == "integer" and "number" in allowed)}
    if allowed is not None and "number" in allowed:
        allowed.add("integer")
    return allowed


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "object")


def _check_all_of(members: list[Any], path: str, param: str, what: str) -> None:
    """An ``allOf`` whose members allow no common type, or fix different constants."""
    common: set[str] | None = None
    for member in members:
        types = _types(member)
        if types is not None:
            common = types if common is None else common & types
    if common is not None and not common:
        shown = "; ".join(sorted({", ".join(sorted(t)) or "nothing" for t in
                                  (_types(m) for m in members) if t is not None}))
        _fail(param, what, path, f"no value satisfies every member (they allow only: "
                                 f"{shown}); drop the member that contradicts the others")
    consts = [m["const"] for m in members if isinstance(m, dict) and "const" in m]
    if any(c != consts[0] for c in consts[1:]):
        _fail(param, what, path, f"its members fix different constants {consts!r:.80}; no "
                                 "value satisfies every member")
