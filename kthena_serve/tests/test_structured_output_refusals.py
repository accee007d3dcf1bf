"""Structured output that ends and schemas that are refused (issue 53): JSON is compact unless a
request asks for whitespace (vLLM's ``disable_any_whitespace``), and a schema this server would
serve wrongly (a remote ``$ref``, an ``allOf`` nothing satisfies, a tool's parameters that are
not a schema) is a 400 naming it. Checked on the request models and on the compiled grammar's
matcher (xgrammar, this tokenizer); the HTTP answers are in test_structured_output.py.
"""

from __future__ import annotations

import pytest
from _tiny import default_tokenizer

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.grammar import Grammars
from kthena_serve.engine.schema_check import check_json_schema
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.server.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "array", "maxItems": 3,
                                                    "items": {"type": "integer"}}},
          "required": ["city"]}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(default_tokenizer(), 49152)


def _spec(**fields) -> StructuredOutputsParams:
    request = CompletionRequest.model_validate({"prompt": "x", **fields})
    request.refuse_unsupported()
    return request.sampling_params(16).structured_outputs


def _accepts(grammars: Grammars, spec: StructuredOutputsParams, text: str) -> bool:
    return grammars.matcher(spec).accept_string(text)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
    {"structured_outputs": {"json": SCHEMA}},
    {"response_format": {"type": "json_object"}},
], ids=["response_format", "structured_outputs", "json_object"])
def test_json_is_compact_by_default(grammars, fields):
    """No whitespace between JSON's tokens unless asked for: a model cannot spend its
    max_tokens on blanks (17 of 96 json_schema answers did)."""
    spec = _spec(**fields)
    assert spec.disable_any_whitespace is None  # the server's default (compact unless
    # --structured-outputs-config says otherwise; a Grammars given None compiles compact)
    assert _accepts(grammars, spec, '{"city":"Paris"')
    for loose in ('{ "city"', '{\n', '{"city" :', '{"city": "'):
        assert not _accepts(grammars, spec, loose), loose


def test_a_request_turns_whitespace_back_on(grammars):
    spec = _spec(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert spec.disable_any_whitespace is False
    assert _accepts(grammars, spec, '{\n  "city" :  "Paris",\n\n  "days": [ 1 ,2 ]')
    json_object = _spec(structured_outputs={"json_object": True,
                                            "disable_any_whitespace": False})
    assert _accepts(grammars, json_object, '{ "a" :\n 1 }')


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "object", "properties": {"p": {"$ref": "https://example.com/p.json"}}},
     "$ref 'https://example.com/p.json' is not in this schema"),
    ({"$ref": "other.json#/$defs/x"}, "only local references"),
    ({"allOf": [{"type": "object"}, {"type": "string"}]}, "no value satisfies every member"),
    ({"allOf": [{"type": ["string", "null"]}, {"enum": [1, 2]}]}, "no value satisfies"),
    ({"type": "object", "properties": {"n": {"allOf": [{"const": 1}, {"const": 2}]}}},
     "fix different constants"),
    ({"type": "objekt"}, "type must be one of object, array"),
    ({"type": "object", "properties": ["a"]}, "properties must be an object of schemas"),
    ({"type": "string", "maxLength": -1}, "maxLength must be an integer >= 0"),
    ({"type": "object", "required": "city"}, "required must be an array of property names"),
])
def test_schemas_served_wrongly_are_refused_by_name(schema, words):
    with pytest.raises(InvalidRequestError) as error:
        _spec(structured_outputs={"json": schema})
    assert words in str(error.value) and error.value.param == "structured_outputs.json"
    with pytest.raises(InvalidRequestError) as error:
        _spec(response_format={"type": "json_schema",
                               "json_schema": {"name": "x", "schema": schema}})
    assert words in str(error.value) and error.value.param == "response_format"


@pytest.mark.parametrize("schema", [
    {"$defs": {"c": {"type": "string"}}, "type": "object", "properties": {"c": {"$ref": "#/$defs/c"}}},
    {"allOf": [{"type": "number"}, {"type": "integer", "minimum": 0}]},
    {"allOf": [{"type": "object", "properties": {"a": {}}}, {"required": ["a"]}]},
    {"allOf": [{"enum": [1, "a"]}, {"type": "string"}]},
    {"type": ["string", "null"], "items": [{"type": "integer"}], "additionalProperties": False},
    True,
])
def test_schemas_that_mean_something_pass(schema):
    check_json_schema(schema, "p")  # raises if refused


def _chat(**fields) -> ChatCompletionRequest:
    request = ChatCompletionRequest.model_validate({"messages": CHAT, **fields})
    request.refuse_unsupported()
    return request


def test_a_tool_whose_parameters_are_no_schema_is_refused_under_auto():
    good = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "strin"}}}}}
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "required"}):
        with pytest.raises(InvalidRequestError) as error:
            _chat(tools=[good, bad], **choice)
        assert error.value.param == "tools[1].function.parameters"
        assert "tool 'get_weather'" in str(error.value)
        assert "/properties/city/type" in str(error.value)
    _chat(tools=[good, bad], tool_choice="none")  # never read: the output is not parsed
    _chat(tools=[good])


def test_an_image_part_is_refused_naming_it_and_the_part_types_served():
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    with pytest.raises(InvalidRequestError) as error:
        _chat(messages=[{"role": "user", "content": content}])
    assert error.value.param == "messages.0.content.1.type"
    assert "'image_url'" in str(error.value) and "type 'text'" in str(error.value)
    request = _chat(messages=[{"role": "user", "content": content[:1] * 2}])
    assert request.messages[0].text() == "What is this?What is this?"
