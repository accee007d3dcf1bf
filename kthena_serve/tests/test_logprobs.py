"""Logprobs on the default model, checked against transformers, and fields the server refuses.

Both sides run SmolLM2-135M-Instruct in float32 from the same GGUF file. Our tokens come from
an offline engine over the served weights (greedy, so the server must produce the same ones);
transformers runs one forward over prompt + those tokens, and its log-softmax at each position
must match what the server reports: the sampled token's logprob and the top-k (within 1e-3).
The PD test does the same through a prefill worker (the first token) and a decode worker.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from _support import metric_value

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kthena_serve.pd.config import PDConfig
from kthena_serve.server import BackgroundServer, build_app

transformers = pytest.importorskip("transformers")
kthena_known = pytest.importorskip("kthena_core.known_models")

pytestmark = pytest.mark.slow

MODEL = "default"
TOL = 1e-3
ENGINE = {"kv_cache_memory": "64MiB", "num_threads": 1, "dtype": "float32"}
PROMPT = "The three primary colours are"
CHAT = [{"role": "user", "content": "请用中文介绍一下你自己。"}]  # answered with split characters


@pytest.fixture(scope="module")
def loaded():
    from kthena_serve.model import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model("default", dtype=torch.float32)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf(hf_gguf_model):
    return hf_gguf_model


@pytest.fixture(scope="module")
def offline(loaded):
    engine = LLMEngine.from_config(EngineConfig(**ENGINE), model=loaded[0], tokenizer=loaded[1])
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(loaded):
    engine = AsyncLLM(LLMEngine.from_config(EngineConfig(**ENGINE), model=loaded[0],
                                            tokenizer=loaded[1])).start()
    with BackgroundServer(build_app(engine, model_name=MODEL)) as server:
        yield server.url
    engine.shutdown()


def generate(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams):
    engine.add_request(f"ref-{len(engine.live_request_ids())}", prompt_ids, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    return final


def reference(hf, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """transformers' fp32 log-softmax of the next-token logits at each output position."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt_ids + output_ids[:-1]])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 :], dim=-1)


def token_text(tokenizer, token_id: int) -> str:  # noqa: ANN001
    raw = tokenizer.token_bytes([token_id])[0]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def check_top(reported: list[tuple[int, float]], expected: torch.Tensor, k: int) -> None:
    """Our top-k: k entries, each id's value is transformers' for that id, ranks agree."""
    assert len(reported) == k
    values, _ = expected.topk(k)
    for rank, (token_id, logprob) in enumerate(reported):
        assert abs(logprob - expected[token_id].item()) < TOL, (rank, token_id)
        assert abs(logprob - values[rank].item()) < TOL, rank  # the k largest, in order


def check_chat_entry(tokenizer, entry: dict, token_id: int, row: torch.Tensor, k: int) -> None:  # noqa: ANN001
    """A chat ``content`` entry against transformers' log-softmax ``row`` at its position."""
    assert entry["token"] == token_text(tokenizer, token_id)
    assert entry["bytes"] == list(tokenizer.token_bytes([token_id])[0])
    assert abs(entry["logprob"] - row[token_id].item()) < TOL
    top_ids = row.topk(k).indices.tolist()
    assert [t["token"] for t in entry["top_logprobs"]] == [token_text(tokenizer, i)
                                                           for i in top_ids]
    check_top([(i, t["logprob"]) for i, t in zip(top_ids, entry["top_logprobs"], strict=True)],
              row, k)


def greedy(k: int, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k)


# ---- the engine -----------------------------------------------------------------------------
def test_engine_logprobs_are_raw_whatever_the_sampling(loaded, hf, offline) -> None:  # noqa: ANN001
    """Temperature, top-p and penalties change which token is drawn, never the reported values;
    the drawn token's logprob is there even when it is outside the top k."""
    ids = loaded[1].encode(PROMPT)
    params = SamplingParams(temperature=1.6, top_p=0.95, presence_penalty=1.0, seed=11,
                            max_tokens=16, logprobs=1, ignore_eos=True)
    offline.add_request("asked", ids, params)
    offline.add_request("not-asked", ids, SamplingParams(temperature=0, max_tokens=16))
    finals = {}
    while offline.has_unfinished_requests():
        finals.update({o.request_id: o for o in offline.step() if o.finished})
    assert finals["not-asked"].logprobs is None
    out = finals["asked"]
    expected = reference(hf, ids, list(out.token_ids))
    assert [e.token_id for e in out.logprobs] == list(out.token_ids)
    outside = 0
    for position, entry in enumerate(out.logprobs):
        assert abs(entry.logprob - expected[position, entry.token_id].item()) < TOL, position
        check_top(list(zip(entry.top_ids, entry.top_logprobs, strict=True)), expected[position], 1)
        outside += entry.token_id not in entry.top_ids
    assert outside, "temperature 1.6 should draw some token outside the top 1"


# ---- through HTTP: completions and chat, whole and streamed ------------------------------------
def test_completion_logprobs_match_transformers(url, loaded, hf, offline) -> None:  # noqa: ANN001
    tokenizer = loaded[1]
    ids = tokenizer.encode(PROMPT)
    output = list(generate(offline, ids, greedy(5)).token_ids)
    expected = reference(hf, ids, output)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 5}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [token_text(tokenizer, t) for t in output]
    assert choice["text"].startswith("".join(logprobs["tokens"][:3]))
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for position, token_id in enumerate(output):
        row = expected[position]
        assert abs(logprobs["token_logprobs"][position] - row[token_id].item()) < TOL
        top = logprobs["top_logprobs"][position]
        by_text = {token_text(tokenizer, i): row[i].item() for i in row.topk(5).indices.tolist()}
        assert len(top) == 5 and set(top) == set(by_text), position  # greedy: sampled is top 1
        assert all(abs(top[t] - by_text[t]) < TOL for t in top)
    streamed = _stream(url, "/v1/completions", {**body, "stream": True})
    chunks = [c["choices"][0] for c in streamed if c["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    merged = {key: [v for c in chunks for v in c["logprobs"][key]] for key in logprobs}
    assert merged["tokens"] == logprobs["tokens"] and merged["text_offset"] == offsets
    _close(merged["token_logprobs"], logprobs["token_logprobs"])


def test_chat_logprobs_match_transformers(url, loaded, hf, offline) -> None:  # noqa: ANN001
    tokenizer = loaded[1]
    ids = tokenizer.encode_chat(CHAT)
    output = list(generate(offline, ids, greedy(3, 12)).token_ids)
    expected = reference(hf, ids, output)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [token_text(tokenizer, t) for t in output]
    assert any(e["token"].startswith("bytes:") for e in content)  # half a character
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace").startswith(
        reply.json()["choices"][0]["message"]["content"][:4])
    for position, (entry, token_id) in enumerate(zip(content, output, strict=True)):
        check_chat_entry(tokenizer, entry, token_id, expected[position], 3)
    streamed = _stream(url, "/v1/chat/completions", {**body, "stream": True})
    assert streamed[0]["choices"][0]["logprobs"] is None  # the role chunk
    pieces = [e for c in streamed[1:] if c["choices"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in pieces] == [e["token"] for e in content]
    _close([e["logprob"] for e in pieces], [e["logprob"] for e in content])


def test_no_logprobs_unless_asked(url) -> None:  # noqa: ANN001
    completion = httpx.post(f"{url}/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "logprobs": None}, timeout=60)
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": False}, timeout=60)
    assert completion.json()["choices"][0]["logprobs"] is None
    assert chat.json()["choices"][0]["logprobs"] is None
    zero = httpx.post(f"{url}/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "logprobs": 0}, timeout=60).json()
    assert [len(t) for t in zero["choices"][0]["logprobs"]["top_logprobs"]] == [1, 1]


# ---- refused with a 400 that names the field ----------------------------------------------------
_C, _CHAT = "/v1/completions", "/v1/chat/completions"
REFUSED = [
    (_C, {"logprobs": MAX_LOGPROBS + 1}, "logprobs", ["logprobs=21", "[0, 20]"]),
    (_C, {"logprobs": -1}, "logprobs", ["logprobs=-1", "[0, 20]"]),
    (_CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", ["top_logprobs=21", "[0, 20]"]),
    (_CHAT, {"top_logprobs": 2}, "top_logprobs", ["top_logprobs=2", "logprobs: true"]),
    (_CHAT, {"logprobs": 1}, "logprobs", ["valid boolean"]),
    (_CHAT, {"tools": []}, "tools", ["`tools` must not be an empty array"]),
    (_CHAT, {"tool_choice": "auto"}, "tool_choice", ["`tools` must be set"]),
    (_CHAT, {"functions": [{"name": "f"}]}, "functions", ["functions"]),
    (_CHAT, {"function_call": {"name": "f"}}, "function_call", ["function_call"]),
    (_CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", ["json_schema.schema"]),
    (_CHAT, {"logit_bias": {"4200000": -100}}, "logit_bias", ["logit_bias token id 4200000"]),
    (_CHAT, {"priority": 2}, "priority", ["priority=2", "first-come first-served"]),
    (_C, {"suffix": "end"}, "suffix", ["suffix='end'"]),
    (_C, {"best_of": 3}, "best_of", ["best_of=3"]),
    (_C, {"store": True}, "store", ["unrecognized request argument supplied: store"]),
    (_CHAT, {"guided_json": {"type": "object"}}, "guided_json", ["structured_outputs"]),
]


@pytest.mark.parametrize(("route", "fields", "param", "words"), REFUSED,
                         ids=[f"{i}-{r[2]}" for i, r in enumerate(REFUSED)])
def test_unsupported_and_out_of_range_fields_get_a_400(url, route, fields, param, words) -> None:  # noqa: ANN001
    reply = httpx.post(f"{url}{route}", json={**_base(route), **fields}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]


@pytest.mark.parametrize(("route", "fields"), [
    (_CHAT, {"tools": None, "tool_choice": "none", "functions": None, "function_call": "none",
             "response_format": {"type": "text"}, "logit_bias": {}, "user": "u-1"}),
    (_C, {"echo": False, "suffix": None, "best_of": 1, "logit_bias": None}),
])
def test_neutral_values_of_unimplemented_fields_are_accepted(url, route, fields) -> None:  # noqa: ANN001
    reply = httpx.post(f"{url}{route}", json={**_base(route), **fields}, timeout=60)
    assert reply.status_code == 200, reply.text


# ---- PD: the first token's logprobs come from the prefill worker -------------------------------
def test_pd_logprobs_match_transformers(loaded, hf, offline) -> None:  # noqa: ANN001
    from kthena_serve.pd.embedded import PDCluster

    tokenizer = loaded[1]
    ids = tokenizer.encode(PROMPT + " red, yellow and blue." * 4)  # over the threshold
    chat_ids = tokenizer.encode_chat(CHAT)
    output = list(generate(offline, ids, greedy(2, 6)).token_ids)
    chat_output = list(generate(offline, chat_ids, greedy(2, 4)).token_ids)
    pd = {"pd_threshold_tokens": 8, "transfer_timeout_s": 60, "health_interval_s": 0.2}
    engine = {"num_kv_blocks": 64, "max_num_seqs": 4, "dtype": "float32"}
    with PDCluster(EngineConfig(**engine), PDConfig(**pd), tokenizer=tokenizer) as cluster:
        reply = cluster.complete(ids, max_tokens=6, logprobs=2)
        assert reply.status_code == 200, reply.text
        stream = _stream(cluster.url, "/v1/chat/completions", {
            **_base(_CHAT), "max_tokens": 4, "temperature": 0, "stream": True, "logprobs": True,
            "top_logprobs": 2})
        handed_off = cluster.worker_metrics("decode-0")
    assert metric_value(handed_off, "kthena_pd_requests_total", path="disaggregated") == 2
    logprobs = reply.json()["choices"][0]["logprobs"]
    expected = reference(hf, ids, output)
    assert logprobs["tokens"] == [token_text(tokenizer, t) for t in output]
    for position, token_id in enumerate(output):  # position 0: sampled on the prefill worker
        row = expected[position]
        assert abs(logprobs["token_logprobs"][position] - row[token_id].item()) < TOL
        by_text = {token_text(tokenizer, i): row[i].item() for i in row.topk(2).indices.tolist()}
        top = logprobs["top_logprobs"][position]
        assert set(top) == set(by_text) and all(abs(top[t] - by_text[t]) < TOL for t in top)
    content = [e for c in stream[1:] if c["choices"]
               for e in c["choices"][0]["logprobs"]["content"]]
    expected = reference(hf, chat_ids, chat_output)
    assert [e["token"] for e in content] == [token_text(tokenizer, t) for t in chat_output]
    for position, (entry, token_id) in enumerate(zip(content, chat_output, strict=True)):
        check_chat_entry(tokenizer, entry, token_id, expected[position], 2)


# ---- helpers ------------------------------------------------------------------------------------
def _base(route: str) -> dict:
    if route == _C:
        return {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2}


def _stream(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=120) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert reply.status_code == 200 and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and all(abs(a - b) < TOL for a, b in zip(got, want, strict=True))


def test_gather_reads_only_what_a_sample_row_offers() -> None:
    """A plain value row (what a PD prefill worker samples with) works, penalties included:
    logprobs are the raw log-softmax, whatever the sampler did to pick the token."""
    import attrs

    from kthena_serve.engine.logprobs import gather_logprobs
    from kthena_serve.engine.sampler import Sampler

    @attrs.frozen
    class Row:
        request_id: str
        params: SamplingParams
        output_token_ids: tuple[int, ...] = ()

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [Row("a", SamplingParams(temperature=0, presence_penalty=2.0, logprobs=4), (7, 7)),
            Row("b", SamplingParams(temperature=0)),
            Row("c", SamplingParams(temperature=0.7, seed=1, logprobs=0))]
    tokens = Sampler()(logits, rows)
    entries = gather_logprobs(logits, rows, tokens)
    expected = torch.log_softmax(logits, dim=-1)
    assert entries[1] is None and entries[2].top_ids == ()
    for row in (0, 2):
        assert entries[row].token_id == tokens[row]
        assert entries[row].logprob == pytest.approx(expected[row, tokens[row]].item(), abs=1e-6)
    values, ids = expected[0].topk(4)
    assert list(entries[0].top_ids) == ids.tolist()
    assert entries[0].top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
