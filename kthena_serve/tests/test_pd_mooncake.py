"""Cross-host PD handoff over the kthena_comm ``mooncake`` backend (TCP).

Two worker processes over 127.0.0.1, then two network namespaces joined by a veth pair
(addresses of this test's own, 10.213.<n>.1/30 and .2/30, inside the namespaces only) acting
as two hosts; that case is skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import pytest
from _netns import run_in_first_host, two_host_network
from _support import metric_value
from _tiny import PD_ENGINE, default_tokenizer, greedy_text

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster

pytest.importorskip("mooncake.engine", reason="the mooncake wheel (and libibverbs1) is missing")

TEXT = "One-sided writes move finished blocks into memory the decode worker registered. "


def prompt(num_tokens: int, salt: str) -> list[int]:
    return default_tokenizer().encode(salt + TEXT * (num_tokens // 15 + 2))[:num_tokens]


def test_mooncake_handoff_over_loopback(colocated) -> None:  # noqa: ANN001
    pd = {"transport": "mooncake", "pd_threshold_tokens": 16, "transfer_timeout_s": 60}
    base = prompt(96, "loopback. ")
    with PDCluster(EngineConfig(**PD_ENGINE), PDConfig(**pd), tokenizer=default_tokenizer()) as cluster:
        first = base + prompt(30, "first ")
        reply = cluster.complete(first, max_tokens=8)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == greedy_text(colocated, first)
        moved_first = metric_value(cluster.worker_metrics("prefill-0"),
                                   "kthena_pd_transferred_bytes_total")
        assert moved_first > 0
        second = base + prompt(40, "second ")
        reply = cluster.complete(second, max_tokens=8)
        assert reply.json()["choices"][0]["text"] == greedy_text(colocated, second)
        prefill = cluster.worker_metrics("prefill-0")
        assert metric_value(prefill, "kthena_pd_prefill_cached_tokens_total") >= 80  # prefill-side hit
        # the decode worker already held the shared blocks: only the new tail crossed the wire
        assert metric_value(prefill, "kthena_pd_transferred_bytes_total") - moved_first < moved_first
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80


@pytest.fixture
def two_hosts():
    with two_host_network("pd", 213) as hosts:
        yield hosts


def test_mooncake_handoff_between_two_network_namespaces(two_hosts, colocated) -> None:  # noqa: ANN001
    prompts = [prompt(70, "namespaces one. "), prompt(110, "namespaces two. ")]
    result = run_in_first_host(two_hosts, "pd_netns_helper.py", prompts, 240)
    assert result["texts"] == [greedy_text(colocated, ids) for ids in prompts]
    assert result["transferred_bytes"] > 0
