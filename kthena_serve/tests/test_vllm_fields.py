"""vLLM's request fields, honoured with vLLM's meaning: include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens, logit_bias, allowed_token_ids, bad_words,
truncate_prompt_tokens, return_tokens_as_token_ids, request_id, priority, add_special_tokens,
add_generation_prompt / continue_final_message / chat_template_kwargs; /version, /docs and
``kthena --version``. Served by a tiny random-weight model (greedy, so every answer is
reproducible within the module)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch
from _tiny import prompt_logprobs_of, tiny_engine, tiny_server

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.sampler import Sampler
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.pd.protocol import params_from_json, params_to_json

MODEL = "tiny"
PROMPT = "The capital of France is a city of light and"
BASE = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def served():
    with tiny_server(MODEL, timeout_s=60, num_kv_blocks=512, max_num_batched_tokens=128) as pair:
        yield pair



def complete(client: httpx.Client, **fields) -> dict:
    answer = client.post("/v1/completions", json={**BASE, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def token_ids(answer: dict) -> list[int]:
    """The output's ids, from logprobs named with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]


def ids_of(client: httpx.Client, **fields) -> list[int]:
    return token_ids(complete(client, logprobs=0, return_tokens_as_token_ids=True, **fields))


def test_return_tokens_as_token_ids_names_tokens_by_id(client, engine):
    answer = complete(client, logprobs=1, return_tokens_as_token_ids=True)
    logprobs = answer["choices"][0]["logprobs"]
    ids = token_ids(answer)
    assert len(ids) == 8
    assert engine.processor.tokenizer.decode(ids) == answer["choices"][0]["text"]
    assert all(all(k.startswith("token_id:") for k in top) for top in logprobs["top_logprobs"])


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    text = complete(client)["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    cut = complete(client, stop=[stop])["choices"][0]
    kept = complete(client, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert cut["text"] == text[: text.find(stop)]
    assert kept["text"] == text[: text.find(stop)] + stop


def test_logit_bias_moves_the_greedy_choice(client, engine):
    first = ids_of(client, max_tokens=1)[0]
    favoured = 1000 if first != 1000 else 1001
    assert ids_of(client, logit_bias={str(favoured): 100}) == [favoured] * 8
    assert ids_of(client, max_tokens=1, logit_bias={str(first): -100}) != [first]
    # OpenAI's range: a bias past 100 is clamped, as vLLM does; an id past the vocabulary is not
    assert ids_of(client, max_tokens=2, logit_bias={str(favoured): 1e6}) == [favoured] * 2
    vocab = engine.processor.limits.vocab_size
    bad = client.post("/v1/completions", json={**BASE, "logit_bias": {str(vocab): 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_allowed_token_ids_limit_every_sampled_token(client):
    allowed = [300, 301, 302]
    for temperature in (0, 1.0):
        got = ids_of(client, allowed_token_ids=allowed, temperature=temperature, seed=3)
        assert set(got) <= set(allowed), got
    empty = client.post("/v1/completions", json={**BASE, "allowed_token_ids": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "allowed_token_ids"


def test_skip_special_tokens_false_keeps_special_token_text(client, engine):
    tokenizer = engine.processor.tokenizer
    special = tokenizer.token_to_id("<|im_start|>")
    both = {"allowed_token_ids": [special], "max_tokens": 2}
    assert complete(client, **both)["choices"][0]["text"] == ""
    assert complete(client, skip_special_tokens=False, **both)["choices"][0]["text"] == (
        "<|im_start|><|im_start|>")
    for spaces in (True, False):  # accepted either way (a fast tokenizer adds no spaces)
        assert complete(client, spaces_between_special_tokens=spaces, skip_special_tokens=False,
                        **both)["choices"][0]["text"] == "<|im_start|><|im_start|>"


def test_bad_words_are_never_generated(client, engine):
    tokenizer = engine.processor.tokenizer
    greedy = ids_of(client)
    word = tokenizer.decode(greedy[2:3]).strip()
    assert word, greedy
    got = ids_of(client, bad_words=[word])
    runs = engine.processor._bad_word_runs([word])
    for run in runs:
        assert not any(tuple(got[i:i + len(run)]) == run for i in range(len(got))), (run, got)
    assert got != greedy
    blank = client.post("/v1/completions", json={**BASE, "bad_words": [" "]})
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "bad_words"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, engine):
    ids = engine.processor.encode(PROMPT)
    assert len(ids) > 4
    cut = complete(client, truncate_prompt_tokens=4, logprobs=0, return_tokens_as_token_ids=True)
    assert cut["usage"]["prompt_tokens"] == 4
    same = complete(client, prompt=ids[-4:], logprobs=0, return_tokens_as_token_ids=True)
    assert token_ids(cut) == token_ids(same)
    whole = complete(client, truncate_prompt_tokens=-1)
    assert whole["usage"]["prompt_tokens"] == len(ids)
    too_long = client.post("/v1/completions", json={**BASE, "truncate_prompt_tokens": 10**6})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "truncate_prompt_tokens"


def test_request_id_names_the_response_and_priority_zero_only(client):
    assert complete(client, request_id="abc-123")["id"] == "cmpl-abc-123"
    chat = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "request_id": "xyz"})
    assert chat.json()["id"] == "chatcmpl-xyz"
    assert complete(client, priority=0)["usage"]["completion_tokens"] == 8
    refused = client.post("/v1/completions", json={**BASE, "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "first-come first-served" in refused.json()["error"]["message"]


def test_continue_final_message_and_template_kwargs(client, engine):
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "My favourite colour is"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    tokens = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                            "continue_final_message": True}).json()["tokens"]
    assert answer.json()["usage"]["prompt_tokens"] == len(tokens)
    tokenizer = engine.processor.tokenizer
    assert tokenizer.decode(tokens, skip_special_tokens=False).endswith("My favourite colour is")
    closed = tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert len(closed) > len(tokens)  # the end of the turn is left off
    both = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"
    kwargs = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages[:1], "max_tokens": 1,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs.status_code == 200, kwargs.text
    reserved = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages[:1], "chat_template_kwargs": {"messages": []}})
    assert reserved.status_code == 400 and "messages" in reserved.json()["error"]["message"]


def test_version_docs_and_cli_version(client):
    from kthena_serve import __version__

    assert client.get("/version").json() == {"version": __version__}
    assert __version__ and __version__ != "0+unknown"
    assert client.get("/docs").status_code == 200
    done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("kthena ")
    assert f"kthena-serve {__version__}" in " ".join(done.stdout.split())


# ---- the sampler and the parameters, without a server ------------------------------------------
class Row:
    def __init__(self, params: SamplingParams, output: list[int], prompt: list[int] = ()) -> None:
        self.request_id, self.params = "r", params
        self.output_token_ids, self.token_ids = output, [*prompt, *output]


def test_a_bad_words_run_is_barred_only_after_its_head():
    logits = torch.zeros(1, 10)
    logits[0, 7] = 5.0  # the greedy pick
    params = SamplingParams(temperature=0, bad_words_token_ids=((3, 7),))
    assert Sampler("cpu")(logits, [Row(params, [1, 2])]) == [7]  # head 3 not at the end
    assert Sampler("cpu")(logits, [Row(params, [1, 3])]) != [7]  # 3 then 7: 7 is barred
    single = SamplingParams(temperature=0, bad_words_token_ids=((7,),))
    assert Sampler("cpu")(logits, [Row(single, [])]) != [7]


def test_bias_and_allowed_ids_act_per_row_in_one_batch():
    logits = torch.zeros(3, 10)
    logits[:, 0] = 1.0
    rows = [Row(SamplingParams(temperature=0), []),
            Row(SamplingParams(temperature=0, logit_bias={"4": 2.0}), []),
            Row(SamplingParams(temperature=0, allowed_token_ids=[8, 9]), [])]
    assert Sampler("cpu")(logits, rows) == [0, 4, 8]


def test_the_new_fields_survive_the_pd_wire_and_bad_values_are_named():
    params = SamplingParams(logit_bias={"5": 150.0, 2: -3}, allowed_token_ids=[1, 2],
                            bad_words=["foo"], bad_words_token_ids=[[4, 5]],
                            include_stop_str_in_output=True, skip_special_tokens=False,
                            truncate_prompt_tokens=7)
    assert params.logit_bias == ((2, -3.0), (5, 100.0))
    assert params_from_json(params_to_json(params)) == params
    for field, value in (("logit_bias", {"x": 1}), ("logit_bias", {"1": float("nan")}),
                         ("allowed_token_ids", [-1]), ("truncate_prompt_tokens", 0)):
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(**{field: value})
        assert caught.value.param == field


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "min_p"])
def test_nan_is_named_not_a_number_not_out_of_range(client, field):
    answer = client.post("/v1/completions", content=f'{{"model": "{MODEL}", "prompt": "x", '
                         f'"{field}": NaN}}', headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and "finite number" in error["message"], error


@pytest.mark.parametrize("field", ["stop", "bad_words"])
def test_a_lone_surrogate_in_stop_or_bad_words_is_a_400(client, field):
    answer = client.post("/v1/completions", content=f'{{"model": "{MODEL}", "prompt": "x", '
                         f'"{field}": ["a\\ud800b"]}}', headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field
    assert "lone surrogate" in answer.json()["error"]["message"]


# ---- prompt logprobs and echo (lm-eval's loglikelihood) -----------------------------------------


def test_prompt_logprobs_are_each_tokens_logprob_given_the_tokens_before(engine):
    """Each entry j is log p(prompt[j] | prompt[:j]): checked against a one-token generation
    forced onto prompt[j] by allowed_token_ids (its raw logprob is read before the mask).
    Yardstick (same run): the same entries computed in 8-token chunks and in one chunk differ
    only by fp32 rounding across batch shapes; the check allows 10x that, and at least 64 fp32
    ulps of the value."""
    prompt = engine.processor.encode(PROMPT * 2)
    assert len(prompt) > 16
    chunked = prompt_logprobs_of(prompt, 3, max_num_batched_tokens=8)
    whole = prompt_logprobs_of(prompt, 3, max_num_batched_tokens=128)
    assert chunked[0] is None and whole[0] is None and len(chunked) == len(prompt)
    assert [e.token_id for e in chunked[1:]] == prompt[1:]
    noise = max(abs(a.logprob - b.logprob) for a, b in zip(chunked[1:], whole[1:], strict=True))
    core = tiny_engine(max_num_batched_tokens=128, enable_prefix_caching=False)
    try:
        for j in (1, 5, len(prompt) - 1):
            core.add_request(f"f{j}", prompt[:j], SamplingParams(
                temperature=0, max_tokens=1, logprobs=0, allowed_token_ids=[prompt[j]]))
            out = [o for o in _drain(core) if o.request_id == f"f{j}"][-1]
            forced = out.logprobs[0]
            assert forced.token_id == prompt[j]
            bound = max(10 * noise, 64 * 2.0 ** -23 * abs(forced.logprob))
            assert abs(chunked[j].logprob - forced.logprob) <= bound, (j, noise)
            assert 1 <= chunked[j].rank and len(chunked[j].top_ids) == 3
    finally:
        core.close()


def _drain(core):
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    return outputs


def test_echo_with_logprobs_answers_as_lm_eval_reads_it(client, engine):
    """lm-eval's loglikelihood request: prompt = context + continuation, echo, logprobs=1,
    max_tokens=1, temperature 0; it sums token_logprobs over the continuation and checks each
    continuation token is the top one."""
    context, continuation = "The sky is", " blue today"
    body = {"model": MODEL, "prompt": context + continuation, "echo": True, "logprobs": 1,
            "max_tokens": 1, "temperature": 0}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    ids = engine.processor.encode(context + continuation, add_special_tokens=True)
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(context + continuation)
    assert len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in logprobs["token_logprobs"][1:])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])  # k=1 plus the token
    assert logprobs["text_offset"][0] == 0
    entries = prompt_logprobs_of(ids, 1, max_num_batched_tokens=64)
    for served, entry in zip(logprobs["token_logprobs"][1:len(ids)], entries[1:], strict=True):
        assert served == pytest.approx(entry.logprob, abs=1e-4)
    streamed = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line.removeprefix("data: ")))
    first = streamed[0]["choices"][0]
    assert first["text"].startswith(context + continuation)
    assert first["logprobs"]["token_logprobs"][0] is None


def test_prompt_logprobs_field_in_vllm_shape_and_no_prefix_reuse(client, engine):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    first = client.post("/v1/completions", json=body).json()
    again = client.post("/v1/completions", json=body).json()
    entries = first["choices"][0]["prompt_logprobs"]
    ids = engine.processor.encode(PROMPT, add_special_tokens=True)
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert 2 <= len(entry) <= 3
    assert again["choices"][0]["prompt_logprobs"] == entries
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    plain = client.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its blocks were kept
    chat = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(
        len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_model_is_optional_and_stream_options_are_checked(client):
    no_model = {k: v for k, v in BASE.items() if k != "model"}
    assert client.post("/v1/completions", json=no_model).status_code == 200
    assert client.post("/v1/completions", json={**BASE, "model": "other"}).status_code == 404
    for options, param in (({"include_usage": True}, "stream_options"),
                           ({"include_usage": True, "extra": 1}, "stream_options.extra"),
                           ({"continuous_usage_stats": True},
                            "stream_options.continuous_usage_stats")):
        body = {**BASE, "stream_options": options, "stream": param != "stream_options"}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 400, (options, answer.text)
        assert answer.json()["error"]["param"] == param, answer.json()


def test_several_token_id_prompts_in_one_request(client, engine):
    """lm-eval's tokenized requests: prompt = [[ids], [ids]] (vLLM takes it too)."""
    first, second = engine.processor.encode("One two"), engine.processor.encode("Three four five")
    answer = client.post("/v1/completions", json={**BASE, "prompt": [first, second],
                                                   "max_tokens": 2, "echo": True})
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert choices[0]["text"].startswith("One two"), choices
    assert choices[1]["text"].startswith("Three four five"), choices
    assert answer.json()["usage"]["prompt_tokens"] == len(first) + len(second)
    bad = client.post("/v1/completions", json={**BASE, "prompt": [[1, 2], []]})
    assert bad.status_code == 400


def _stream_chunks(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        return [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines()
                if line.startswith("data: {")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_usage_in_every_chunk(client, path):
    """vLLM's: each chunk has its choice's prompt tokens and the tokens it generated so far;
    the last usage chunk (include_usage) still sums the request."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if path == "/v1/completions":  # two prompts of different lengths, two choices each
        body = {**BASE, "prompt": [PROMPT, "Hi"], "n": 2, "max_tokens": 5}
    else:
        body = {**{k: v for k, v in BASE.items() if k != "prompt"}, "n": 2, "max_tokens": 5,
                "messages": [{"role": "user", "content": PROMPT}]}
    whole = client.post(path, json=body).json()
    chunks = _stream_chunks(client, path, {**body, "stream": True, "stream_options": options})
    *running, last = chunks
    assert last["choices"] == []
    counted = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached ones vary
    assert [last["usage"][k] for k in counted] == [whole["usage"][k] for k in counted]
    prompt_tokens = [len(client.post("/tokenize", json={"prompt": text}).json()["tokens"])
                     for text in body["prompt"]] if "prompt" in body else \
        [whole["usage"]["prompt_tokens"]]
    counts: dict[int, int] = {}
    for chunk in running:
        (choice,) = chunk["choices"]
        index, usage = choice["index"], chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens[index // 2 if "prompt" in body else 0]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= counts.get(index, 0)  # tokens so far, never fewer
        counts[index] = usage["completion_tokens"]
    assert counts == {i: 5 for i in range(len(prompt_tokens) * 2)}  # each choice's last: all 5
    assert sum(counts.values()) == whole["usage"]["completion_tokens"]
    if path == "/v1/chat/completions":  # the role chunks come before any token
        assert [c["usage"]["completion_tokens"] for c in running[:2]] == [0, 0]


def test_continuous_usage_stats_without_include_usage_is_400(client):
    body = {**BASE, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "stream_options.continuous_usage_stats"
    assert "include_usage" in error["message"]
    on = {**BASE, "stream": True, "include_usage": True,  # the top-level spelling counts too
          "stream_options": {"continuous_usage_stats": True}}
    assert all("usage" in chunk for chunk in _stream_chunks(client, "/v1/completions", on))
