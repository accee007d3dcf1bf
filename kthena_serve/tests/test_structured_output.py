"""Structured output through xgrammar and tool calls: response_format (json_object,
json_schema), vLLM's structured_outputs (json, regex, choice, grammar), tools with every
tool_choice; streaming and not, n > 1, colocated and PD. Served by a tiny random-weight model:
whatever it would say, every output must parse and validate.

A random model left free among a grammar's whitespace tokens (162 in this vocabulary) tends to
pick them for ever; tests that keep JSON's optional whitespace bias those tokens away
(``NO_SPACE``) or ask for ``disable_any_whitespace``, and their schemas bound every string,
number and array, so each output ends within ``max_tokens``.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
import torch
from _support import metric_value
from _tiny import default_tokenizer, tiny_engine, tiny_server
from hypothesis import given, settings
from hypothesis import strategies as st

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.grammar import (
    Grammars,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    choice_grammar,
)
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.pd.protocol import params_from_json, params_to_json
from kthena_serve.server.protocol import ChatCompletionRequest
from kthena_serve.server.tools import (
    Tool,
    ToolCallParser,
    add_deltas,
    chat_inputs,
    parse_tool_calls,
    tool_constraint,
)

MODEL = "tiny"
PROMPT = "Answer in JSON:"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 768  # above the longest output any schema here allows


def _whitespace_bias() -> dict[str, float]:
    tokenizer = default_tokenizer()
    special = tokenizer.special_tokens
    ids = [i for i in range(tokenizer.vocab_size)
           if tokenizer.token_strs([i])[0] not in special
           and not tokenizer.token_bytes([i])[0].strip()]
    return {str(i): -100.0 for i in ids}


NO_SPACE = _whitespace_bias()
# strings close and containers end as soon as the grammar lets them (json_object bounds nothing)
CLOSE = {str(i): 100.0 for text in ('"', "}", "]")
         for i in default_tokenizer().encode(text)}

OBJECT = {"type": "object", "additionalProperties": False,
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "celsius": {"type": "integer", "minimum": -50, "maximum": 50},
                         "sunny": {"type": "boolean"},
                         "wind": {"enum": ["calm", "breeze", "storm"]},
                         "hours": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                             "maximum": 23}, "maxItems": 3}},
          "required": ["city", "celsius", "sunny"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}


@pytest.fixture(scope="module")
def served():
    with tiny_server(MODEL, timeout_s=120, num_kv_blocks=1024, max_num_batched_tokens=256) as pair:
        yield pair



def complete(client: httpx.Client, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS,
            **fields}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def chat(client: httpx.Client, **fields) -> dict:
    body = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS,
            **fields}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def stream(client: httpx.Client, path: str, **fields) -> list[dict]:
    body = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True,
            **fields}
    with client.stream("POST", path, json=body) as answer:
        assert answer.status_code == 200, answer.read()
        lines = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def streamed_choices(chunks: list[dict]) -> dict[int, dict]:
    """Each choice's text (completions) or content and tool calls (chat), and finish reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            item = out.setdefault(c["index"], {"text": "", "tool_calls": [], "reason": None})
            delta = c.get("delta", {})
            item["text"] += c.get("text") or delta.get("content") or ""
            item["tool_calls"] += delta.get("tool_calls") or []
            item["reason"] = c["finish_reason"] or item["reason"]
    return out


# ---- the value, the grammar cache, the bitmask ---------------------------------------------------
def test_spec_takes_exactly_one_constraint_and_crosses_the_pd_wire():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError, match="none is"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    for spec in (StructuredOutputsParams(json=OBJECT), StructuredOutputsParams(choice=["a", "b"]),
                 StructuredOutputsParams(json_object=True, disable_any_whitespace=True)):
        params = SamplingParams(structured_outputs=spec)
        wire = json.loads(json.dumps(params_to_json(params)))
        assert params_from_json(wire) == params
    # a schema keeps its key order (the order the output's properties take)
    assert list(json.loads(StructuredOutputsParams(json=OBJECT).json)["properties"]) == \
        list(OBJECT["properties"])


def test_compiles_are_cached_by_the_spec():
    grammars = Grammars(default_tokenizer(), 49152, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = grammars.compile(a)
    assert grammars.compile(StructuredOutputsParams(regex="a+")) is first
    grammars.compile(b)
    grammars.compile(c)  # evicts a, the least recently used
    assert grammars.num_compiled == 3
    grammars.compile(a)
    assert grammars.num_compiled == 4
    with pytest.raises(InvalidRequestError, match="regex constraint does not compile") as error:
        grammars.compile(StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex")
    assert error.value.param == "structured_outputs.regex"
    assert "/project/cpp" not in str(error.value)  # the compiler's message, not its location


def test_a_grammar_serialized_in_one_cache_loads_into_another_without_a_compile():
    """What EngineCoreClient does: the API process compiles and keeps xgrammar's JSON; the
    engine process's cache loads it and never compiles, and its matchers take the same strings
    (a fresh random bitmask row included)."""
    here = Grammars(default_tokenizer(), 49152, serialize=True)
    there = Grammars(default_tokenizer(), 49152)
    spec = StructuredOutputsParams(json=OBJECT, disable_any_whitespace=True)
    here.compile(spec)
    text = here.serialized(spec)
    assert here.num_compiled == 1 and here.serialized(spec) is text  # made once, kept
    there.load(spec, text)
    there.load(spec, text)  # kept already: a no-op
    assert there.num_compiled == 0
    for prefix, ok in (('{"city":"Pa', True), ('{"town":', False), ('{"city":"\x07', False)):
        assert there.matcher(spec).accept_string(prefix) is ok
        assert here.matcher(spec).accept_string(prefix) is ok
    assert torch.equal(there.fill_bitmask([there.matcher(spec)]),
                       here.fill_bitmask([here.matcher(spec)]))
    assert there.num_compiled == 0
    plain = Grammars(default_tokenizer(), 49152)  # without serialize: made on demand
    regex = StructuredOutputsParams(regex="a+b")
    assert json.loads(plain.serialized(regex)) and plain.num_compiled == 1


def test_choice_grammar_escapes_its_literals():
    grammars = Grammars(default_tokenizer(), 49152)
    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\there", "é"]
    matcher_source = choice_grammar(choices)
    assert matcher_source.startswith("root ::= ")
    for text in choices:
        matcher = grammars.matcher(StructuredOutputsParams(choice=choices))
        assert matcher.accept_string(text)
        assert matcher.is_completed()


def test_length_bounded_strings_take_no_control_character():
    """xgrammar 0.2.8 compiles a string with maxLength to a class that lets raw control
    characters in (the output then is not JSON; a random model wrote ``" Boh\\x07"``):
    grammar.py hands it the bound as a pattern that excludes them, in schemas and tool tags."""
    grammars = Grammars(default_tokenizer(), 49152)
    tools = [Tool.model_validate(WEATHER)]
    for spec, prefix in (
            (StructuredOutputsParams(json=OBJECT, disable_any_whitespace=True),
             '{"city":"Pa'),
            (tool_constraint(tools, "required"),
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')):
        matcher = grammars.matcher(spec)
        assert matcher.accept_string(prefix)
        assert not matcher.accept_string("\x07") and not matcher.accept_string("\t")
        assert matcher.accept_string('ris"')  # 5 of maxLength 10 (12 for OBJECT)
        assert not grammars.matcher(spec).accept_string(prefix + "x" * 12)  # the bound holds


def test_batch_fill_matches_row_by_row():
    spec = StructuredOutputsParams(json=OBJECT, disable_any_whitespace=True)
    prefixes = ['{"city":"Pa', '{"city":"Paris","celsius":', "", '{"city":"","celsius":-5,"sunny"']
    one, two = Grammars(default_tokenizer(), 49152, max_threads=1), \
        Grammars(default_tokenizer(), 49152, max_threads=2)
    rows = {}
    for grammars in (one, two):
        matchers = [grammars.matcher(spec) for _ in prefixes]
        for matcher, prefix in zip(matchers, prefixes, strict=True):
            assert matcher.accept_string(prefix)
        rows[grammars.max_threads] = grammars.fill_bitmask([None, *matchers, None])
    assert torch.equal(rows[1], rows[2])
    assert bool((rows[1][0] == -1).all()) and bool((rows[1][-1] == -1).all())  # free rows
    assert rows[1].shape == (6, 49152 // 32)


@pytest.mark.parametrize("width", [64, 100, 49152 + 64])
def test_bitmask_apply_matches_the_torch_reference(width):
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(5, width, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, -(-min(width, 49152) // 32)),
                            generator=generator, dtype=torch.int64).to(torch.int32)
    rows = [0, 2, 3]
    fast, slow = logits.clone(), logits.clone()
    apply_token_bitmask(fast, bitmask, rows)
    apply_token_bitmask_reference(slow, bitmask, rows)
    assert torch.equal(fast, slow)
    assert torch.equal(fast[[1, 4]], logits[[1, 4]])  # unconstrained rows untouched
    bit = bool((bitmask[0, 0] >> 1) & 1)
    assert (fast[0, 1] == logits[0, 1]) == bit and (bit or fast[0, 1] == float("-inf"))


def test_engine_constrains_the_python_api_too():
    engine = tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=32,
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-\d{2}"))
    engine.add_request("r", "id:", params)
    engine.add_request("free", "id:", SamplingParams(temperature=0, max_tokens=8))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch(r"[a-z]{3}-\d{2}", finals["r"].text)
    assert finals["r"].finish_reason.value == "stop"
    assert finals["free"].finish_reason.value == "length"  # a free row in the same batch
    engine.close()


# ---- response_format, structured_outputs: colocated ---------------------------------------------
def test_json_object_parses(client):
    for answer in (chat(client, response_format={"type": "json_object"}, logit_bias=CLOSE),
                   complete(client, response_format={"type": "json_object"}, logit_bias=CLOSE)):
        choice = answer["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert isinstance(json.loads(text), dict), text
        assert choice["finish_reason"] == "stop"


def test_json_schema_validates_streaming_or_not_with_n(client):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": OBJECT,
                                                 "strict": True}}
    answer = chat(client, response_format=rf, logit_bias=NO_SPACE, n=2, temperature=1.0,
                  seed=7)
    texts = [c["message"]["content"] for c in answer["choices"]]
    for text in texts:
        jsonschema.validate(json.loads(text), OBJECT)
    assert len(set(texts)) == 2  # one matcher per choice: each follows its own sample
    chunks = stream(client, "/v1/chat/completions", messages=CHAT, response_format=rf,
                    logit_bias=NO_SPACE, n=2, temperature=1.0, seed=7)
    streamed = streamed_choices(chunks)
    assert sorted(streamed[i]["text"] for i in (0, 1)) == sorted(texts)
    assert all(streamed[i]["reason"] == "stop" for i in (0, 1))


def test_regex_choice_and_grammar(client):
    regex = r"(yes|no), [0-9]{2}[a-f]?"
    text = complete(client, structured_outputs={"regex": regex})["choices"][0]["text"]
    assert re.fullmatch(regex, text), text
    choices = ["red", "green", "blue sky", 'quote "q"']
    for answer in (complete(client, structured_outputs={"choice": choices}, n=3, temperature=1,
                            seed=1),
                   chat(client, structured_outputs={"choice": choices})):
        for c in answer["choices"]:
            assert (c["message"]["content"] if "message" in c else c["text"]) in choices
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    chunks = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=24,
                    structured_outputs={"grammar": grammar})
    out = streamed_choices(chunks)[0]
    if out["reason"] == "stop":
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out["text"]), out
    else:  # the grammar allows an endless sum: cut by max_tokens, a prefix of one
        assert out["reason"] == "length"
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9]?[0-9]?)*", out["text"]), out


def test_max_tokens_before_the_grammar_ends_is_length(client):
    answer = complete(client, structured_outputs={"json": OBJECT}, max_tokens=4)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):  # as vLLM: the JSON may be incomplete
        json.loads(choice["text"])
    assert choice["text"].startswith("{")


@pytest.mark.parametrize("extra", [{"min_tokens": 20}, {"min_tokens": 3, "stream": True}])
def test_min_tokens_past_the_grammars_end_lets_the_grammar_end(client, extra):
    """The grammar allows nothing but its end while min_tokens bans the stop token: the
    grammar wins (the fuzzer found this as a 500: "token 0 does not continue ...")."""
    if extra.pop("stream", False):
        chunks = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=32,
                        structured_outputs={"choice": ["zebra", "yak"]}, **extra)
        out = streamed_choices(chunks)[0]
        text, reason = out["text"], out["reason"]
    else:
        choice = complete(client, structured_outputs={"json": {}}, max_tokens=32,
                          **extra)["choices"][0]
        json.loads(choice["text"])
        text, reason = choice["text"], choice["finish_reason"]
        choice = complete(client, structured_outputs={"choice": ["zebra", "yak"]},
                          max_tokens=32, **extra)["choices"][0]
        text, reason = choice["text"], choice["finish_reason"]
    assert (text, reason) in (("zebra", "stop"), ("yak", "stop"))


def test_logprobs_stay_raw(client, engine):
    answer = complete(client, structured_outputs={"choice": ["zebra", "yak"]}, logprobs=2,
                      return_tokens_as_token_ids=True)
    logprobs = answer["choices"][0]["logprobs"]
    free = complete(client, logprobs=2, max_tokens=1, return_tokens_as_token_ids=True)
    # the first position's alternatives are the model's own, not the two allowed tokens'
    assert logprobs["top_logprobs"][0].keys() - {logprobs["tokens"][0]} == \
        free["choices"][0]["logprobs"]["top_logprobs"][0].keys() - {logprobs["tokens"][0]}
    assert logprobs["token_logprobs"][0] < 0


_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
_SCALARS = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-1000, 1000), st.integers(0, 2000)),
    st.just({"type": "boolean"}),
    st.builds(lambda values: {"enum": values},
              st.lists(st.text("abcxyz -", min_size=1, max_size=6), min_size=1, max_size=4,
                       unique=True)),
)
_FIELDS = st.one_of(_SCALARS, st.builds(lambda item, n: {"type": "array", "items": item,
                                                         "maxItems": n},
                                        _SCALARS, st.integers(0, 3)))
_SCHEMAS = st.dictionaries(_NAMES, _FIELDS, min_size=1, max_size=5).flatmap(
    lambda props: st.builds(
        lambda required: {"type": "object", "properties": props, "required": required,
                          "additionalProperties": False},
        st.lists(st.sampled_from(sorted(props)), unique=True)))


@settings(max_examples=50, deadline=None)
@given(schema=_SCHEMAS)
def test_every_output_validates_against_generated_schemas(client, schema):
    spec = {"json": schema, "disable_any_whitespace": True}
    text = complete(client, structured_outputs=spec)["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    streamed = streamed_choices(stream(client, "/v1/chat/completions", messages=CHAT,
                                       structured_outputs=spec))[0]
    assert streamed["reason"] == "stop"
    jsonschema.validate(json.loads(streamed["text"]), schema)


# ---- bad specs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json",
     "type must be one of"),
    ({"structured_outputs": {"json": {"$ref": "https://example.com/s.json"}}},
     "structured_outputs.json", "only local references"),
    ({"structured_outputs": {"json": {"allOf": [{"type": "object"}, {"type": "string"}]}}},
     "structured_outputs.json", "no value satisfies every member"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs",
     "not defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "no whitespace pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": "nope"}}}},
     "response_format", "type must be one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
    ({"guided_choice": ["a"]}, "guided_choice", "removed"),
])
def test_bad_specs_are_400_naming_the_field(client, fields, param, words):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


# ---- tool calls ------------------------------------------------------------------------------------
def _check_call(call: dict, tools: list[dict]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema[call["function"]["name"]])


def _streamed_calls(chunks: list[dict]) -> list[dict]:
    """A streamed choice's calls added up as an OpenAI client does, checking OpenAI's delta
    shape on the way: a call's first delta has index, id, type, name and arguments text; the
    next ones only index and an arguments fragment."""
    calls: list[dict] = []
    for chunk in chunks:
        deltas = chunk["choices"][0]["delta"].get("tool_calls") if chunk["choices"] else None
        for delta in deltas or ():
            if delta["index"] == len(calls):  # a new call
                assert set(delta) == {"index", "id", "type", "function"}, delta
                assert delta["type"] == "function" and delta["function"]["name"], delta
                calls.append({"id": delta["id"], "type": "function", "num_deltas": 0,
                              "function": {"name": delta["function"]["name"], "arguments": ""}})
            else:
                assert delta["index"] == len(calls) - 1, delta  # calls come one after another
                assert set(delta) == {"index", "function"}, delta
                assert set(delta["function"]) == {"arguments"}, delta
            calls[-1]["function"]["arguments"] += delta["function"]["arguments"]
            calls[-1]["num_deltas"] += 1
    return calls


def _same_calls(streamed: list[dict], answered: list[dict]) -> bool:
    return [c["function"] for c in streamed] == [c["function"] for c in answered]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_always_call(client, tool_choice):
    tools = [WEATHER, TIME]
    answer = chat(client, tools=tools, tool_choice=tool_choice, logit_bias=NO_SPACE, n=2,
                  temperature=1.0, seed=3)
    for choice in answer["choices"]:
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] is None, choice
        assert len(message["tool_calls"]) >= 1
        for call in message["tool_calls"]:
            _check_call(call, tools)
        if isinstance(tool_choice, dict):
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    greedy = chat(client, tools=tools, tool_choice=tool_choice, logit_bias=NO_SPACE)
    chunks = stream(client, "/v1/chat/completions", messages=CHAT, tools=tools,
                    tool_choice=tool_choice, logit_bias=NO_SPACE)
    out = streamed_choices(chunks)[0]
    assert out["reason"] == "tool_calls" and out["text"] == ""
    calls = _streamed_calls(chunks)
    assert _same_calls(calls, greedy["choices"][0]["message"]["tool_calls"])
    for call in calls:
        _check_call(call, tools)
        assert call["num_deltas"] > 2  # the arguments came as they were generated


def test_required_makes_several_calls_each_with_its_id(client):
    """min_tokens past one call (50 tokens here) keeps the output from ending after it: the
    grammar's only other way on is a newline and a second block (vLLM's required takes several
    calls too)."""
    fields = {"tools": [WEATHER, TIME], "tool_choice": "required", "logit_bias": NO_SPACE,
              "min_tokens": 60, "max_tokens": 240}
    answer = chat(client, **fields)
    choice = answer["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert len(calls) >= 2 and choice["finish_reason"] == "tool_calls", choice
    assert len({c["id"] for c in calls}) == len(calls)
    for call in calls:
        _check_call(call, fields["tools"])
    chunks = stream(client, "/v1/chat/completions", messages=CHAT, **fields)
    streamed = _streamed_calls(chunks)
    assert _same_calls(streamed, calls)
    assert len({c["id"] for c in streamed}) == len(streamed)
    assert streamed_choices(chunks)[0]["reason"] == "tool_calls"


def test_the_openai_client_adds_up_the_stream_to_the_answer(client):
    """The real openai client: a streamed reply, added up by hand as a user does and by the
    client's own stream helper, has the calls of the same greedy request answered whole."""
    import openai

    api = openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="none",
                        max_retries=0)
    tools = [{"type": "function", "function": {**t["function"], "strict": True}}
             for t in (WEATHER, TIME)]  # the helper parses strict tools' arguments
    fields = {"model": MODEL, "messages": CHAT, "tools": tools, "tool_choice": "required",
              "temperature": 0, "max_tokens": 240, "logit_bias": NO_SPACE,
              "extra_body": {"min_tokens": 60}}
    answer = api.chat.completions.create(**fields)
    expected = [(c.function.name, c.function.arguments)
                for c in answer.choices[0].message.tool_calls]
    assert len(expected) >= 2 and answer.choices[0].finish_reason == "tool_calls"

    calls: dict[int, dict] = {}
    reason = None
    for chunk in api.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name,
                                                      "arguments": ""})
                call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert reason == "tool_calls" and all(c["id"] for c in calls.values())

    with api.chat.completions.stream(**fields) as events:
        final = events.get_final_completion()
    message = final.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == expected
    for call in message.tool_calls:
        assert call.function.parsed_arguments == json.loads(call.function.arguments)


def test_parallel_tool_calls_false_holds_required_to_one_call():
    tools = [Tool.model_validate(t) for t in (WEATHER, TIME)]
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    grammars = Grammars(default_tokenizer(), 49152)
    for parallel, second in ((True, True), (False, False)):
        matcher = grammars.matcher(tool_constraint(tools, "required", parallel))
        assert matcher.accept_string(one)
        assert matcher.accept_string("\n<tool_call>") is second


def test_auto_and_none_round_trip(client):
    for choice in ("auto", "none", None):
        extra = {} if choice is None else {"tool_choice": choice}
        answer = chat(client, tools=[WEATHER], max_tokens=12, **extra)
        message = answer["choices"][0]["message"]
        # the random model calls nothing: its text comes back as content
        assert message["content"] and answer["choices"][0]["finish_reason"] == "length"
        assert "tool_calls" not in message


def test_tool_messages_render_through_the_template(client, engine):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
    answer = chat(client, messages=messages, tools=[WEATHER], max_tokens=4)
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages,
                                                 "tools": [WEATHER]})
    rendered, extra = chat_inputs(body.messages, body.tools,
                                  engine.processor.tokenizer.chat_template)
    assert extra == {}  # SmolLM2's template takes no tools: the system message carries them
    text = engine.processor.tokenizer.apply_chat_template(rendered)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert '<|im_start|>tool\n<tool_response>\n{"celsius": 21}\n</tool_response>' in text
    assert answer["usage"]["prompt_tokens"] == len(engine.processor.encode_chat(rendered))
    tokens = client.post("/tokenize", json={"model": MODEL, "messages": messages,
                                            "tools": [WEATHER]})
    assert tokens.json()["count"] == answer["usage"]["prompt_tokens"]  # /tokenize agrees


def test_bad_tool_requests_are_400(client):
    no_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "obj"}}}
    cases = [({"tools": [WEATHER, no_schema]}, "tools[1].function.parameters"),
             ({"messages": [{"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
              "messages.0.content.0.type"),
             ({"tools": []}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                   "function": {"name": "nope"}}},
              "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": "required",
               "response_format": {"type": "json_object"}}, "tool_choice"),
             ({"functions": [{"name": "f"}]}, "functions")]
    for fields, param in cases:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, fields


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Hello there.", "Hello there.", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", {"a": 1})]),
    ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {"x": "y"}}</tool_call>', "Let me check.",
     [("f", {}), ("g", {"x": "y"})]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", {"a": [1, 2]})]),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"name": "f", "parameters": {"p": true}}</tool_call>', None,
     [("f", {"p": True})]),
])
def test_hermes_parser_whole_and_streamed(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in got_calls] == calls
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    for step in (1, 3, 7):  # the same split, however the text arrives
        parser = ToolCallParser()
        pieces, streamed = [], []
        for start in range(0, len(text), step):
            piece, deltas = parser.feed(text[start:start + step])
            pieces.append(piece)
            add_deltas(streamed, deltas)
        piece, deltas = parser.finish()
        pieces.append(piece)
        add_deltas(streamed, deltas)
        assert ("".join(pieces).strip() or None) == content
        assert [c["function"] for c in streamed] == [c["function"] for c in got_calls]
        assert "<tool_call" not in "".join(pieces) or content and "<tool_call>" in content


def test_streamed_call_sends_its_name_then_its_arguments_as_written():
    parser = ToolCallParser()
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert parser.feed(head) == ("", [])  # the value has not begun: nothing to send yet
    _, first = parser.feed('{"ci')
    assert len(first) == 1 and first[0]["id"].startswith("call_")
    assert first[0] | {"id": "x"} == {"index": 0, "id": "x", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"ci'}}
    assert parser.feed('ty": "Pa') == ("", [{"index": 0, "function": {"arguments": 'ty": "Pa'}}])
    assert parser.feed('ris"}}\n</tool') == ("", [{"index": 0, "function": {"arguments": 'ris"}'}}])
    assert parser.feed("_call>\nDone.") == ("\nDone.", [])
    _, second = parser.feed('<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert [(d["index"], d["function"]) for d in second] == [(1, {"name": "g", "arguments": "{}"})]
    assert parser.finish() == ("", [])


def test_parallel_tool_calls_false_keeps_the_first():
    text = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert [c["function"]["name"] for c in parse_tool_calls(text, max_calls=1)[1]] == ["f"]


# ---- PD -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pd_cluster():
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.pd.config import PDConfig
    from kthena_serve.pd.embedded import PDCluster

    pd = PDCluster(EngineConfig(num_kv_blocks=256, max_num_seqs=8),
                   PDConfig(pd_threshold_tokens=24, transfer_timeout_s=60,
                            health_interval_s=0.2),
                   tokenizer=default_tokenizer()).start()
    try:
        yield pd
    finally:
        pd.stop()


def test_json_schema_validates_through_pd(pd_cluster):
    """The prefill worker samples the first token under the grammar, the decode worker's
    matcher continues from it (a first token outside the grammar would fail the request)."""
    def disaggregated() -> float:
        return metric_value(pd_cluster.worker_metrics("decode-0"), "kthena_pd_requests_total",
                            path="disaggregated")

    before = disaggregated()
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": OBJECT}}
    ask = ("the weather in {} today as JSON with the city, the temperature in celsius and "
           "whether it is sunny.")
    for city, streaming in (("Paris", False), ("Oslo", True)):
        body = {"model": "default", "temperature": 0, "max_tokens": 160, "stream": streaming,
                "logit_bias": NO_SPACE, "response_format": rf,  # another prompt: not cached
                "messages": [{"role": "system", "content": f"{city}: " + ask.format(city)}]}
        answer = httpx.post(f"{pd_cluster.url}/v1/chat/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        if streaming:
            chunks = [json.loads(line[6:]) for line in answer.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        else:
            text = answer.json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), OBJECT)
    assert disaggregated() - before == 2  # both ran their prompt on the prefill worker
