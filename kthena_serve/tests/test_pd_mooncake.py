"""Cross-host PD handoff over the kthena_comm ``mooncake`` backend (TCP).

Two worker processes over 127.0.0.1, then two network namespaces joined by a veth pair
(addresses of this test's own, 10.213.<n>.1/30 and .2/30, inside the namespaces only) acting
as two hosts; that case is skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _netns import two_host_network
from _tiny import PD_ENGINE, default_tokenizer, greedy_text

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster

pytest.importorskip("mooncake.engine", reason="the mooncake wheel (and libibverbs1) is missing")

TEXT = "One-sided writes move finished blocks into memory the decode worker registered. "


def prompt(num_tokens: int, salt: str) -> list[int]:
    return default_tokenizer().encode(salt + TEXT * (num_tokens // 15 + 2))[:num_tokens]


@pytest.fixture(scope="module")
def colocated():
    from kthena_serve.engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(**PD_ENGINE, num_threads=1))
    yield engine
    engine.close()


def reference(engine, ids: list[int], max_tokens: int = 8) -> str:  # noqa: ANN001
    return greedy_text(engine, ids, max_tokens)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def test_mooncake_handoff_over_loopback(colocated) -> None:  # noqa: ANN001
    pd = {"transport": "mooncake", "pd_threshold_tokens": 16, "transfer_timeout_s": 60}
    base = prompt(96, "loopback. ")
    with PDCluster(EngineConfig(**PD_ENGINE), PDConfig(**pd), tokenizer=default_tokenizer()) as cluster:
        first = base + prompt(30, "first ")
        reply = cluster.complete(first, max_tokens=8)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == reference(colocated, first)
        moved_first = _metric(cluster.worker_metrics("prefill-0"),
                              "kthena_pd_transferred_bytes_total")
        assert moved_first > 0
        second = base + prompt(40, "second ")
        reply = cluster.complete(second, max_tokens=8)
        assert reply.json()["choices"][0]["text"] == reference(colocated, second)
        prefill = cluster.worker_metrics("prefill-0")
        assert _metric(prefill, "kthena_pd_prefill_cached_tokens_total") >= 80  # prefill-side hit
        # the decode worker already held the shared blocks: only the new tail crossed the wire
        assert _metric(prefill, "kthena_pd_transferred_bytes_total") - moved_first < moved_first
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80


@pytest.fixture
def two_hosts():
    with two_host_network("pd", 213) as hosts:
        yield hosts


def test_mooncake_handoff_between_two_network_namespaces(two_hosts, colocated) -> None:  # noqa: ANN001
    ns_a, ns_b, addr_a, addr_b = two_hosts
    prompts = [prompt(70, "namespaces one. "), prompt(110, "namespaces two. ")]
    helper = Path(__file__).with_name("pd_netns_helper.py")
    done = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, str(helper), ns_b,
                           addr_a, addr_b, json.dumps(prompts)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["texts"] == [reference(colocated, ids) for ids in prompts]
    assert result["transferred_bytes"] > 0
