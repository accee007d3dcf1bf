"""BOS on every path: with an ``add_bos_token`` checkpoint, ``LLM.generate``, the DP router and
the PD router encode a text prompt as the engine runs and caches it (``InputProcessor``'s
encode rule: a text gets the BOS, a chat what its template writes, each unless the request's
``add_special_tokens`` says otherwise).

The check is the one that matters to routing: the block hashes a router computes from its own
ids are the ones the engine announces in its KV events (read back through a real
``ClusterPrefixIndex``), and the BOS-less hashes are not there. test_bos_tokens.py covers the
HTTP app and ``/tokenize`` of one server. The PD deployment here also answers chats whose
messages have roles and no content, as a colocated engine does.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from _tiny import tiny_checkpoint

from kthena_serve.cluster.router import Router
from kthena_serve.dp.frontend import DPFrontend, build_dp_app
from kthena_serve.dp.launcher import ROLE, ReplicaLauncher
from kthena_serve.dp.serve import _routing_processor
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.llm import LLM
from kthena_serve.model import Tokenizer
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster
from kthena_serve.server import BackgroundServer
from mooncake_kv import ClusterPrefixIndex

BOS = "<|endoftext|>"  # id 0 in the default checkpoint's vocabulary
BLOCK = 4
PROMPT = ("In a quiet village by the sea, the fishermen rose before dawn to mend their nets "
          "and read the sky for the weather of the day.")
# the PD fuzz's two chats: roles, no content
CONTENTLESS = ([{"role": "user"}, {"role": "developer"}], [{"role": "user"}])
# "native" kernels: the same sums in this process and in the workers (see _tiny.PD_ENGINE)
ENGINE = {"dtype": "float32", "num_kv_blocks": 256, "block_size": BLOCK, "max_num_seqs": 8,
          "max_model_len": 512, "kernels": "native"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random checkpoint whose tokenizer asks for a BOS (``add_bos_token``, Llama 2)."""
    folder = tiny_checkpoint(tmp_path_factory.mktemp("bos") / "tiny")
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "bos_token": BOS, "add_bos_token": True}))
    return folder


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    assert tokenizer.encode("hi", add_special_tokens=True)[0] == tokenizer.token_to_id(BOS)
    return tokenizer


def full_blocks(ids: list[int]) -> int:
    return len(ids) // BLOCK


def assert_cached_as_routed(index: ClusterPrefixIndex, name: str, ids: list[int],
                            shifted: list[int]) -> None:
    """``name`` holds every full block of ``ids`` and none of ``shifted`` (the same text
    without its BOS: every block hash differs)."""
    assert index.match(ids)[name] == full_blocks(ids) >= 4
    assert index.match(shifted)[name] == 0


def test_llm_generate_adds_the_bos(checkpoint: Path, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    index = ClusterPrefixIndex(BLOCK)
    with LLM(str(checkpoint), num_threads=1, **ENGINE) as llm:
        subscriber = index.subscriber("llm")
        llm.engine.kv.subscribe(subscriber)
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1))[0]
        assert out.num_prompt_tokens == len(ids)
        assert_cached_as_routed(index, "llm", ids, tokenizer.encode(PROMPT))
        by_ids = llm.generate(ids[1:], SamplingParams(temperature=0, max_tokens=1))[0]
        assert by_ids.num_prompt_tokens == len(ids) - 1  # token ids run as given
        llm.engine.kv.unsubscribe(subscriber)


@pytest.fixture(scope="module")
def dp(checkpoint: Path):
    """One replica behind the DP router's app, in this process: (router, app URL)."""
    config = EngineConfig(model=str(checkpoint), **ENGINE)
    launcher = ReplicaLauncher(config, 1, "default")
    router = server = None
    try:
        launcher.start()
        router = Router(launcher.endpoints(), PDConfig(health_interval_s=60), BLOCK,
                        secret=launcher.secret, state_path="/dp/state",
                        hash_algo=config.hash_algorithm).start()
        front = DPFrontend(router, _routing_processor(config), secret=launcher.secret)
        server = BackgroundServer(build_dp_app(front)).start()
        yield router, server.url
    finally:
        if server is not None:
            server.stop()
        if router is not None:
            router.close()
        launcher.stop()


def test_dp_router_hashes_what_the_replica_caches(dp, tokenizer: Tokenizer) -> None:
    router, url = dp
    name = next(iter(router.workers))
    assert router.workers[name].role == ROLE
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "default", "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(ids)
    router.poll_all()  # the replica's KV events
    assert_cached_as_routed(router.index, name, ids, tokenizer.encode(PROMPT))
    # what the router recorded at once is what the replica confirmed: no stray entries
    assert router.index.num_blocks(name) <= full_blocks(ids) + 1

    # a chat asking for the special tokens: the router renders it as the replica does
    messages = [{"role": "user", "content": PROMPT}]
    chat = tokenizer.encode_chat(messages, add_special_tokens=True)
    assert chat[0] == tokenizer.token_to_id(BOS)
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "default", "messages": messages, "add_special_tokens": True, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    router.poll_all()
    assert_cached_as_routed(router.index, name, chat, tokenizer.encode_chat(messages))


def test_dp_router_drops_what_a_refused_request_recorded(dp, tokenizer: Tokenizer) -> None:
    router, url = dp
    name = next(iter(router.workers))
    router.poll_all()
    before = router.index.num_blocks(name)
    too_long = "one more word " * 200  # past the 512-token context: the replica's 400
    reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "default", "prompt": too_long, "max_tokens": 1})
    assert reply.status_code == 400, reply.text
    ids = tokenizer.encode(too_long, add_special_tokens=True)
    assert router.index.match(ids)[name] == 0
    assert router.index.num_blocks(name) == before


@pytest.fixture(scope="module")
def pd(checkpoint: Path):
    config = EngineConfig(model=str(checkpoint), **ENGINE)
    with PDCluster(config, PDConfig(pd_threshold_tokens=8, health_interval_s=60)) as cluster:
        yield cluster


def test_pd_router_hashes_what_the_decode_worker_caches(pd, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    reply = httpx.post(f"{pd.url}/v1/completions", timeout=60, json={
        "model": "default", "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
        "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["prompt_token_ids"] == ids
    pd.router.poll_all()
    assert_cached_as_routed(pd.router.index, "decode-0", ids, tokenizer.encode(PROMPT))


@pytest.fixture(scope="module")
def colocated(checkpoint: Path):
    with LLM(str(checkpoint), num_threads=1, **ENGINE) as llm:
        yield llm


@pytest.mark.parametrize("messages", CONTENTLESS, ids=["user+developer", "user"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_answers_messages_without_content(pd, colocated: LLM, tokenizer: Tokenizer,
                                             messages: list[dict], stream: bool) -> None:
    body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0,
            "stream": stream}
    reply = httpx.post(f"{pd.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if stream:
        lines = [line[6:] for line in reply.text.split("\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line)["choices"] for line in lines[:-1]]
        text = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
    else:
        text = reply.json()["choices"][0]["message"]["content"]
    prompt = tokenizer.encode_chat([{**m, "content": ""} for m in messages])
    expected = colocated.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0]
    assert text == expected.text and expected.num_prompt_tokens == len(prompt)
