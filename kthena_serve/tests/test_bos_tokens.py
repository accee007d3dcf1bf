"""A tokenizer that adds a BOS: ``/tokenize``, the engine and the KV events agree on its ids.

vLLM's rule: completions and ``/tokenize`` add the tokenizer's special tokens to a text prompt
by default, chat lets its template write them. A router that tokenises with ``/tokenize``'s
defaults (kthena-router's kvcache-aware plugin) then hashes exactly the chunks this server
caches and publishes. The default checkpoint (SmolLM2) adds no BOS, so its tokenizer is rebuilt
here from its own files in the two ways checkpoints ask for one: ``add_bos_token`` in
``tokenizer_config.json`` (Llama 2) and a ``TemplateProcessing`` post-processor in
``tokenizer.json`` (Llama 3). The KV events go through the real publisher into a real
``redis-server`` (test_kv_events_redis's), read back as the router reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import redis
from _tiny import tiny_llama
from test_kv_events_redis import RedisServer
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from kthena_serve.async_engine import AsyncLLM
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.kv_events import KVEventsConfig, RedisKVPublisher, prompt_chunk_hashes, redis_key
from kthena_serve.model import Tokenizer, resolve_checkpoint
from kthena_serve.server import BackgroundServer, build_app

MODEL = "tiny-bos"
POD = "bos-0.default"
BOS = "<|endoftext|>"  # id 0 in SmolLM2's vocabulary
CHUNK = 16  # the router's chunk size (tokens)
BLOCK = 4  # the engine's block size
PROMPT = ("In a quiet village by the sea, the fishermen rose before dawn to mend their nets "
          "and read the sky for the weather of the day. Their children ran along the harbour "
          "wall, counting the boats that came home with the tide.")  # 3 router chunks and more


def bos_tokenizer(how: str) -> Tokenizer:
    """The default checkpoint's tokenizer, made to add ``BOS`` to a text with special tokens."""
    folder = Path(resolve_checkpoint("default"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    if how == "add_bos_token":
        config = {**config, "bos_token": BOS, "add_bos_token": True}
    else:
        bos_id = backend.token_to_id(BOS)
        backend.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                          special_tokens=[(BOS, bos_id)])])
    eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    template = config.get("chat_template")
    return Tokenizer(backend, config, [] if eos is None else [eos], template)


@pytest.fixture(scope="module", params=["add_bos_token", "post_processor"])
def served(request, tmp_path_factory):
    """(HTTP client, Redis client, tokenizer): an engine on the BOS tokenizer publishing its KV
    events to a redis-server of its own."""
    tokenizer = bos_tokenizer(request.param)
    assert tokenizer.encode("hi", add_special_tokens=True)[0] == tokenizer.token_to_id(BOS)
    config = EngineConfig(dtype="float32", num_kv_blocks=256, block_size=BLOCK,
                          max_num_batched_tokens=64, max_num_seqs=8, check_invariants=True,
                          num_threads=1)
    engine = AsyncLLM(LLMEngine.from_config(config, model=tiny_llama(), tokenizer=tokenizer))
    engine.start()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    store = redis.Redis(port=server.port, socket_timeout=5)
    publisher = RedisKVPublisher(KVEventsConfig(server.url, POD, MODEL, chunk_size=CHUNK),
                                 engine.kv_cache).start()
    try:
        with BackgroundServer(build_app(engine, model_name=MODEL)) as app, \
                httpx.Client(base_url=app.url, timeout=60) as http:
            yield http, store, publisher, tokenizer
    finally:
        publisher.close()
        store.close()
        server.stop()
        engine.shutdown()


def owned_keys(store: redis.Redis) -> set[str]:
    return {key.decode() for key in store.scan_iter("matrix:kv:block:*")
            if store.hget(key, POD) is not None}


def router_keys(ids: list[int], num_cached: int) -> set[str]:
    """The keys a router looks up for ``ids`` whose chunks lie in the first ``num_cached``."""
    hashes = prompt_chunk_hashes(ids, CHUNK)[: num_cached // CHUNK]
    return {redis_key(MODEL, h) for h in hashes}


def test_completion_tokenize_and_kv_events_agree(served):
    http, store, publisher, tokenizer = served
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert tokens[0] == tokenizer.token_to_id(BOS) and tokens[1] != tokens[0]
    assert tokens == tokenizer.encode(PROMPT, add_special_tokens=True)
    answer = http.post("/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True,
        "logprobs": 0, "return_tokens_as_token_ids": True}).json()
    num_prompt = answer["usage"]["prompt_tokens"]
    ran = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
    assert ran[:num_prompt] == tokens  # the ids the engine ran are /tokenize's, BOS first

    assert publisher.wait_synced()
    cached = num_prompt // BLOCK * BLOCK  # the prompt's full blocks (the output token is not)
    expected = router_keys(tokens, cached)
    assert len(expected) == len(tokens) // CHUNK >= 2
    assert expected <= owned_keys(store)  # every chunk the router asks for is published
    shifted = router_keys(tokenizer.encode(PROMPT), cached)  # no BOS: off by one token
    assert not shifted & owned_keys(store)

    plain = http.post("/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "add_special_tokens": False}).json()
    assert plain["usage"]["prompt_tokens"] == num_prompt - 1  # vLLM's switch: no BOS


def test_chat_tokenize_and_kv_events_agree(served):
    http, store, publisher, tokenizer = served
    messages = [{"role": "user", "content": PROMPT}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens[0] != tokenizer.token_to_id(BOS)  # the template writes the special tokens
    answer = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0}).json()
    entries = answer["prompt_logprobs"]  # None, then {the prompt token's id: ...} each
    assert answer["usage"]["prompt_tokens"] == len(tokens) == len(entries)
    assert [int(next(iter(e))) for e in entries[1:]] == tokens[1:]
    assert publisher.wait_synced()
    assert router_keys(tokens, len(tokens) // BLOCK * BLOCK) <= owned_keys(store)
