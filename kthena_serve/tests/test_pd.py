"""PD mode end to end with real worker processes (same-host zero-copy path).

One deployment (1 prefill + 1 decode worker, the default model) serves every test here; a
colocated engine in this process gives the reference tokens.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from _support import eventually, metric_value
from _tiny import PD_ENGINE, default_tokenizer, greedy_text

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster, shm_pools

PD = {"pd_threshold_tokens": 24, "transfer_timeout_s": 60, "health_interval_s": 0.2}
TEXT = ("Paged attention stores the key and value cache in fixed-size blocks, so a scheduler "
        "can share prefixes between requests and evict whole blocks when memory runs short. ")


def prompt_ids(num_tokens: int, salt: str = "") -> list[int]:
    ids = default_tokenizer().encode(salt + TEXT * (num_tokens // 20 + 2))
    return ids[:num_tokens]


@pytest.fixture(scope="module")
def cluster():
    pd = PDCluster(EngineConfig(**PD_ENGINE), PDConfig(**PD), tokenizer=default_tokenizer()).start()
    pids = [pd.launcher.pid(name) for name in pd.launcher.workers]
    try:
        yield pd
    finally:
        pd.stop()
    assert not [p for p in shm_pools() for pid in pids if f".{pid}." in p]


def test_greedy_tokens_match_colocated(cluster, colocated) -> None:  # noqa: ANN001
    before = metric_value(cluster.worker_metrics("decode-0"), "kthena_pd_requests_total",
                          path="disaggregated")
    for n in (40, 97, 150):
        ids = prompt_ids(n, salt=f"case {n}: ")
        reply = cluster.complete(ids, max_tokens=12)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == greedy_text(colocated, ids, 12)
    after = metric_value(cluster.worker_metrics("decode-0"), "kthena_pd_requests_total",
                         path="disaggregated")
    assert after - before == 3  # all three went through the prefill worker


def test_streaming_and_chat_unchanged_for_clients(cluster) -> None:  # noqa: ANN001
    body = {"model": "default", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Name a colour. " * 8}]}
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert httpx.get(f"{cluster.url}/v1/models").json()["data"][0]["id"] == "default"
    bad = cluster.complete("hi", max_tokens=10**6)
    assert bad.status_code == 400 and "max_tokens" in bad.text


def test_shared_prefix_hits_on_the_decode_side(cluster, colocated) -> None:  # noqa: ANN001
    base = prompt_ids(96, salt="shared prefix test. ")
    first = cluster.complete(base + prompt_ids(20, "tail one "), max_tokens=4)
    assert first.status_code == 200
    second_ids = base + prompt_ids(40, "tail two ")
    second = cluster.complete(second_ids, max_tokens=6)
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 80  # at least 5 of the 6 shared blocks: not recomputed, not moved
    assert second.json()["choices"][0]["text"] == greedy_text(colocated, second_ids, 6)
    # the router learns the decode worker's blocks
    eventually(lambda: cluster.router.index.match(base)["decode-0"] >= 5, 5, interval_s=0.1)
    assert cluster.router.index.match(base)["decode-0"] >= 5


def test_short_uncached_part_runs_on_the_decode_worker(cluster) -> None:  # noqa: ANN001
    router_metrics = httpx.get(f"{cluster.url}/metrics").text
    before = metric_value(router_metrics, "kthena_pd_router_decisions_total",
                          decision="short_prompt")
    assert cluster.complete(prompt_ids(10, "short "), max_tokens=3).status_code == 200
    after = metric_value(httpx.get(f"{cluster.url}/metrics").text,
                         "kthena_pd_router_decisions_total", decision="short_prompt")
    assert after == before + 1


def test_metrics_and_no_blocks_left(cluster) -> None:  # noqa: ANN001
    text = cluster.worker_metrics("prefill-0")
    assert metric_value(text, "kthena_pd_prefill_seconds_count") >= 3
    assert metric_value(text, "kthena_pd_transferred_bytes_total") == 0  # zero copy
    decode = cluster.worker_metrics("decode-0")
    assert metric_value(decode, "kthena_pd_handoff_seconds_count") >= 3
    assert re.search(r"kthena_pd_router_decisions_total\{.*disaggregated",
                     httpx.get(f"{cluster.url}/metrics").text)
    state = cluster.worker_state("decode-0")
    assert state["kv"]["num_used_blocks"] == 0 and state["num_quarantined"] == 0
    decode_pid = cluster.launcher.pid("decode-0")
    assert [p for p in shm_pools() if f".{decode_pid}." in p]  # the decode pool lives in shm


def test_router_stats_are_the_workers_measured_stats(cluster) -> None:  # noqa: ANN001
    """The router's /metrics report what the workers measured (no placeholder zeros)."""
    assert cluster.complete(prompt_ids(48, "stats "), max_tokens=5).status_code == 200
    time.sleep(3 * PD["health_interval_s"])  # the router's next polls see the new counters
    states = [cluster.worker_state(name) for name in ("decode-0", "prefill-0")]
    generated = sum(s["stats"]["num_generated_tokens"] for s in states)
    computed = sum(s["stats"]["num_computed_prompt_tokens"] for s in states)
    assert generated >= 5 and computed >= 48 - 16  # the decode side may hold a cached prefix
    text = httpx.get(f"{cluster.url}/metrics").text
    assert metric_value(text, "kthena_generation_tokens_total") == generated
    assert metric_value(text, "kthena_computed_prompt_tokens_total") == computed
    assert states[1]["stats"]["num_generated_tokens"] == 0  # the first token counts once
    assert metric_value(text, "kthena_kv_blocks_free") == states[0]["kv"]["num_free_blocks"]


def test_out_of_vocab_ids_get_400_like_colocated(cluster, colocated) -> None:  # noqa: ANN001
    vocab = colocated.processor.limits.vocab_size
    for bad in ([vocab], [1, 2, vocab + 5], [2**63]):
        response = cluster.complete(bad, max_tokens=2)
        assert response.status_code == 400, response.text
        assert "vocabulary" in response.json()["error"]["message"]


def test_hostile_numbers_get_the_same_400_as_colocated(cluster) -> None:  # noqa: ANN001
    import json

    for bad in ({"seed": 2**64}, {"top_k": 2**64 - 1}, {"temperature": float("inf")},
                {"prompt": "a\ud800b"}, {"stop": ["a\ud800b"]}, {"temperature": float("nan")},
                {"logit_bias": {"1": float("nan")}}, {"prompt_logprobs": 1},
                {"echo": True, "logprobs": 1}):
        body = {"model": cluster.model_name, "prompt": "Hello", "max_tokens": 2, **bad}
        response = httpx.post(f"{cluster.url}/v1/completions", content=json.dumps(body),
                              headers={"content-type": "application/json"}, timeout=60)
        assert response.status_code == 400, (bad, response.text)
    assert cluster.complete(prompt_ids(40, "after "), max_tokens=3).status_code == 200
