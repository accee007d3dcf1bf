"""Faults between hosts, made for real: the network between a prefill and a decode worker, and
the control planes under load (the Mooncake master of a store tier, the Redis of KV events).

PD: the decode worker (with the router and the OpenAI app) in namespace A, the prefill worker in
namespace B, a veth link between them, KV pushed over the Mooncake Transfer Engine (TCP). The
faults are ``_faults.Link``'s: a partition (nftables drop, or ``tc pfifo limit 0``), a slow link
(``tc tbf``) and random loss (nftables ``numgen``); this kernel has no ``netem`` qdisc. What
each fault must give is the PD policy's promise (docs/network_faults.md): a clean error or a
recompute within ``transfer_timeout_s``, never a hang; the decode worker keeps the reserved
blocks quarantined until no put of the failed request can land any more, then frees them;
nothing stays held on either worker; after healing, the same prompt gets the same tokens.

Control planes: a ``mooncake_master`` killed under a store-tier load (serving goes on from the
host tier, errors counted, the tier is used again once a master answers on its address), and a
``redis-server`` killed under ``--kv-events`` (serving goes on, the publisher resyncs when
Redis is back).

Slow (each PD case starts a deployment and waits out timeouts): ``make test-faults`` runs this
file; ``make test`` leaves it out.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from _faults import Link, inside, nft_reason
from _netns import two_host_network
from _support import metric_value, wait_until
from _tiny import PD_ENGINE, default_tokenizer, greedy_text
from test_kv_events_redis import RedisServer

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster

pytestmark = [pytest.mark.faults, pytest.mark.slow]

TEXT = ("After a partition heals, retransmitted segments of a one-sided put still land in the "
        "decode worker's blocks. ")
TRANSFER_TIMEOUT_S = 8.0
QUIET_BYTES = 256 << 10  # what may cross the link in a second without KV: polls, not blocks


def prompt(num_tokens: int, salt: str) -> list[int]:
    return default_tokenizer().encode(salt + TEXT * (num_tokens // 15 + 2))[:num_tokens]


# ---- PD across two namespaces ---------------------------------------------------------------------
class Deployment:
    """A PD deployment whose decode side lives in namespace A, prefill in B (``inside`` A for
    every call: the app listens on A's loopback)."""

    def __init__(self, hosts: tuple[str, str, str, str], policy: str) -> None:
        self.ns_a, self.ns_b, addr_a, addr_b = hosts
        self.link = Link(self.ns_a, self.ns_b)
        pd = PDConfig(transport="mooncake", policy=policy, pd_threshold_tokens=16,
                      transfer_timeout_s=TRANSFER_TIMEOUT_S, health_interval_s=0.25)
        self.cluster = PDCluster(EngineConfig(**PD_ENGINE), pd, tokenizer=default_tokenizer(),
                                 worker_hosts={"decode-0": addr_a, "prefill-0": addr_b},
                                 worker_prefix={"prefill-0": ["ip", "netns", "exec", self.ns_b]})

    def complete(self, ids: list[int], **extra: object) -> httpx.Response:
        with inside(self.ns_a):
            return self.cluster.complete(ids, max_tokens=6, timeout=120, **extra)

    def text(self, ids: list[int]) -> str:
        reply = self.complete(ids)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    def stream(self, ids: list[int]) -> tuple[int, list[dict]]:
        """(status, the events) of a streamed completion."""
        reply = self._stream(ids)
        events = [json.loads(line[len("data: "):]) for line in reply.text.splitlines()
                  if line.startswith("data: {")]
        return reply.status_code, events

    def stream_refusal(self, ids: list[int]) -> tuple[int, dict]:
        """(status, the error body) of a streamed completion refused before its headers."""
        reply = self._stream(ids)
        return reply.status_code, reply.json() if reply.status_code != 200 else {}

    def _stream(self, ids: list[int]) -> httpx.Response:
        with inside(self.ns_a):
            body = {"model": "default", "prompt": ids, "max_tokens": 6, "temperature": 0,
                    "stream": True}
            return httpx.post(f"{self.cluster.url}/v1/completions", json=body, timeout=120)

    def decode_held(self) -> tuple[int, int]:
        """(decode used blocks, quarantined reservations): readable through a partition."""
        with inside(self.ns_a):
            decode = self.cluster.worker_state("decode-0")
        return decode["kv"]["num_used_blocks"], decode["num_quarantined"]

    def held(self) -> tuple[int, int, int, int]:
        """(prefill used blocks, pins; decode used blocks, quarantined reservations)."""
        with inside(self.ns_a):
            prefill = self.cluster.worker_state("prefill-0")
            decode = self.cluster.worker_state("decode-0")
        return (prefill["kv"]["num_used_blocks"], prefill["num_pinned"],
                decode["kv"]["num_used_blocks"], decode["num_quarantined"])

    def decode_metric(self, series: str) -> float:
        with inside(self.ns_a):
            return metric_value(self.cluster.worker_metrics("decode-0"), series)

    def prefill_metric(self, series: str) -> float:
        with inside(self.ns_a):
            return metric_value(self.cluster.worker_metrics("prefill-0"), series)

    def prefill_is_up(self) -> bool:
        with inside(self.ns_a):
            workers = httpx.get(f"{self.cluster.url}/pd/workers", timeout=5).json()
        return workers["prefill-0"]["up"]


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[str, str, str, str]]:
    pytest.importorskip("mooncake.engine", reason="the mooncake wheel (and libibverbs1) is missing")
    with two_host_network("nf", 216) as names:
        yield names


def deployment(hosts: tuple[str, str, str, str], policy: str) -> Iterator[Deployment]:
    made = Deployment(hosts, policy)
    with inside(made.ns_a):  # its threads and worker processes start (and stay) in A
        made.cluster.start()
    try:
        yield made
    finally:
        made.link.heal()
        made.cluster.stop()


@pytest.fixture(scope="module")
def colocated() -> Iterator[object]:
    from kthena_serve.engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(**PD_ENGINE, num_threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="class")
def failing(hosts) -> Iterator[Deployment]:  # noqa: ANN001
    yield from deployment(hosts, "fail")


@pytest.fixture
def recomputing(hosts) -> Iterator[Deployment]:  # noqa: ANN001
    yield from deployment(hosts, "recompute")


def cut_mid_transfer(pd: Deployment, send) -> tuple[object, float, int]:  # noqa: ANN001
    """Slow the link, start ``send()`` (a long prompt), partition once its KV is crossing;
    (what ``send`` returned, seconds from the cut to its answer, bytes crossed before)."""
    pd.link.slow("2mbit", "2s")
    before = pd.link.rx_bytes(pd.ns_a)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send)
        wait_until(lambda: pd.link.rx_bytes(pd.ns_a) - before > 200_000 or answer.done(), 60,
                   "KV crossing the slowed link")
        assert not answer.done(), answer.result()  # the push was still running when cut
        pd.link.partition()
        cut = time.monotonic()
        result = answer.result(timeout=TRANSFER_TIMEOUT_S * 3 + 30)  # a hang fails here
    return result, time.monotonic() - cut, pd.link.rx_bytes(pd.ns_a) - before


def assert_blocks_wait_for_the_late_bytes(pd: Deployment) -> None:
    """Heal; the quarantined blocks must outlive every byte of the failed push that lands."""
    used, quarantined = pd.decode_held()
    assert used > 0 and quarantined == 1, "the decode worker released its reservation early"
    pd.link.heal()
    landed = []

    def freed() -> bool:
        landed.append(pd.link.rx_bytes(pd.ns_a))
        return pd.held() == (0, 0, 0, 0)

    # every 0.1 s: bytes landing after the freeing but before the poll that sees it go uncounted
    wait_until(freed, 90, "blocks freed after healing", interval_s=0.1)
    time.sleep(1.0)
    late = pd.link.rx_bytes(pd.ns_a) - landed[-1]
    assert late < QUIET_BYTES, f"{late} bytes landed after the blocks were freed"
    assert landed[-1] - landed[0] > 1 << 20, "the cut push never resumed"
    wait_until(pd.prefill_is_up, 30, "the router routes to the prefill worker again")


class TestPolicyFail:
    """``policy: fail``: one deployment for these (started and stopped with the class, so
    it never runs beside the recompute one)."""

    def test_partition_mid_handoff_fails_fast_and_heals(self, failing, colocated) -> None:  # noqa: ANN001
        pd = failing
        long_prompt, short_prompt = prompt(400, "cut. "), prompt(10, "local. ")
        assert pd.text(prompt(60, "healthy. ")) == greedy_text(colocated, prompt(60, "healthy. "), 6)
        failures = pd.decode_metric("kthena_pd_transfer_failures_total")
        try:
            reply, waited, crossed = cut_mid_transfer(pd, lambda: pd.complete(long_prompt))
            assert reply.status_code == 503, reply.text
            error = reply.json()["error"]
            assert "KV handoff failed (timeout)" in error["message"], error
            assert error["type"] == "service_unavailable"
            assert waited < TRANSFER_TIMEOUT_S + 10, waited
            assert crossed < 23040 * 400  # the push was cut short of the prompt's KV
            assert pd.decode_metric("kthena_pd_transfer_failures_total") == failures + 1
            # the decode worker goes on serving through the partition, alone
            assert pd.text(short_prompt) and pd.text(prompt(300, "during the cut. "))
            assert_blocks_wait_for_the_late_bytes(pd)
        finally:
            pd.link.heal()
        disaggregated = pd.decode_metric('kthena_pd_requests_total{path="disaggregated"')
        assert pd.text(long_prompt) == greedy_text(colocated, long_prompt, 6)
        assert pd.decode_metric('kthena_pd_requests_total{path="disaggregated"') == disaggregated + 1
        wait_until(lambda: pd.held() == (0, 0, 0, 0), 10, "nothing held")

    def test_partition_mid_handoff_refuses_a_stream_before_its_headers(self, failing) -> None:  # noqa: ANN001
        """A streamed answer's headers wait for its first output, so a hand-off that fails
        before it is the response's 503, not an error event in a 200 stream."""
        pd = failing
        long_prompt = prompt(380, "streamed cut. ")
        try:
            (status, body), waited, _ = cut_mid_transfer(pd, lambda: pd.stream_refusal(long_prompt))
            assert waited < TRANSFER_TIMEOUT_S + 10, waited
            assert status == 503, body
            assert "KV handoff failed" in body["error"]["message"], body
            assert_blocks_wait_for_the_late_bytes(pd)
        finally:
            pd.link.heal()
        status, events = pd.stream(long_prompt)
        assert status == 200 and not any("error" in event for event in events), events

    def test_slow_lossy_link_serves_the_same_tokens(self, failing, colocated) -> None:  # noqa: ANN001
        pd = failing
        prompts = [prompt(150 + 20 * i, f"lossy {i}. ") for i in range(4)]  # new to both workers
        moved = pd.prefill_metric("kthena_pd_transferred_bytes_total")
        failures = pd.decode_metric("kthena_pd_transfer_failures_total")
        disaggregated = pd.decode_metric('kthena_pd_requests_total{path="disaggregated"')
        try:
            mechanisms = [pd.link.slow("16mbit", "200ms")]
            if nft_reason() is None:
                mechanisms.append(pd.link.lose(5))
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                texts = list(pool.map(pd.text, prompts))
        finally:
            pd.link.heal()
        assert texts == [greedy_text(colocated, ids, 6) for ids in prompts], mechanisms
        assert pd.decode_metric("kthena_pd_transfer_failures_total") == failures, mechanisms
        assert pd.decode_metric('kthena_pd_requests_total{path="disaggregated"') == disaggregated + 4
        assert pd.prefill_metric("kthena_pd_transferred_bytes_total") - moved > 4 * 150 * 23040
        wait_until(lambda: pd.held() == (0, 0, 0, 0), 10, "nothing held")


def test_partition_mid_handoff_recomputes_under_the_recompute_policy(recomputing,  # noqa: ANN001
                                                                     colocated) -> None:  # noqa: ANN001
    pd = recomputing
    long_prompt = prompt(400, "recomputed. ")
    before = greedy_text(colocated, long_prompt, 6)
    try:
        reply, waited, _ = cut_mid_transfer(pd, lambda: pd.complete(long_prompt))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == before  # computed by the decode worker
        assert waited < TRANSFER_TIMEOUT_S + 30, waited
        assert pd.decode_metric('kthena_pd_requests_total{path="recomputed"') == 1
        assert_blocks_wait_for_the_late_bytes(pd)
    finally:
        pd.link.heal()
    assert pd.text(long_prompt) == before


# ---- control planes under load: the Mooncake master, Redis ----------------------------------------
LOAD_PROMPTS = [f"Request {i} of the load: tier faults must cost recomputation, never answers. "
                * 2 for i in range(6)]


class Load:
    """``clients`` threads posting the prompts round-robin to ``url`` until ``stop``; every
    answer is kept as (prompt index, status, text or error body, when)."""

    def __init__(self, url: str, prompts: list[str], clients: int = 2) -> None:
        self.url, self.prompts = url, prompts
        self.answers: list[tuple[int, int, str, float]] = []
        self._stop = False
        self._pool = concurrent.futures.ThreadPoolExecutor(clients)
        self._clients = [self._pool.submit(self._run, c, clients) for c in range(clients)]

    def _run(self, first: int, step: int) -> None:
        with httpx.Client(timeout=60) as client:
            i = first
            while not self._stop:
                index = i % len(self.prompts)  # the test may add prompts meanwhile
                body = {"model": "tiny", "prompt": self.prompts[index], "max_tokens": 6,
                        "temperature": 0, "ignore_eos": True}
                reply = client.post(f"{self.url}/v1/completions", json=body)
                text = (reply.json()["choices"][0]["text"] if reply.status_code == 200
                        else reply.text)
                self.answers.append((index, reply.status_code, text, time.monotonic()))
                i += step

    def count_after(self, moment: float) -> int:
        return sum(when > moment for *_, when in self.answers)

    def stop(self) -> list[tuple[int, int, str, float]]:
        self._stop = True
        for client in self._clients:
            client.result(timeout=120)
        self._pool.shutdown()
        return self.answers


@contextlib.contextmanager
def served(engine, make_app=None) -> Iterator[str]:  # noqa: ANN001
    """An OpenAI server over ``engine`` on 127.0.0.1; yields its URL, shuts everything down."""
    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.server import BackgroundServer, build_app

    async_engine = AsyncLLM(engine).start()
    try:
        app = build_app(async_engine, model_name="tiny")
        if make_app is not None:
            make_app(app, async_engine)
        with BackgroundServer(app) as http:
            yield http.url
    finally:
        async_engine.shutdown()


def scrape(url: str, series: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics", timeout=10).text, series)


def reference_texts(prompts: list[str]) -> list[str]:
    """Greedy texts of the tiny model with no tier at all (same weights: seed 0)."""
    from _tiny import tiny_engine

    engine = tiny_engine(num_kv_blocks=256)
    try:
        ids = [default_tokenizer().encode(text) for text in prompts]
        return [greedy_text(engine, prompt_ids, 6) for prompt_ids in ids]
    finally:
        engine.close()


def assert_answers(answers: list[tuple[int, int, str, float]], reference: list[str]) -> None:
    bad = [(i, status, text[:200], reference[i]) for i, status, text, _ in answers
           if status != 200 or text != reference[i]]
    assert not bad, bad


def test_mooncake_master_lost_under_load_then_back(caplog) -> None:  # noqa: ANN001
    """``--kv-offload host=...,store=mooncake@...,write=through``: the master is SIGKILLed while
    clients run; every answer is 200 with the tokens of a run without tiers (blocks come from
    the host tier or are recomputed), the store's errors are counted and logged, and once a
    master answers on the same address again the tier takes blocks again."""
    from _tiny import tiny_engine

    from mooncake_kv.tiers.master import master_binary, start_local_master, stop_master

    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (or libibverbs1) is missing")
    if not master_binary().exists():
        pytest.skip(f"mooncake_master not found at {master_binary()}; install mooncake-kv[store]")
    prompts = list(LOAD_PROMPTS)  # the load picks up prompts added while it runs
    master, address = start_local_master()
    port = int(address.rpartition(":")[2])
    store = '{tier="mooncake_store"}'
    try:
        engine = tiny_engine(num_kv_blocks=40, kv_offload=f"host=64MiB,store=mooncake@{address},"
                             "write=through,segment=16MiB")
        with served(engine) as url:
            load = Load(url, prompts)
            try:
                wait_until(lambda: scrape(url, f"kthena_kv_tier_stored_blocks_total{store}") > 0
                           and scrape(url, 'kthena_kv_tier_hits_total{tier="host"}') > 0, 60,
                           "blocks in the store and promotions from the host tier")
                master.kill()
                master.wait()
                killed = time.monotonic()
                host_hits = scrape(url, 'kthena_kv_tier_hits_total{tier="host"}')
                prompts += [f"New while the master is gone {i}: its blocks find no store. " * 2
                            for i in range(4)]
                wait_until(lambda: scrape(url, f"kthena_kv_tier_errors_total{store}") > 0, 60,
                           "the store's failures counted")
                wait_until(lambda: load.count_after(killed) >= 10
                           and scrape(url, 'kthena_kv_tier_hits_total{tier="host"}') > host_hits,
                           60, "answers and host-tier promotions with the master gone")
                stored = scrape(url, f"kthena_kv_tier_stored_blocks_total{store}")
                master, _ = start_local_master(rpc_port=port)
                back = time.monotonic()

                def new_blocks_stored() -> bool:  # a new prompt a second: new blocks to put
                    prompts.append(f"New after the master's return {len(prompts)}: blocks it "
                                   "has not seen. " * 2)
                    time.sleep(1.0)
                    return scrape(url, f"kthena_kv_tier_stored_blocks_total{store}") > stored

                # the tier is skipped for retry_after_s (10 s) after a failure, then tried again
                wait_until(new_blocks_stored, 60, "the store taking blocks again")
                wait_until(lambda: load.count_after(back) >= 5, 60, "answers after the return")
            finally:
                answers = load.stop()
    finally:
        stop_master(master)
    assert_answers(answers, reference_texts(prompts))
    logged = [r.getMessage() for r in caplog.records if "mooncake_store" in r.getMessage()]
    assert any("failed on" in m for m in logged) and any("works again" in m for m in logged), \
        logged


def test_redis_lost_under_load_then_back(tmp_path) -> None:  # noqa: ANN001
    """``--kv-events redis://...``: redis-server is SIGKILLed while clients run; every answer is
    200 with the right tokens, the publisher counts Redis errors, and when a (fresh, empty)
    Redis comes back on the same port it is given every block the engine holds again."""
    import redis
    from _tiny import tiny_engine

    from kthena_serve.kv_events import KVEventsCollector, KVEventsConfig, RedisKVPublisher
    from kthena_serve.server.metrics import add_collector

    prompts = list(LOAD_PROMPTS)  # the load picks up prompts added while it runs
    server = RedisServer(tmp_path).start()
    client = redis.Redis(port=server.port, socket_timeout=5)
    publishers: list[RedisKVPublisher] = []

    def with_events(app, async_engine) -> None:  # noqa: ANN001
        config = KVEventsConfig(server.url, "kthena-0.default", "tiny", socket_timeout_s=0.5,
                                max_backoff_s=0.2)
        publishers.append(RedisKVPublisher(config, async_engine.kv_cache).start())
        add_collector(app, KVEventsCollector(publishers[0]))

    def keys() -> int:
        return sum(1 for _ in client.scan_iter("matrix:kv:block:tiny@*"))

    try:
        with served(tiny_engine(num_kv_blocks=256), with_events) as url:
            load = Load(url, prompts)
            try:
                wait_until(lambda: keys() > 0, 60, "KV events in Redis")
                first_run = client.info("server")["run_id"]
                server.kill()
                killed = time.monotonic()
                prompts += [f"New while Redis is gone {i}: blocks with events to publish. " * 2
                            for i in range(4)]
                wait_until(lambda: scrape(url, "kthena_kv_events_redis_errors_total") > 0, 60,
                           "Redis errors counted")
                wait_until(lambda: load.count_after(killed) >= 10, 60, "answers with Redis gone")
                server.start()  # same port, empty (no persistence); the publisher may refill
                # it before we look, so tell the new server by its run id, not by its keys
                wait_until(lambda: _run_id(client) not in (None, first_run), 30, "the new Redis")
                wait_until(lambda: keys() > 0, 60, "events in the new Redis")
                assert publishers[0].wait_synced()
                held = {f"matrix:kv:block:tiny@{chunk}" for chunk in publishers[0].held_chunks()}
                assert held and held <= {key.decode() for key in
                                         client.scan_iter("matrix:kv:block:tiny@*")}
            finally:
                answers = load.stop()
                for publisher in publishers:
                    publisher.close()
    finally:
        client.close()
        server.stop()
    assert_answers(answers, reference_texts(prompts))


def _run_id(client) -> str | None:  # noqa: ANN001
    import redis

    try:
        return client.info("server")["run_id"]
    except redis.RedisError:
        return None

