"""Tool-call parsers chosen by ``--tool-call-parser`` (hermes, llama3_json, mistral, pythonic).

Parity: each family's chat template (small Jinja templates below, written after the published
formats: Qwen 2.5's Hermes blocks, Llama 3.1's JSON, Mistral v0.3's ``[TOOL_CALLS]`` list and
the v11 ``[TOOL_CALLS]name[ARGS]`` form, Llama 3.2 / Llama 4's pythonic list) renders an
assistant's ``tool_calls`` as the server renders a conversation (``chat_inputs``), and the
parser must give back exactly those calls, whole and streamed however the text is cut; the
streamed deltas add up to the whole answer. Then the server: the flag, the grammar of
``required`` / named in each format, the routes using the chosen parser.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
from _tiny import default_tokenizer, tiny_checkpoint, tiny_llama
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.grammar import Grammars
from kthena_serve.model import Tokenizer
from kthena_serve.model.tokenizer import _compile_template
from kthena_serve.serve_args import TOOL_CALL_PARSERS
from kthena_serve.server.protocol import ChatCompletionRequest
from kthena_serve.server.tool_parsers import FORMATS, add_deltas, parse_tool_calls
from kthena_serve.server.tool_parsers.pythonic import python_literal
from kthena_serve.server.tools import NamedToolChoice, Tool, chat_inputs, tool_constraint
from kthena_serve.spec import ServeSpec

# ---- the families' templates --------------------------------------------------------------------
_TURNS = """{%- if tools %}<|system|>{{ tools | tojson }}<|end|>{% endif %}
{%- for message in messages %}<|{{ message.role }}|>{% if message.tool_calls %}<<CALLS>>{% else %}{{ message.content }}{% endif %}<|end|>{% endfor %}"""
_PY_VALUE = """{%- macro py(v) -%}
{%- if v is sameas true %}True{% elif v is sameas false %}False{% elif v is none %}None
{%- elif v is mapping %}{ {%- for k in v %}{{ k | tojson }}: {{ py(v[k]) }}{% if not loop.last %}, {% endif %}{% endfor -%} }
{%- elif v is string or v is number %}{{ v | tojson }}
{%- else %}[{% for x in v %}{{ py(x) }}{% if not loop.last %}, {% endif %}{% endfor %}]{% endif -%}
{%- endmacro -%}
"""
CALLS = {
    # Qwen 2.5: one <tool_call> block per call, content before them
    "hermes": """{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}""",
    # Llama 3.1: {"name": ..., "parameters": ...}; several joined by "; " (as the parser reads)
    "llama3_json": """<|python_tag|>{% for call in message.tool_calls %}{{ '{"name": ' + (call.function.name | tojson) + ', "parameters": ' + (call.function.arguments | tojson) + '}' }}{% if not loop.last %}; {% endif %}{% endfor %}""",
    # Mistral 7B v0.3: one list, each call with its nine-character id
    "mistral": """{% if message.content %}{{ message.content }}{% endif %}[TOOL_CALLS] [{% for call in message.tool_calls %}{{ {"name": call.function.name, "arguments": call.function.arguments, "id": call.id} | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]""",
    # Mistral tokenizer v11: [TOOL_CALLS]name[ARGS]{...} per call
    "mistral_v11": """{% if message.content %}{{ message.content }}{% endif %}{% for call in message.tool_calls %}[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}{% endfor %}""",
    # Llama 3.2 pythonic: [name(key=value, ...), ...]
    "pythonic": """[{% for call in message.tool_calls %}{{ call.function.name }}({% for k in call.function.arguments %}{{ k }}={{ py(call.function.arguments[k]) }}{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]""",
    # Llama 4: the same list between <|python_start|> and <|python_end|>
    "pythonic_llama4": """<|python_start|>[{% for call in message.tool_calls %}{{ call.function.name }}({% for k in call.function.arguments %}{{ k }}={{ py(call.function.arguments[k]) }}{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]<|python_end|>""",
}
PARSER_OF = {"hermes": "hermes", "llama3_json": "llama3_json", "mistral": "mistral",
             "mistral_v11": "mistral", "pythonic": "pythonic", "pythonic_llama4": "pythonic"}
WITH_CONTENT = ("hermes", "mistral", "mistral_v11")  # formats with text before the calls


def template(family: str) -> str:
    """A whole chat template: the turns, an assistant's calls written the family's way."""
    macros = _PY_VALUE if family.startswith("pythonic") else ""
    return macros + _TURNS.replace("<<CALLS>>", CALLS[family])


def rendered_output(family: str, calls: list[tuple[str, dict]], content: str | None) -> str:
    """The assistant's turn as the family's template writes it (what a model would
    generate), through the server's own rendering (``chat_inputs`` + the tokenizer's jinja)."""
    body = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": f"abcdefgh{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}
            for i, (name, arguments) in enumerate(calls)]}],
        "tools": [{"type": "function", "function": {"name": name}} for name, _ in calls]})
    source = template(family)
    messages, extra = chat_inputs(body.messages, body.tools, source)
    assert "tools" in extra  # the template takes tools: calls as the template writes them
    text = _compile_template(source).render(messages=messages, **extra)
    return re.search(r"<\|assistant\|>(.*)<\|end\|>", text, re.DOTALL).group(1)


# ---- strategies ----------------------------------------------------------------------------------
_KEY = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True)
_LEAF = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
         | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
_VALUE = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_CALL = st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True),
                  st.dictionaries(_KEY, _VALUE, max_size=4))
_CALLS = st.lists(_CALL, min_size=1, max_size=3)
_CONTENT = st.none() | st.text(st.characters(blacklist_characters="<[", codec="utf-8"),
                               min_size=1, max_size=20).filter(str.strip)


def streamed(parser_name: str, text: str, cuts: list[int], max_calls: int | None = None,
             ) -> tuple[list[str], list[list[dict]]]:
    """Each step's content and deltas of ``text`` fed in pieces cut at ``cuts``."""
    parser = FORMATS[parser_name].parser(max_calls)
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    steps = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    steps.append(parser.finish())
    return [c for c, _ in steps], [d for _, d in steps]


def check_stream_agrees(parser_name: str, text: str, cuts: list[int]) -> None:
    """The stream adds up to the whole answer, in OpenAI's delta shape."""
    content, calls = parse_tool_calls(text, parser=parser_name)
    pieces, steps = streamed(parser_name, text, cuts)
    assert ("".join(pieces).strip() or None) == content
    folded: list[dict] = []
    for deltas in steps:
        assert len({d["index"] for d in deltas}) == len(deltas)  # one entry per call per step
        for delta in deltas:
            if delta["index"] == len(folded):  # a call's first delta names it
                assert set(delta) == {"index", "id", "type", "function"}
                assert delta["type"] == "function" and delta["function"]["name"]
            else:
                assert set(delta) == {"index", "function"} and delta["index"] < len(folded)
                assert set(delta["function"]) == {"arguments"}
            add_deltas(folded, [delta])
    assert [c["function"] for c in folded] == [c["function"] for c in calls]


# ---- parity with the templates -------------------------------------------------------------------
def test_every_flag_name_has_a_parser():
    assert tuple(FORMATS) == TOOL_CALL_PARSERS == ("hermes", "llama3_json", "mistral",
                                                   "pythonic")


@pytest.mark.parametrize("family", list(CALLS))
@settings(max_examples=60, deadline=None)
@given(calls=_CALLS, content=_CONTENT, cuts=st.lists(st.integers(0, 400), max_size=12))
def test_parser_recovers_the_calls_its_template_rendered(family, calls, content, cuts):
    content = content if family in WITH_CONTENT else None
    text = rendered_output(family, calls, content)
    assume("</tool_call>" not in json.dumps([a for _, a in calls], ensure_ascii=False))
    parser = PARSER_OF[family]
    got_content, got = parse_tool_calls(text, parser=parser)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] \
        == calls, text
    assert got_content == (content.strip() if content else None), text
    assert len({c["id"] for c in got}) == len(got)
    if parser == "mistral":  # ids Mistral's templates take back
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in got)
    else:
        assert all(c["id"].startswith("call_") for c in got)
    for step in (1, 3, 7):
        check_stream_agrees(parser, text, list(range(step, len(text), step)))
    check_stream_agrees(parser, text, cuts)


def test_pythonic_arguments_are_literals_never_evaluated():
    assert python_literal("(1, 'a', None, True, {'k': [2.5, -3]})") == \
        [1, "a", None, True, {"k": [2.5, -3]}]
    for source in ("__import__('os').getcwd()", "x", "1 + 1j", "{1, 2}", "b'x'",
                   "float('nan')", "{1: 2}", "1e999", "f'{x}'"):
        with pytest.raises(ValueError):
            python_literal(source)
    content, calls = parse_tool_calls("[run(cmd=__import__('os').getcwd())]",
                                      parser="pythonic")
    assert calls == [] and content == "[run(cmd=__import__('os').getcwd())]"


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    # not calls: content, whole
    ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
    ("llama3_json", 'I would call {"name": "f", "parameters": {}}',
     'I would call {"name": "f", "parameters": {}}', []),  # calls only where the output begins
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"parameters": {"a": 1}, "name": "f"}', None, [("f", {"a": 1})]),
    ("llama3_json", '{"name": "f", "parameters": {}} and more', "and more", [("f", {})]),
    ("llama3_json", '{"name": "f", "arguments": {"a": [1, ', None, [("f", '{"a": [1, ')]),
    ("mistral", "No tools needed.", "No tools needed.", []),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}] done', "done", [("f", {})]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[Note(s): see above]", "[Note(s): see above]", []),
    ("pythonic", "[f(a=1), g(b=x)]", ", g(b=x)]", [("f", {"a": 1})]),
    ("pythonic", "[f(a=1, b=x)]", "b=x)]", [("f", {"a": 1})]),
    ("pythonic", '[f(s="""two\nlines"""), ]', None, [("f", {"s": "two\nlines"})]),
    ("pythonic", "[f(a=1)] Done.", "Done.", [("f", {"a": 1})]),
    ("pythonic", "[f(a=[1, (2, 3)]", "[f(a=[1, (2, 3)]", []),  # ended before a whole call
    ("pythonic", "[f(a=1, b=[2", None, [("f", '{"a": 1')]),  # a call begun stays one
])
def test_what_is_content_and_what_is_a_call(parser, text, content, calls):
    """``calls``: (name, arguments as an object, or the exact text of unfinished ones)."""
    got_content, got = parse_tool_calls(text, parser=parser)
    assert got_content == content
    assert len(got) == len(calls)
    for call, (name, arguments) in zip(got, calls, strict=True):
        assert call["function"]["name"] == name
        if isinstance(arguments, str):
            assert call["function"]["arguments"] == arguments
        else:
            assert json.loads(call["function"]["arguments"]) == arguments
    for step in (1, 2, 5):
        check_stream_agrees(parser, text, list(range(step, len(text), step)))


@pytest.mark.parametrize(("parser", "text", "head", "rest"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa', '{"city": "Pa',
     'ris"}}'),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa',
     '{"city": "Pa', 'ris"}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', '{"city": "Pa', 'ris"}'),
    ("pythonic", '[get_weather(city="Paris", ', '{"city": "Paris"', 'unit="C")]'),
])
def test_a_streamed_call_sends_its_name_before_its_arguments_end(parser, text, head, rest):
    split = FORMATS[parser].parser(None)
    content, deltas = split.feed(text)
    assert content == ("Sure." if text.startswith("Sure.") else "")
    assert [(d["index"], d["function"]) for d in deltas] == \
        [(0, {"name": "get_weather", "arguments": head})]
    _, more = split.feed(rest)
    more += split.finish()[1]
    whole = head + "".join(d["function"]["arguments"] for d in more)
    assert json.loads(whole)["city"] == "Paris"


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_content_is_not_held_back(parser):
    split = FORMATS[parser].parser(None)
    assert split.feed("The weather ") == ("The weather", [])  # trailing space waits
    assert split.feed("is fine.\n") == (" is fine.", [])
    assert split.finish() == ("\n", [])


@pytest.mark.parametrize(("parser", "text"), [
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{}"),
    ("pythonic", "[f(), g()]"),
])
def test_parallel_tool_calls_false_keeps_the_first(parser, text):
    assert [c["function"]["name"] for c in parse_tool_calls(text, 1, parser)[1]] == ["f"]
    _, steps = streamed(parser, text, list(range(1, len(text))), max_calls=1)
    assert [d["function"].get("name") for s in steps for d in s if "id" in d] == ["f"]


# ---- the constraint in each format ----------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 10}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.mark.parametrize(("parser", "one", "two", "other", "time"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     "</tool_call>", '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     '{"name": "get_time", "parameters": {}}',
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     '; {"name": "get_time", "parameters": {}}', "<tool_call>",
     '{"name": "get_time", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}',
     ', {"name": "get_time", "arguments": {}}', '{"name"',
     '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
])
def test_required_and_named_are_constrained_in_the_parsers_format(parser, one, two, other,
                                                                   time):
    tools = [Tool.model_validate(t) for t in (WEATHER, TIME)]
    grammars = Grammars(default_tokenizer(), 49152)
    end = "]" if parser == "mistral" else ""
    for parallel in (True, False):
        matcher = grammars.matcher(tool_constraint(tools, "required", parallel, parser))
        assert matcher.accept_string(one)
        assert matcher.accept_string(two) is parallel
        assert not grammars.matcher(tool_constraint(tools, "required", parallel, parser)) \
            .accept_string(other)
    text = one + two + end
    assert [c["function"]["name"] for c in parse_tool_calls(text, parser=parser)[1]] == \
        ["get_weather", "get_time"]
    named = NamedToolChoice.model_validate({"type": "function",
                                            "function": {"name": "get_time"}})
    assert grammars.matcher(tool_constraint(tools, named, True, parser)).accept_string(time)
    weather = one[:one.index("get_weather") + len("get_weather")]
    assert not grammars.matcher(tool_constraint(tools, named, True, parser)) \
        .accept_string(weather)  # not the named tool
    assert [c["function"]["name"] for c in parse_tool_calls(time, parser=parser)[1]] == \
        ["get_time"]


def test_pythonic_refuses_a_constraint_by_name():
    tools = [Tool.model_validate(WEATHER)]
    with pytest.raises(InvalidRequestError) as error:
        tool_constraint(tools, "required", True, "pythonic")
    assert error.value.param == "tool_choice"
    assert "pythonic" in str(error.value) and "auto" in str(error.value)
    assert tool_constraint(tools, "auto", True, "pythonic") is None


# ---- the flag ----------------------------------------------------------------------------------
def test_the_flag_sets_the_spec_and_refuses_unknown_names():
    assert ServeSpec.resolve({}).tool_call_parser == "hermes"
    spec = ServeSpec.resolve({"tool_call_parser": "llama3_json"})
    assert spec.tool_call_parser == "llama3_json"
    assert ServeSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="allowed: hermes, llama3_json, mistral, pythonic"):
        ServeSpec.resolve({"tool_call_parser": "llama3"})
    # every mode (test_modes_tools_and_names.py serves DP and PD with llama3_json)
    assert ServeSpec.resolve({"tool_call_parser": "mistral", "dp": 2}).tool_call_parser == "mistral"


def test_kthena_serve_names_the_parsers_in_one_line():
    done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve",
                           "--enable-auto-tool-choice", "--tool-call-parser", "llama"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "kthena serve: --tool-call-parser: 'llama' is not a tool-call parser; allowed: "
        "hermes, llama3_json, mistral, pythonic"]


# ---- the routes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory):
    """A tiny engine whose chat template takes tools (Llama 3.1's calls)."""
    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.engine import LLMEngine
    from kthena_serve.engine.config import EngineConfig

    folder = tiny_checkpoint(tmp_path_factory.mktemp("llama_tools"))
    (folder / "chat_template.jinja").write_text(template("llama3_json"))
    config = EngineConfig(dtype="float32", num_kv_blocks=512, block_size=4,
                          max_num_batched_tokens=256, max_num_seqs=8, num_threads=1)
    engine = AsyncLLM(LLMEngine.from_config(config, model=tiny_llama(),
                                            tokenizer=Tokenizer.from_pretrained(folder))).start()
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def clients(llama_engine):
    from kthena_serve.server import BackgroundServer, build_app

    with BackgroundServer(build_app(llama_engine, model_name="tiny",
                                    tool_call_parser="llama3_json")) as llama, \
            BackgroundServer(build_app(llama_engine, model_name="tiny",
                                       tool_call_parser="mistral")) as mistral, \
            BackgroundServer(build_app(llama_engine, model_name="tiny",
                                       tool_call_parser="pythonic")) as pythonic, \
            BackgroundServer(build_app(llama_engine, model_name="tiny")) as hermes:
        yield {name: httpx.Client(base_url=s.url, timeout=120) for name, s in
               (("llama3_json", llama), ("mistral", mistral), ("pythonic", pythonic),
                ("hermes", hermes))}


def _no_space() -> dict[str, float]:
    """A random model left free among JSON's optional whitespace tends to pick it for ever:
    bias those tokens away."""
    tokenizer = default_tokenizer()
    return {str(i): -100.0 for i in range(tokenizer.vocab_size)
            if tokenizer.token_strs([i])[0] not in tokenizer.special_tokens
            and not tokenizer.token_bytes([i])[0].strip()}


def _body(**fields) -> dict:
    return {"model": "tiny", "temperature": 0, "max_tokens": 200, "tools": [WEATHER, TIME],
            "messages": [{"role": "user", "content": "The weather in Oslo?"}], **fields}


def _stream(client: httpx.Client, body: dict) -> tuple[str, list[dict], str | None]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as answer:
        assert answer.status_code == 200, answer.read()
        chunks = [json.loads(line[6:]) for line in answer.iter_lines()
                  if line.startswith("data: {")]
    content, calls, reason = "", [], None
    for chunk in chunks:
        choice = chunk["choices"][0]
        content += choice["delta"].get("content") or ""
        add_deltas(calls, choice["delta"].get("tool_calls") or [])
        reason = choice["finish_reason"] or reason
    return content, calls, reason


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_in_the_chosen_format(clients, parser, choice):
    """The grammar holds the random model to the parser's format: whatever it writes parses
    into calls of the tools, whole and streamed alike."""
    client = clients[parser]
    # one call, so the output ends where the grammar does (a random model may chain calls)
    body = _body(tool_choice=choice, parallel_tool_calls=False, logit_bias=_no_space())
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    choice_ = answer.json()["choices"][0]
    assert choice_["finish_reason"] == "tool_calls", choice_
    calls = choice_["message"]["tool_calls"]
    assert calls and choice_["message"]["content"] is None
    for call in calls:
        assert call["function"]["name"] in ("get_weather", "get_time")
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert isinstance(arguments["city"], str) and set(arguments) == {"city"}
    if isinstance(choice, dict):
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
    if parser == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
    content, streamed_calls, reason = _stream(client, body)
    assert (content, reason) == ("", "tool_calls")
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]


def test_auto_is_parsed_by_the_chosen_parser(clients):
    body = _body(max_tokens=12)
    for name in ("llama3_json", "mistral", "pythonic"):
        answer = clients[name].post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        message = answer.json()["choices"][0]["message"]
        assert message["content"] and "tool_calls" not in message  # the random model calls nothing


def test_formats_the_template_or_the_parser_cannot_read_are_400(clients):
    answer = clients["pythonic"].post("/v1/chat/completions",
                                      json=_body(tool_choice="required"))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice"
    assert "pythonic" in answer.json()["error"]["message"]
    # hermes (the default) over a template that writes Llama's calls: name the other parsers
    answer = clients["hermes"].post("/v1/chat/completions", json=_body())
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"
    assert "--tool-call-parser" in answer.json()["error"]["message"]
    none = clients["hermes"].post("/v1/chat/completions", json=_body(tool_choice="none",
                                                                     max_tokens=4))
    assert none.status_code == 200, none.text


def test_another_parser_over_a_template_without_tools_is_400():
    """SmolLM2's template takes no tools: the prompt asks for Hermes blocks, which only the
    hermes parser reads."""
    from kthena_serve.server.tools import check_tool_format

    smollm2 = default_tokenizer().chat_template
    check_tool_format(smollm2, "hermes")
    for parser in ("llama3_json", "mistral", "pythonic"):
        with pytest.raises(InvalidRequestError) as error:
            check_tool_format(smollm2, parser)
        assert error.value.param == "tools" and parser in str(error.value)


def test_the_parsers_sampling_parameters():
    """hermes keeps the request's own (its constraint came from the body); another parser gets
    its format's constraint, and mistral keeps special tokens ([TOOL_CALLS] is one)."""
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.server.tools import tool_params

    tools = [Tool.model_validate(t) for t in (WEATHER, TIME)]
    params = SamplingParams(max_tokens=8)
    assert tool_params(params, tools, "required", True, "hermes") is params
    llama = tool_params(params, tools, "required", False, "llama3_json")
    assert llama.structured_outputs == tool_constraint(tools, "required", False, "llama3_json")
    assert llama.skip_special_tokens
    mistral = tool_params(params, tools, "auto", True, "mistral")
    assert mistral.structured_outputs is None and not mistral.skip_special_tokens
    assert tool_params(params, tools, "none", True, "mistral") is params
