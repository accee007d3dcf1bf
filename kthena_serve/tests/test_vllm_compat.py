"""vLLM compatibility of the server: the ``vllm:*`` metrics the Kthena router scrapes, and
``/tokenize`` / ``/detokenize``, colocated and behind the PD router.

Metrics are parsed with prometheus_client's parser and checked against the ``kthena_*`` twins
of the same scrape (one source, two names). Tokenisation is checked against Hugging Face
``transformers`` on the same checkpoint: the path vLLM itself takes.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from _tiny import default_tokenizer, tiny_engine, tiny_llama
from prometheus_client.parser import text_string_to_metric_families

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.model import Tokenizer, resolve_checkpoint
from kthena_serve.pd.config import PDConfig
from kthena_serve.server import BackgroundServer, build_app
from kthena_serve.server.vllm_metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

MODEL = "tiny"
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
TEXT = "Paged attention keeps the KV cache in blocks. Ünïcode too: 日本語"

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:generation_tokens",
            "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:request_success")
HISTOGRAMS = {"vllm:time_to_first_token_seconds": TTFT_BUCKETS,
              "vllm:inter_token_latency_seconds": ITL_BUCKETS,
              "vllm:e2e_request_latency_seconds": E2E_BUCKETS}
TWINS = {  # vLLM name -> our name, same value by construction
    "vllm:num_requests_running": "kthena_num_requests_running",
    "vllm:num_requests_waiting": "kthena_num_requests_waiting",
    "vllm:prefix_cache_queries_total": "kthena_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "kthena_prefix_cache_hits_total",
    "vllm:generation_tokens_total": "kthena_generation_tokens_total",
    "vllm:num_preemptions_total": "kthena_preemptions_total",
    "vllm:time_to_first_token_seconds_count": "kthena_time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum": "kthena_time_to_first_token_seconds_sum",
    "vllm:e2e_request_latency_seconds_count": "kthena_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "kthena_request_latency_seconds_sum",
}


@pytest.fixture(scope="module")
def engine():
    async_engine = AsyncLLM(tiny_engine(num_kv_blocks=1024, max_num_batched_tokens=256,
                                        max_num_seqs=8, max_n=4)).start()
    yield async_engine
    async_engine.shutdown()


@pytest.fixture
def client(engine):
    """A fresh app (fresh histograms) with an API key, over the module's engine."""
    with BackgroundServer(build_app(engine, model_name=MODEL, api_key=KEY)) as server, \
            httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(resolve_checkpoint("default")))


def scrape(text: str) -> tuple[dict, dict[tuple, float]]:
    """(families by name, {(sample name, sorted labels): value}) of a /metrics answer."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    return families, samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _wait_idle(engine, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while engine.stats().kv.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.02)


# ---- metrics --------------------------------------------------------------------------------
def test_vllm_names_types_labels_and_buckets(client):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 6, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    families, samples = scrape(client.get("/metrics").text)
    for name in GAUGES:
        assert families[name].type == "gauge", name
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name, buckets in HISTOGRAMS.items():
        assert families[name].type == "histogram", name
        bounds = [float(s.labels["le"]) for s in families[name].samples
                  if s.name == f"{name}_bucket"]
        assert bounds == [*buckets, float("inf")], name
    for name in (*GAUGES, *COUNTERS, *HISTOGRAMS):
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL, sample
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}  # all present from the start, as in vLLM
    assert 0.0 <= value(samples, "vllm:kv_cache_usage_perc", model_name=MODEL) <= 1.0
    assert value(samples, "vllm:prompt_tokens_total", model_name=MODEL) == 2  # "Hello there"


def test_vllm_values_are_the_kthena_values(client, engine):
    runs = [({"prompt": "Count: one two three", "max_tokens": 7, "n": 2}, "/v1/completions"),
            ({"prompt": "Stream me", "max_tokens": 5, "stream": True}, "/v1/completions"),
            ({"messages": CHAT, "max_tokens": 4}, "/v1/chat/completions")]
    gaps = prompt_tokens = 0
    for extra, route in runs:
        body = {"model": MODEL, "temperature": 0, "ignore_eos": True, **extra,
                "stream_options": {"include_usage": True} if extra.get("stream") else None}
        answer = client.post(route, json=body)
        assert answer.status_code == 200, answer.text
        usage = (answer.json() if not extra.get("stream") else
                 [e for e in _events(answer) if e.get("usage")][-1])["usage"]
        choices = extra.get("n", 1)
        gaps += usage["completion_tokens"] - choices  # every choice ran to max_tokens
        prompt_tokens += usage["prompt_tokens"] * choices
    # one request in flight while /metrics is scraped from another thread: its stream is read
    # all along (a stream left unread is paused by backpressure, and a paused request is not
    # running), and it asks for the whole 4,096-token context so it outlasts the scrape
    with client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "Hold on", "ignore_eos": True, "stream": True,
            "max_tokens": engine.processor.limits.max_model_len - 16}) as held, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        lines = held.iter_lines()
        next(lines)
        scraped = pool.submit(lambda: scrape(client.get("/metrics").text))
        for _ in lines:
            if scraped.done():
                break
        _, samples = scraped.result(timeout=60)
    _wait_idle(engine)
    label = {"model_name": MODEL}
    for vllm_name, our_name in TWINS.items():
        assert value(samples, vllm_name, **label) == value(samples, our_name), vllm_name
    assert value(samples, "vllm:num_requests_running", **label) >= 1
    used = value(samples, "kthena_kv_blocks_used")
    assert used > 0
    assert value(samples, "vllm:kv_cache_usage_perc", **label) == (
        used / engine.processor.limits.num_kv_blocks)
    for reason in ("stop", "length", "abort"):
        ours = samples.get(("kthena_requests_total", (("finish_reason", reason),)), 0.0)
        assert value(samples, "vllm:request_success_total", finished_reason=reason,
                     **label) == ours
    assert value(samples, "vllm:request_success_total", finished_reason="length", **label) == 4
    assert value(samples, "vllm:prompt_tokens_total", **label) == prompt_tokens
    # Inter-token latency: each request's gaps, first token to last.
    assert value(samples, "vllm:inter_token_latency_seconds_count", **label) == gaps
    decode_sum = (value(samples, "kthena_request_latency_seconds_sum")
                  - value(samples, "kthena_time_to_first_token_seconds_sum"))
    assert value(samples, "vllm:inter_token_latency_seconds_sum", **label) == pytest.approx(
        decode_sum, abs=1e-9)


def test_aborted_request_counts_under_both_names(client, engine):
    with client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "Leave early", "max_tokens": 500, "ignore_eos": True,
            "stream": True}) as held:
        next(held.iter_lines())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, samples = scrape(client.get("/metrics").text)
        if samples.get(("kthena_requests_total", (("finish_reason", "abort"),))):
            break
        time.sleep(0.05)
    assert value(samples, "vllm:request_success_total", finished_reason="abort",
                 model_name=MODEL) == 1 == value(samples, "kthena_requests_total",
                                                 finish_reason="abort")
    _wait_idle(engine)


def test_without_a_model_name_only_kthena_names(engine):
    from kthena_serve.server.metrics import ServerMetrics

    text = ServerMetrics(engine).render().decode()
    assert "kthena_num_requests_running" in text and "vllm:" not in text


# ---- /tokenize, /detokenize -----------------------------------------------------------------
def test_tokenize_prompt_matches_hugging_face(client, engine, hf_tokenizer):
    for special in (True, False, None):
        body = {"model": MODEL, "prompt": TEXT, "return_token_strs": True}
        if special is not None:
            body["add_special_tokens"] = special
        answer = client.post("/tokenize", json=body)
        assert answer.status_code == 200, answer.text
        expected = hf_tokenizer(TEXT, add_special_tokens=special is not False).input_ids
        assert answer.json() == {
            "count": len(expected), "max_model_len": engine.processor.limits.max_model_len,
            "tokens": expected, "token_strs": hf_tokenizer.convert_ids_to_tokens(expected)}
    plain = client.post("/tokenize", json={"prompt": TEXT}).json()  # model is optional
    assert plain["token_strs"] is None and plain["tokens"] == expected


def test_tokenize_chat_matches_hugging_face(client, hf_tokenizer):
    for generation_prompt in (True, False):
        answer = client.post("/tokenize", json={
            "model": MODEL, "messages": CHAT, "add_generation_prompt": generation_prompt})
        assert answer.status_code == 200, answer.text
        text = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=generation_prompt,
                                                tokenize=False)
        expected = hf_tokenizer(text, add_special_tokens=False).input_ids
        assert answer.json()["tokens"] == expected
        assert client.post("/detokenize", json={"tokens": expected}).json() == {"prompt": text}


def test_tokens_are_what_a_completion_runs_on(client):
    ids = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    answer = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                       "max_tokens": 1})
    assert answer.json()["usage"]["prompt_tokens"] == len(ids)


def test_detokenize_round_trip(client):
    for text in (TEXT, "", " leading space", "<|im_start|>user\nraw"):
        ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {
            "prompt": text}


@pytest.fixture(scope="module")
def bos_client():
    """A server whose checkpoint asks for a BOS: add_special_tokens changes the answer."""
    base = default_tokenizer()
    tokenizer = Tokenizer(base._backend, {"add_bos_token": True, "bos_token": "<|endoftext|>",
                                          "eos_token": "<|im_end|>"},
                          chat_template=base.chat_template)
    config = EngineConfig(dtype="float32", num_kv_blocks=64, block_size=4, num_threads=1)
    core = LLMEngine.from_config(config, model=tiny_llama(), tokenizer=tokenizer)
    async_engine = AsyncLLM(core).start()
    with BackgroundServer(build_app(async_engine, model_name=MODEL)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        yield http, tokenizer
    async_engine.shutdown()


def test_add_special_tokens_defaults_follow_vllm(bos_client):
    http, tokenizer = bos_client
    bos, plain = tokenizer.bos_token_id, tokenizer.encode(TEXT)

    def tokens(**body) -> list[int]:
        answer = http.post("/tokenize", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["tokens"]

    assert tokens(prompt=TEXT) == [bos, *plain]  # default true for a prompt
    assert tokens(prompt=TEXT, add_special_tokens=False) == plain
    chat = tokenizer.encode_chat(CHAT)
    assert chat[0] != bos
    assert tokens(messages=CHAT) == chat  # default false for messages
    assert tokens(messages=CHAT, add_special_tokens=True) == [bos, *chat]
    assert http.post("/detokenize", json={"tokens": [bos, *plain]}).json() == {
        "prompt": "<|endoftext|>" + TEXT}  # special tokens are kept, as vLLM does


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"prompt": "x", "lora": "y"}, 400, "lora"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a\ud800b"}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400,
     "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": 10**9}, 400,
     "min_tokens"),
])
def test_bad_bodies_get_openai_errors(client, route, body, status, param):
    import json

    answer = client.post(route, content=json.dumps(body),
                         headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_vllm_bench_serve_payload_is_served(client):
    """What `vllm bench serve` sends on every request (its neutral repetition_penalty 1.0
    included), streamed with usage; a real repetition_penalty and min_p are honoured too."""
    body = {"model": MODEL, "prompt": "Hello there, how are", "temperature": 0.0,
            "repetition_penalty": 1.0, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": None}
    with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [6]
    answer = client.post("/v1/completions", json={**body, "stream": False, "stream_options": None,
                                                   "repetition_penalty": 1.5, "min_p": 0.1})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
    exact = client.post("/v1/completions", json={**body, "stream": False, "stream_options": None,
                                                  "ignore_eos": False, "min_tokens": 6})
    assert exact.json()["usage"]["completion_tokens"] == 6  # no EOS before min_tokens
    assert exact.json()["choices"][0]["finish_reason"] == "length"


def test_tokenize_needs_the_api_key(client):
    for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(f"{client.base_url}{route}", json=body).status_code == 401
        assert client.post(route, json=body).status_code == 200


def test_public_metrics_open_metrics_only(engine):
    """``kthena serve --api-key K --public-metrics``: the router scrapes /metrics without the
    key (as vLLM, whose --api-key guards only /v1); every other route keeps the key."""
    from kthena_core.cli import build_parser
    from kthena_serve.cli import spec_from_args

    spec = spec_from_args(build_parser().parse_args(["serve", "--api-key", KEY,
                                                     "--public-metrics"]))
    assert (spec.api_key, spec.public_metrics) == (KEY, True)
    assert spec_from_args(build_parser().parse_args(["serve"])).public_metrics is False  # keyed
    app = build_app(engine, model_name=MODEL, api_key=KEY, public_metrics=spec.public_metrics)
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "ignore_eos": True}
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/completions", json=body).status_code == 401
        assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        for method, path, payload in (("GET", "/v1/models", None),
                                      ("POST", "/tokenize", {"prompt": "x"}),
                                      ("POST", "/detokenize", {"tokens": [1]})):
            assert http.request(method, path, json=payload).status_code == 401, path
        scraped = http.get("/metrics")  # no Authorization header at all
        assert scraped.status_code == 200
        families, samples = scrape(scraped.text)
        for name in (*GAUGES, "vllm:time_to_first_token_seconds",
                     "vllm:inter_token_latency_seconds"):
            assert name in families, name
        assert value(samples, "vllm:request_success_total", model_name=MODEL,
                     finished_reason="length") == 1
        assert http.get("/health").status_code == 200


def test_pd_router_public_metrics_keep_the_key_on_its_other_routes(engine):
    """``kthena serve --mode pd --api-key K --public-metrics``: the router app's /metrics is
    open, /pd/workers and /v1 are not (a stand-in router: no worker processes)."""
    from types import SimpleNamespace

    from kthena_serve.pd.frontend import build_router_app
    from kthena_serve.pd.metrics import PDMetrics

    class Remote:  # the engine, with the router the app exports metrics from
        def __init__(self) -> None:
            self.router = SimpleNamespace(metrics=PDMetrics("router"), workers={})

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(engine, name)

    app = build_router_app(Remote(), model_name=MODEL, api_key=KEY, public_metrics=True)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        scraped = http.get("/metrics")
        assert scraped.status_code == 200
        families, _ = scrape(scraped.text)
        assert "vllm:num_requests_running" in families
        assert "kthena_pd_router_decisions" in families
        for path in ("/pd/workers", "/v1/models"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers=AUTH).status_code == 200, path


def test_openapi_lists_the_routes(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/tokenize", "/detokenize"} <= set(paths)


def _events(response: httpx.Response) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in response.text.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


# ---- PD router ------------------------------------------------------------------------------
def test_pd_router_serves_vllm_metrics_and_tokenize(hf_tokenizer):
    from kthena_serve.pd.embedded import PDCluster

    pd = {"pd_threshold_tokens": 24, "transfer_timeout_s": 60, "health_interval_s": 0.2}
    with PDCluster(EngineConfig(**{"num_kv_blocks": 128, "max_num_seqs": 4}), PDConfig(**pd),
                   tokenizer=default_tokenizer()) as cluster:
        url, label = cluster.url, {"model_name": cluster.model_name}
        answer = httpx.post(f"{url}/tokenize", json={"prompt": TEXT, "return_token_strs": True})
        expected = hf_tokenizer(TEXT).input_ids
        assert answer.json()["tokens"] == expected
        assert answer.json()["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
        chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()["tokens"]
        text = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert httpx.post(f"{url}/detokenize", json={"tokens": chat}).json() == {"prompt": text}
        assert httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}).status_code == 400

        long_prompt = TEXT * 4  # over the PD threshold: prefill worker, then decode worker
        assert cluster.complete(long_prompt, max_tokens=5, ignore_eos=True).status_code == 200
        time.sleep(5 * pd["health_interval_s"])  # the router's polls see the workers' counters
        _, samples = scrape(httpx.get(f"{url}/metrics").text)
        for vllm_name, our_name in TWINS.items():
            assert value(samples, vllm_name, **label) == value(samples, our_name), vllm_name
        assert value(samples, "vllm:generation_tokens_total", **label) >= 5
        assert value(samples, "vllm:time_to_first_token_seconds_count", **label) == 1
        assert value(samples, "vllm:inter_token_latency_seconds_count", **label) == 4
        blocks = value(samples, "kthena_kv_blocks_used") + value(samples, "kthena_kv_blocks_free")
        assert value(samples, "vllm:kv_cache_usage_perc", **label) == (
            value(samples, "kthena_kv_blocks_used") / blocks)
