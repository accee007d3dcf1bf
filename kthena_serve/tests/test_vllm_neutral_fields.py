"""vLLM's declared request fields this server does not serve, and its neutral values: each
accepted (the answer is the one without it), ignored with a logged warning naming it (the
answer is the same), or refused by name; ``echo`` with ``max_tokens: 0`` (the prompt and its
logprobs, nothing generated); ``return_token_ids``, chat ``echo``, ``documents`` and
``reasoning_effort``; ``vllm serve``'s flag names as ``kthena serve`` aliases and
``kthena serve``'s usage on a bad flag.

The field sets are vLLM's ``CompletionRequest`` / ``ChatCompletionRequest`` fields and their
defaults (``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``), written out
here rather than read from the server's table, so the two are checked against each other.
Prompts are drawn fresh each run from the suite's order seed (``--order-seed`` replays them).
Served by a tiny random-weight model, greedy with ``ignore_eos``, so every answer is
reproducible within the module.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets

import httpx
import pytest
from _tiny import prompt_logprobs_of, tiny_llama, tiny_server

from kthena_core.cli import build_parser
from kthena_serve.async_engine import AsyncLLM
from kthena_serve.cli import spec_from_args
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.model import Tokenizer, resolve_checkpoint
from kthena_serve.server import BackgroundServer, build_app
from kthena_serve.server.unserved import CHAT_UNSERVED, COMPLETION_UNSERVED, UNSERVED

MODEL = "tiny"
SEED = int(os.environ.get("KTHENA_TEST_ORDER_SEED") or secrets.randbelow(2**32))
ROUTES_LOG = "kthena_serve.server.routes"
# the engine both the server and the reference core run (native kernels: the same sums in both)
ENGINE = {"num_kv_blocks": 512, "max_num_batched_tokens": 128, "kernels": "native"}

# vLLM's defaults, or values it treats the same, of the fields not served here
NEUTRAL = {"use_beam_search": False, "watermarking": None, "truncation_side": "left",
           "logprob_token_ids": None, "vllm_xargs": {}, "repetition_detection": None,
           "thinking_token_budget": -1, "length_penalty": 1.0, "session_id": None,
           "routed_experts_prompt_start": 0, "return_token_offsets": False,
           "return_mm_kwargs": True, "ec_transfer_params": None, "stream_interval": None,
           "service_tier": "auto", "metadata": None,
           "safety_identifier": None, "prompt_cache_key": None}
NEUTRAL_COMPLETION = {**NEUTRAL, "prompt_embeds": None}
NEUTRAL_CHAT = {**NEUTRAL, "chat_template": None, "return_prompt_text": False,
                "include_reasoning": True, "media_io_kwargs": None, "mm_processor_kwargs": {},
                "echo": False, "documents": None, "reasoning_effort": None}
# values that change nothing here: accepted, with a warning naming the field
IGNORED = {"length_penalty": 0.5, "session_id": "conversation-7",
           "routed_experts_prompt_start": 3, "return_token_offsets": True,
           "return_mm_kwargs": False, "ec_transfer_params": {"remote": "x"},
           "stream_interval": 4, "service_tier": "flex", "metadata": {"team": "eval"},
           "safety_identifier": "user-9", "prompt_cache_key": "k"}
IGNORED_CHAT = {"include_reasoning": False, "media_io_kwargs": {"image": {"fmt": "png"}},
                "mm_processor_kwargs": {"num_crops": 4}}
# values that would change the answer: a 400 naming the field
REFUSED = {"use_beam_search": True, "watermarking": True, "logprob_token_ids": [5, 6],
           "vllm_xargs": {"my_plugin": 1}, "repetition_detection": {"max_pattern_size": 4},
           "thinking_token_budget": 64}
REFUSED_COMPLETION = {"prompt_embeds": "AAAA"}
REFUSED_CHAT = {"chat_template": "{{ messages }}", "return_prompt_text": True}


def _rng(salt: str) -> random.Random:
    return random.Random(f"{SEED}-{salt}")


def _text(rng: random.Random, num_words: int) -> str:
    words = ("river", "stone", "light", "seven", "quiet", "market", "orbit", "paper", "field",
             "copper", "winter", "signal", "garden", "north", "echo", "lantern")
    return " ".join(rng.choice(words) for _ in range(num_words)).capitalize()


@pytest.fixture(scope="module")
def served():
    with tiny_server(MODEL, timeout_s=60, **ENGINE) as pair:
        yield pair



def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": _text(_rng("prompt"), 9), "temperature": 0,
            "max_tokens": 6, "ignore_eos": True, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": _text(_rng("chat"), 7)}],
            "temperature": 0, "max_tokens": 6, "ignore_eos": True, **fields}


def _answer(client: httpx.Client, path: str, body: dict) -> dict:
    reply = client.post(path, json=body)
    assert reply.status_code == 200, (SEED, reply.text)
    return reply.json()


def _output(answer: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"] for c in answer["choices"]]


def _stream(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        return [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines()
                if line.startswith("data: {")]


def _warned(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ROUTES_LOG]


# ---- the field sets ------------------------------------------------------------------------------
def test_the_sets_cover_the_servers_table():
    assert set(NEUTRAL_COMPLETION) == set(UNSERVED) | set(COMPLETION_UNSERVED)
    assert set(NEUTRAL_CHAT) == set(UNSERVED) | set(CHAT_UNSERVED) | {
        "echo", "documents", "reasoning_effort"}  # honoured: tested below
    assert set(IGNORED) | set(IGNORED_CHAT) == {
        n for n, f in {**UNSERVED, **CHAT_UNSERVED}.items() if not f.refused}
    assert set(REFUSED) | set(REFUSED_COMPLETION) | set(REFUSED_CHAT) | {"truncation_side"} == {
        n for n, f in {**UNSERVED, **CHAT_UNSERVED, **COMPLETION_UNSERVED}.items() if f.refused}


@pytest.mark.parametrize(("path", "body", "neutral"), [
    ("/v1/completions", _completion, NEUTRAL_COMPLETION),
    ("/v1/chat/completions", _chat, NEUTRAL_CHAT)])
def test_neutral_values_answer_as_if_left_out(client, caplog, path, body, neutral):
    plain = _output(_answer(client, path, body()))
    caplog.set_level(logging.WARNING, logger=ROUTES_LOG)
    assert _output(_answer(client, path, body(**neutral))) == plain, SEED
    assert _warned(caplog) == []
    for name, value in neutral.items():  # each alone too
        assert _output(_answer(client, path, body(**{name: value}))) == plain, (name, SEED)


@pytest.mark.parametrize(("path", "body", "name", "value"), [
    *[("/v1/completions", _completion, n, v) for n, v in IGNORED.items()],
    *[("/v1/chat/completions", _chat, n, v) for n, v in {**IGNORED, **IGNORED_CHAT}.items()]])
def test_ignored_values_answer_the_same_and_warn_by_name(client, caplog, path, body, name,
                                                        value):
    plain = _output(_answer(client, path, body()))
    caplog.set_level(logging.WARNING, logger=ROUTES_LOG)
    assert _output(_answer(client, path, body(**{name: value}))) == plain, SEED
    (warning,) = _warned(caplog)
    assert warning.startswith(f"request field {name}=") and "is ignored: " in warning


@pytest.mark.parametrize(("path", "body", "name", "value"), [
    *[("/v1/completions", _completion, n, v) for n, v in {**REFUSED,
                                                          **REFUSED_COMPLETION}.items()],
    *[("/v1/chat/completions", _chat, n, v) for n, v in {**REFUSED, **REFUSED_CHAT}.items()]])
def test_values_that_would_change_the_answer_are_refused_by_name(client, path, body, name,
                                                                 value):
    reply = client.post(path, json=body(**{name: value}))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == name
    assert error["message"].startswith(f"{name}=") and " is not supported: " in error["message"]


def test_truncation_side_right_is_refused_only_where_it_would_cut(client):
    plain = _output(_answer(client, "/v1/completions", _completion()))
    same = _answer(client, "/v1/completions", _completion(truncation_side="right"))
    assert _output(same) == plain
    cut = client.post("/v1/completions", json=_completion(truncation_side="right",
                                                          truncate_prompt_tokens=3))
    assert cut.status_code == 400 and cut.json()["error"]["param"] == "truncation_side"
    left = _answer(client, "/v1/completions", _completion(truncation_side="left",
                                                          truncate_prompt_tokens=3))
    assert left["usage"]["prompt_tokens"] == 3


def test_a_field_neither_declares_is_still_a_400_naming_it(client):
    for path, body in (("/v1/completions", _completion), ("/v1/chat/completions", _chat)):
        reply = client.post(path, json=body(max_token=5))  # a misspelt max_tokens
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "max_token"


def test_a_bad_type_in_a_declared_field_is_a_400(client):
    for name, value in (("use_beam_search", "no"), ("service_tier", "fastest"),
                        ("metadata", {"a": 1}), ("routed_experts_prompt_start", -1)):
        reply = client.post("/v1/completions", json=_completion(**{name: value}))
        assert reply.status_code == 400, (name, reply.text)
        assert reply.json()["error"]["param"].split(".")[0] == name


# ---- echo with max_tokens 0: the prompt scored, nothing generated --------------------------------


def test_echo_with_max_tokens_0_answers_the_prompt_and_its_logprobs(client, engine):
    rng = _rng("score")
    prompt, k = _text(rng, rng.randrange(6, 20)), rng.randrange(0, 5)
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": k,
            "return_tokens_as_token_ids": True}  # alternatives named by id: none collide
    answer = _answer(client, "/v1/completions", body)
    (choice,) = answer["choices"]
    ids = engine.processor.encode(prompt, add_special_tokens=True)
    assert choice["text"] == prompt and choice["finish_reason"] == "length", SEED
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(ids)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids)  # the prompt's tokens, nothing after them
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"] == [f"token_id:{i}" for i in ids]
    reference = prompt_logprobs_of(ids, k, **ENGINE)
    for served, top, entry in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:],
                                  reference[1:], strict=True):
        assert served == entry.logprob, SEED
        expected = {f"token_id:{i}": v for i, v in zip(entry.top_ids, entry.top_logprobs,
                                                          strict=True)}
        expected.setdefault(f"token_id:{entry.token_id}", entry.logprob)
        assert top == expected, SEED
    # the same prompt logprobs as vLLM's prompt_logprobs field and echo with generation carry
    scored = _answer(client, "/v1/completions", {**body, "max_tokens": 1})["choices"][0]
    assert scored["logprobs"]["token_logprobs"][:len(ids)] == logprobs["token_logprobs"]
    fielded = _answer(client, "/v1/completions", {**body, "prompt_logprobs": k})["choices"][0]
    assert [e[str(i)]["logprob"] for e, i in zip(fielded["prompt_logprobs"][1:], ids[1:],
                                                  strict=True)] == logprobs["token_logprobs"][1:]


def test_echo_with_max_tokens_0_streams_and_serves_several_prompts(client):
    rng = _rng("score-many")
    prompts = [_text(rng, rng.randrange(3, 12)) for _ in range(2)]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "max_tokens": 0, "n": 2}
    whole = _answer(client, "/v1/completions", body)
    assert _output(whole) == [p for p in prompts for _ in range(2)], SEED
    assert all(c["logprobs"] is None for c in whole["choices"])
    with_logprobs = _answer(client, "/v1/completions", {**body, "logprobs": 1})
    chunks = _stream(client, "/v1/completions", {**body, "logprobs": 1})
    texts: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["text"]:  # the one chunk with the prompt carries its logprobs
            expected = with_logprobs["choices"][choice["index"]]["logprobs"]
            assert choice["logprobs"]["token_logprobs"] == expected["token_logprobs"]
    assert [texts[i] for i in range(4)] == _output(whole)
    finished = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]
                ["finish_reason"]]
    assert finished == ["length"] * 4


def test_max_tokens_0_without_echo_or_with_min_tokens_is_a_400(client):
    for fields, param in (({"max_tokens": 0}, "max_tokens"),
                          ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens")):
        reply = client.post("/v1/completions", json=_completion(**fields))
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    reply = client.post("/v1/completions", json=_completion(max_tokens=0))
    assert "echo" in reply.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json=_chat(max_tokens=0, echo=True))
    assert chat.status_code == 400  # chat generates its answer: at least 1 token


# ---- return_token_ids ---------------------------------------------------------------------------
def test_return_token_ids_completions(client, engine):
    body = _completion(return_token_ids=True, logprobs=0, return_tokens_as_token_ids=True)
    (choice,) = _answer(client, "/v1/completions", body)["choices"]
    sampled = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert choice["token_ids"] == sampled and len(sampled) == body["max_tokens"]
    assert engine.processor.decode(choice["token_ids"]) == choice["text"]
    assert choice["prompt_token_ids"] == engine.processor.encode(body["prompt"])
    chunks = _stream(client, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == choice["token_ids"]
    plain = _answer(client, "/v1/completions", _completion())["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_return_token_ids_chat(client, engine):
    body = _chat(return_token_ids=True)
    answer = _answer(client, "/v1/chat/completions", body)
    tokens = client.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    assert answer["prompt_token_ids"] == tokens
    (choice,) = answer["choices"]
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
    assert engine.processor.decode(choice["token_ids"]) == choice["message"]["content"]
    chunks = _stream(client, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == tokens
    assert [i for c in chunks for i in c["choices"][0].get("token_ids", ())] == (
        choice["token_ids"])


# ---- chat echo, documents, reasoning_effort -----------------------------------------------------
def test_chat_echo_puts_the_last_message_before_the_answer(client):
    said = _text(_rng("echo"), 4)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": said}]
    body = {**_chat(), "messages": messages, "add_generation_prompt": False}
    plain = _output(_answer(client, "/v1/chat/completions", body))[0]
    echoed = _output(_answer(client, "/v1/chat/completions", {**body, "echo": True}))[0]
    assert echoed == said + plain, SEED
    streamed = "".join(c["choices"][0]["delta"].get("content", "")
                       for c in _stream(client, "/v1/chat/completions", {**body, "echo": True}))
    assert streamed == echoed
    # after a generation prompt the answer is the assistant's, the last message the user's
    opened = _chat()
    assert _output(_answer(client, "/v1/chat/completions", {**opened, "echo": True})) == (
        _output(_answer(client, "/v1/chat/completions", opened)))


def test_documents_and_reasoning_effort_are_ignored_with_a_warning_by_a_template_without_them(
        client, caplog):
    plain = _answer(client, "/v1/chat/completions", _chat())
    caplog.set_level(logging.WARNING, logger=ROUTES_LOG)
    fields = {"documents": [{"title": "t", "text": _text(_rng("doc"), 5)}],
              "reasoning_effort": "low"}
    answer = _answer(client, "/v1/chat/completions", _chat(**fields))
    assert _output(answer) == _output(plain)
    assert answer["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert sorted(w.split("=")[0] for w in _warned(caplog)) == [
        "request field documents", "request field reasoning_effort"]


_RAG_TEMPLATE = (
    "{% if documents %}{% for d in documents %}[doc {{ d['title'] }}: {{ d['text'] }}]"
    "{% endfor %}{% endif %}{% if enable_thinking is defined %}[think {{ enable_thinking }}]"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def rag_client(tmp_path_factory):
    """A server whose chat template reads ``documents`` and ``enable_thinking``."""
    folder, default = tmp_path_factory.mktemp("rag"), resolve_checkpoint("default")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((default / name).read_bytes())
    (folder / "chat_template.jinja").write_text(_RAG_TEMPLATE, encoding="utf-8")
    tokenizer = Tokenizer.from_pretrained(folder)
    config = EngineConfig(dtype="float32", num_kv_blocks=128, block_size=4, num_threads=1,
                          max_num_batched_tokens=128, kernels="native")
    core = LLMEngine.from_config(config, model=tiny_llama(), tokenizer=tokenizer)
    async_engine = AsyncLLM(core).start()
    try:
        with BackgroundServer(build_app(async_engine, model_name=MODEL)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as http:
            yield http, tokenizer
    finally:
        async_engine.shutdown()


def test_documents_and_reasoning_effort_reach_a_template_that_reads_them(rag_client, caplog):
    client, tokenizer = rag_client
    assert tokenizer.chat_template == _RAG_TEMPLATE
    documents = [{"title": "a", "text": _text(_rng("rag"), 6)}]
    caplog.set_level(logging.WARNING, logger=ROUTES_LOG)
    for fields, variables, warned in (
            ({"documents": documents}, {"documents": documents}, []),
            ({"reasoning_effort": "none"}, {"enable_thinking": False}, []),
            ({"reasoning_effort": "high"}, {"enable_thinking": True}, []),
            # the caller's own variable wins, as in vLLM: reasoning_effort then sets nothing
            ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
             {"enable_thinking": True}, ["reasoning_effort"])):
        caplog.clear()
        answer = _answer(client, "/v1/chat/completions", _chat(**fields))
        messages = _chat()["messages"]
        expected = tokenizer.encode_chat(messages, template_kwargs=variables)
        assert answer["usage"]["prompt_tokens"] == len(expected), fields
        assert len(expected) > len(tokenizer.encode_chat(messages)), fields
        assert [w.split("=")[0].removeprefix("request field ") for w in _warned(caplog)] == (
            warned)


# ---- vllm serve's flag names ---------------------------------------------------------------------
def _spec(*argv: str):
    return spec_from_args(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize(("ours", "vllms"), [
    (["--tp", "2"], ["--tensor-parallel-size", "2"]),
    (["--pp", "2"], ["--pipeline-parallel-size", "2"]),
    (["--dp", "2"], ["--data-parallel-size", "2"]),
    (["--no-prefix-caching"], ["--no-enable-prefix-caching"]),
])
def test_vllm_flag_names_reach_the_same_spec_as_ours(ours, vllms):
    spec = _spec(*ours)
    assert spec != _spec()  # the flag changes the spec ...
    assert _spec(*vllms) == spec  # ... and vLLM's name changes it the same way


def test_enable_prefix_caching_is_the_default_and_wins_over_a_config(tmp_path):
    assert _spec("--enable-prefix-caching") == _spec()
    assert _spec("--no-prefix-caching", "--enable-prefix-caching") == _spec()  # the last wins
    config = tmp_path / "kthena_config.yaml"
    config.write_text("cluster: {topology: auto:cores}\nmodel: {checkpoint_path: default}\n"
                      "service: {kv_cache_reuse: false}\n", encoding="utf-8")
    off, on = _spec("--config", str(config)), _spec("--config", str(config),
                                                     "--enable-prefix-caching")
    assert (off.engine.enable_prefix_caching, on.engine.enable_prefix_caching) == (False, True)


def test_the_flags_vllm_shares_with_us_reach_the_spec():
    spec = _spec("--served-model-name", "m", "--max-model-len", "512", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "256")
    assert spec.served_model_name == "m"
    engine = spec.engine
    assert (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens) == (
        512, 4, 256)


@pytest.mark.parametrize(("argv", "usage", "said"), [
    (["serve", "--bogus"], "usage: kthena serve ", "unrecognized arguments: --bogus"),
    (["serve", "--tp", "1", "--bogus", "x"], "usage: kthena serve ", "--bogus x"),
    (["bench", "serve", "--bogus"], "usage: kthena bench serve ", "--bogus"),
    (["serve", "--gpu-memory-utilization", "0.9"], "usage: kthena serve ", "--kv-cache-memory"),
])
def test_a_bad_flag_prints_the_subcommands_usage(capsys, argv, usage, said):
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and said in err.splitlines()[-1], err
    assert err.splitlines()[-1].startswith(f"kthena {' '.join(usage.split()[2:])}: error: ")
