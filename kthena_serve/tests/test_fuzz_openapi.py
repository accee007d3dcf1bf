"""A Hypothesis fuzz of the live server, with bodies drawn from its own /openapi.json.

Each POST route's request schema becomes a strategy (``_from_schema``: the JSON-schema subset
pydantic emits). Values mostly follow the schema and sometimes break it on purpose (extreme
integers, non-finite numbers, lone surrogates, wrong types); half of the bodies name the served
model so they reach the engine, and output lengths are capped so a run stays bounded. Whatever
the body: no 5xx, an OpenAI error body for every 4xx, streams end with ``[DONE]`` without an
error event, the keep-alive connection survives, and no KV block is left referenced.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from _tiny import tiny_engine
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.server import BackgroundServer, build_app

MODEL = "tiny"
_SERVED = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 4},
    "/tokenize": {"model": MODEL, "prompt": "Hello", "return_token_strs": True},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
}
_ANSWER = {"/v1/completions": "choices", "/v1/chat/completions": "choices",
           "/tokenize": "tokens", "/detokenize": "prompt"}  # a 200's key

_WILD = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                  st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308]),
                  st.text(max_size=8), st.just("a\ud800b"), st.just([]), st.just({}))


def _valid(node: dict, root: dict) -> st.SearchStrategy:  # noqa: PLR0911
    """Values that follow a JSON-schema node (the subset pydantic emits)."""
    if not node:
        return _WILD
    if "$ref" in node:
        return _valid(_resolve(node, root), root)
    if "anyOf" in node:
        return st.one_of([_valid(option, root) for option in node["anyOf"]])
    if "enum" in node or "const" in node:
        return st.sampled_from(node.get("enum", [node.get("const")]))
    kind = node.get("type")
    if kind == "string":
        return st.text(min_size=node.get("minLength", 0), max_size=min(node.get("maxLength", 40), 40))
    if kind == "integer":
        low, high = node.get("minimum", -(2**66)), node.get("maximum", 2**66)
        small = st.integers(max(low, 0), min(high, max(low, 0) + 8))
        return st.one_of(small, small, small, st.integers(low, high))  # mostly small
    if kind == "number":
        low = node.get("minimum", node.get("exclusiveMinimum"))
        return st.floats(low, node.get("maximum"), allow_nan=False,
                         exclude_min="exclusiveMinimum" in node)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = _valid(node.get("items", {}), root)
        # at least one item: pydantic's min lengths are not all in the schema (`[]` is in _WILD)
        return st.lists(items, min_size=max(1, node.get("minItems", 0)), max_size=4)
    if kind == "object":
        return _object(node, root)
    return _WILD


def _object(node: dict, root: dict) -> st.SearchStrategy:
    properties = node.get("properties", {})
    required = set(node.get("required", ()))
    fixed = {k: _valid(v, root) for k, v in properties.items() if k in required}
    optional = {k: _valid(v, root) for k, v in properties.items() if k not in required}
    return st.fixed_dictionaries(fixed, optional=optional)


def _few_fields(node: dict, root: dict) -> st.SearchStrategy:
    """The required fields and at most three optional ones: bodies that often reach the engine."""
    required = set(node.get("required", ()))
    optional = sorted(set(node["properties"]) - required)

    def body(keys: list[str]) -> st.SearchStrategy:
        chosen = required | set(keys)
        return st.fixed_dictionaries({k: _valid(node["properties"][k], root) for k in chosen})

    return st.lists(st.sampled_from(optional), max_size=3, unique=True).flatmap(body)


def _broken(body: dict, keys: list[str]) -> st.SearchStrategy:
    """The body with one field set to a value that breaks its schema (or is merely odd)."""
    return st.builds(lambda key, value: {**body, key: value}, st.sampled_from(keys), _WILD)


def _resolve(node: dict, root: dict) -> dict:
    target = root
    for part in node["$ref"].removeprefix("#/").split("/"):
        target = target[part]
    return target


@pytest.fixture(scope="module")
def server():
    # a short context: a body without max_tokens generates up to it (the tiny random model
    # rarely ends), and n up to 4 times over; 2,048 tokens made one run take minutes
    engine = AsyncLLM(tiny_engine(num_kv_blocks=512, max_num_batched_tokens=256,
                                  max_num_seqs=16, max_n=4, max_model_len=128)).start()
    with BackgroundServer(build_app(engine, model_name=MODEL)) as running:
        yield engine, running.url
    engine.shutdown()


def _body_strategy(schema: dict, route: str) -> st.SearchStrategy:
    operation = schema["paths"][route]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    node = _resolve(body, schema) if "$ref" in body else body
    keys = sorted(node["properties"])
    valid = st.one_of(_few_fields(node, schema), _object(node, schema))
    drawn = st.one_of(valid, valid.flatmap(lambda b: _broken(b, keys)))

    def bounded(fields: dict, served: bool) -> dict:
        fields = dict(fields)
        if served:
            fields["model"] = MODEL
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(fields.get(key), int) and fields[key] > 8:
                fields[key] = 8  # keep the run short; validation of big values is tested apart
        return fields

    return st.builds(bounded, drawn, st.booleans())


def _check(response: httpx.Response, stream: bool, route: str) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]
        return
    if stream:
        lines = [line for line in response.text.split("\n") if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            assert "error" not in json.loads(line[6:]), line
    else:
        answer = response.json()[_ANSWER[route]]
        assert answer or not route.startswith("/v1/")  # a tokenize answer may be empty


def test_openapi_schema_is_served(server):
    _, url = server
    schema = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])
    assert "CompletionRequest" in schema["components"]["schemas"]


@pytest.mark.parametrize("route", sorted(_SERVED))
def test_fuzzed_bodies_never_get_a_5xx(server, route):
    engine, url = server
    schema = httpx.get(f"{url}/openapi.json").json()
    statuses: list[int] = []
    with httpx.Client(base_url=url, timeout=60) as http:

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=_body_strategy(schema, route))
        @example(body=_SERVED[route])  # one body that surely reaches the engine
        def run(body: dict) -> None:
            stream = body.get("stream") is True
            payload = json.dumps(body, allow_nan=True)  # Infinity / NaN on purpose
            response = http.post(route, content=payload,
                                 headers={"content-type": "application/json"})
            statuses.append(response.status_code)
            if os.environ.get("KTHENA_FUZZ_LOG"):
                print(response.status_code, payload[:300], response.text[:200])
            _check(response, stream, route)

        run()
        assert 200 in statuses and any(400 <= s < 500 for s in statuses), statuses
        assert http.get("/health").status_code == 200  # the same client, still connected
    deadline = time.monotonic() + 10
    while engine.stats().kv.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().kv.num_used_blocks == 0
