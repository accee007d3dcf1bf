"""The strict base of every request body, and the parts both requests share: stream options,
OpenAI's ``response_format`` and vLLM's ``structured_outputs`` (each becomes a
``StructuredOutputsParams``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.structured_output import StructuredOutputsParams

__all__ = ["Forbid", "JsonSchemaFormat", "ResponseFormat", "StreamOptions", "Strict",
           "StructuredOutputs", "refuse"]


class Strict(BaseModel):
    """Every request body's base: strict types, unknown keys ignored (subclasses forbid them)."""

    # NaN / Infinity (which Python's JSON parser reads) get "Input should be a finite number"
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def refuse(param: str, value: Any, why: str) -> None:
    """Raise the 400 of a field set to a value this server does not support."""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise InvalidRequestError(f"{param}={shown} is not supported: {why}", param)


class StreamOptions(Strict):
    """OpenAI's stream options (unknown keys are a 400, as everywhere)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class Forbid(Strict):
    """A body part whose unknown keys are a 400."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(Forbid):
    """OpenAI's ``response_format.json_schema``; ``strict`` is accepted either way (the
    output always follows the schema)."""

    name: str = Field(min_length=1)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Forbid):
    """``{"type": "text" | "json_object" | "json_schema" | "structural_tag", ...}`` (OpenAI's,
    and vLLM's structural tag: xgrammar's ``format``, or the legacy ``structures`` /
    ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """Raises InvalidRequestError (``response_format``) for a type without its fields."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise InvalidRequestError("response_format of type json_schema needs "
                                          "json_schema.schema", "response_format")
            try:
                return StructuredOutputsParams(json=self.json_schema.json_schema)
            except InvalidRequestError as error:  # named as the body sent it
                raise InvalidRequestError(str(error), "response_format") from None
        tag = self.model_dump(exclude_none=True, exclude={"json_schema"})
        return StructuredOutputsParams(structural_tag=tag)


class StructuredOutputs(Forbid):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``): one of ``json``,
    ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # vLLM's name; its default is false, here the server's (--structured-outputs-config,
    # true unless it says otherwise): compact JSON unless asked for whitespace (a grammar with
    # free whitespace lets a model emit it up to max_tokens). None: the server's default
    disable_any_whitespace: bool | None = None
    # vLLM's xgrammar backend ignores both: the first is accepted (xgrammar already allows no
    # property a schema does not name, unless the schema sets additionalProperties), the
    # second refused unless null
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def constraint(self) -> StructuredOutputsParams:
        if self.whitespace_pattern is not None:
            refuse("structured_outputs.whitespace_pattern", self.whitespace_pattern,
                    "xgrammar (vLLM's default backend too) has no whitespace pattern; use "
                    "disable_any_whitespace")
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
            json_object=self.json_object, structural_tag=self.structural_tag,
            disable_any_whitespace=self.disable_any_whitespace)
