"""PD failure semantics with real processes: SIGKILL / SIGSTOP of workers, both policies.

After every case: the survivors hold no blocks (nothing leaked, quarantines settled), no
shared-memory pool of a dead worker is left, the router stopped routing to the dead worker,
and the restarted worker rejoins.
"""

from __future__ import annotations

import signal
import threading

import httpx
import pytest
from _support import wait_until
from _tiny import PD_ENGINE, default_tokenizer

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster, shm_pools

TEXT = ("Disaggregated serving moves the key-value cache from the prefill instance to the "
        "decode instance, and every transfer must have an explicit outcome. ")


def long_prompt(num_tokens: int, salt: str) -> list[int]:
    return default_tokenizer().encode(salt + TEXT * (num_tokens // 20 + 2))[:num_tokens]


def in_background(fn):  # noqa: ANN001, ANN201
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    thread.start()
    return thread, box


def is_busy(cluster: PDCluster, name: str) -> bool:
    try:
        return cluster.worker_state(name)["num_running"] > 0
    except httpx.HTTPError:
        return False


def assert_clean(cluster: PDCluster, dead_pids: list[int]) -> None:
    wait_until(lambda: cluster.worker_state("decode-0")["kv"]["num_used_blocks"] == 0, 30,
               "the decode worker to hold no blocks")
    assert cluster.worker_state("decode-0")["num_quarantined"] == 0
    for pid in dead_pids:
        assert not [p for p in shm_pools() if f".{pid}." in p], f"pool of dead pid {pid} left"


def rejoined(cluster: PDCluster, name: str) -> bool:
    return cluster.router.workers[name].is_up


def pd_cluster(policy: str) -> PDCluster:
    pd = {"policy": policy, "transfer_timeout_s": 4, "pd_threshold_tokens": 16,
          "health_interval_s": 0.2}
    return PDCluster(EngineConfig(**PD_ENGINE), PDConfig(**pd), tokenizer=default_tokenizer())


@pytest.fixture(scope="module")
def recompute_cluster():
    with pd_cluster("recompute") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def fail_cluster():
    with pd_cluster("fail") as cluster:
        yield cluster


def in_flight(cluster: PDCluster, prompts: list[list[int]], max_tokens: int) -> list:
    """Send the prompts at once (the prefill worker batches them); their (thread, box)es."""
    return [in_background(lambda ids=ids: cluster.complete(ids, max_tokens=max_tokens))
            for ids in prompts]


def replies(jobs: list) -> list[httpx.Response]:
    for thread, _ in jobs:
        thread.join(120)
    return [box["result"] for _, box in jobs]


def test_killed_prefill_recompute_gives_the_right_tokens(recompute_cluster) -> None:  # noqa: ANN001
    """SIGKILL while the prefill worker runs a batch of three prompts: every one of them is
    recomputed by the decode worker, with the tokens the recovered deployment gives."""
    cluster = recompute_cluster
    prompts = [long_prompt(500, f"kill prefill {i}. ") for i in range(3)]
    cluster.router.config = cluster.pd_config  # (unchanged; documents the policy in use)
    jobs = in_flight(cluster, prompts, 8)
    wait_until(lambda: is_busy(cluster, "prefill-0"), 60, "the prefill to start")
    old = cluster.launcher.kill("prefill-0", signal.SIGKILL)
    answers = replies(jobs)
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    # never wrong tokens: the same prompts served again after recovery give the same texts
    wait_until(lambda: rejoined(cluster, "prefill-0") and cluster.launcher.pid("prefill-0") not in (old, None),
               120, "the prefill worker to rejoin")
    for ids, reply in zip(prompts, answers, strict=True):
        again = cluster.complete(ids, max_tokens=8)
        assert again.json()["choices"][0]["text"] == reply.json()["choices"][0]["text"]
    decode = cluster.worker_metrics("decode-0")
    assert 'kthena_pd_transfer_failures_total{policy="recompute"' in decode
    assert_clean(cluster, [old])


def test_hung_prefill_times_out_and_blocks_stay_quarantined(recompute_cluster) -> None:  # noqa: ANN001
    cluster = recompute_cluster
    ids = long_prompt(600, "stop prefill. ")
    thread, box = in_background(lambda: cluster.complete(ids, max_tokens=4))
    wait_until(lambda: is_busy(cluster, "prefill-0"), 60, "the prefill to start")
    cluster.launcher.kill("prefill-0", signal.SIGSTOP)
    try:
        thread.join(120)
        assert box["result"].status_code == 200  # recomputed on the decode worker
        # the stopped prefill may still write into its blocks: they must not be reused yet
        assert cluster.worker_state("decode-0")["num_quarantined"] == 1
    finally:
        cluster.launcher.kill("prefill-0", signal.SIGCONT)
    assert_clean(cluster, [])


def test_killed_prefill_with_policy_fail_is_a_clear_503(fail_cluster) -> None:  # noqa: ANN001
    """SIGKILL mid-batch with policy fail: every prompt of the batch gets the 503."""
    cluster = fail_cluster
    prompts = [long_prompt(500, f"fail policy {i}. ") for i in range(3)]
    jobs = in_flight(cluster, prompts, 8)
    wait_until(lambda: is_busy(cluster, "prefill-0"), 60, "the prefill to start")
    old = cluster.launcher.kill("prefill-0")
    answers = replies(jobs)
    assert [r.status_code for r in answers] == [503, 503, 503], [r.text for r in answers]
    assert all("handoff failed" in r.json()["error"]["message"] for r in answers)
    # the failed handoff marks the prefill worker down at once (passive health check) ...
    assert not rejoined(cluster, "prefill-0")
    # ... and only a poll of the restarted process brings it back
    wait_until(lambda: cluster.launcher.pid("prefill-0") not in (old, None)
               and rejoined(cluster, "prefill-0"),
               120, "the prefill worker to rejoin")
    assert cluster.complete(prompts[0][:100], max_tokens=2).status_code == 200
    assert_clean(cluster, [old])


def test_killed_decode_fails_in_flight_and_rejoins(fail_cluster) -> None:  # noqa: ANN001
    cluster = fail_cluster
    ids = long_prompt(64, "kill decode. ")
    thread, box = in_background(lambda: cluster.complete(ids, max_tokens=400, ignore_eos=True))
    wait_until(lambda: cluster.worker_state("decode-0")["num_running"] > 0, 60, "decoding")
    old = cluster.launcher.kill("decode-0")
    thread.join(60)
    assert box["result"].status_code == 503
    assert "decode worker" in box["result"].json()["error"]["message"]
    assert not cluster.router.workers["decode-0"].is_up  # no more traffic to it
    wait_until(lambda: rejoined(cluster, "decode-0") and cluster.launcher.pid("decode-0") not in (old, None),
               120, "the decode worker to rejoin")
    reply = cluster.complete(ids, max_tokens=4)
    assert reply.status_code == 200, reply.text
    assert_clean(cluster, [old])
