"""What PD and DP share (kthena_serve.cluster), without worker processes: the router's picks
and PD decider, the KV events wire, the state reply the router polls, a worker's lifecycle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import httpx
import pytest

from kthena_serve.cluster.config import Role, RouterWeights
from kthena_serve.cluster.events import EventLog, event_from_json
from kthena_serve.cluster.router import Router
from kthena_serve.cluster.worker import (
    pin_to_cores,
    remove_ready_file,
    state_reply,
    take_secret,
    write_ready_file,
)
from kthena_serve.engine.stats import EngineStats
from kthena_serve.engine.threads import owned_cores
from kthena_serve.pd.config import PDConfig
from mooncake_kv import BlockHasher, BlockStored, KVCacheManager

COLOCATED = Role.COLOCATED.value


@attrs.frozen(kw_only=True)
class Settings:
    """A ``RouterSettings`` that is no ``PDConfig``: the router needs no PD config."""

    weights: RouterWeights = attrs.field(factory=RouterWeights)
    pd_threshold_tokens: int = 32
    health_interval_s: float = 0.5


def _store(router: Router, name: str, tokens: list[int]) -> None:
    """``name`` holds the full blocks of ``tokens`` (as its KV events would say)."""
    hashes = BlockHasher(router.block_size).hash_tokens(tokens)
    router.index.apply(name, BlockStored(tuple(hashes), None, (), router.block_size, ()))


# ---- PD: prefill and decode workers (Router.choose) ---------------------------------------------
def _router(**pd: object) -> Router:
    workers = [("prefill-0", "prefill", "http://p0"), ("prefill-1", "prefill", "http://p1"),
               ("decode-0", "decode", "http://d0"), ("decode-1", "decode", "http://d1")]
    router = Router(workers, PDConfig(**pd), block_size=4)
    for worker in router.workers.values():
        worker.is_up = True
        router.index.add_instance(worker.name)
    return router


def test_router_prefers_overlap_then_load() -> None:
    router = _router(pd_threshold_tokens=0)
    prompt = list(range(40))
    _store(router, "prefill-1", prompt[:32])
    decision = router.choose(prompt)
    assert decision.prefill.name == "prefill-1" and decision.reason == "disaggregated"
    router.workers["prefill-1"].num_running = 10  # busy: load outweighs 80 % overlap at w=1
    router.config = PDConfig(pd_threshold_tokens=0, weights=RouterWeights(overlap=0.5, load=1))
    assert router.choose(prompt).prefill.name == "prefill-0"
    router.workers["decode-0"].num_waiting = 3
    assert router.choose(prompt).decode.name == "decode-1"


def test_decode_pick_follows_the_prefix_unless_load_outweighs_it() -> None:
    router = _router(pd_threshold_tokens=0)
    history = list(range(48))  # a conversation's earlier turns, held by decode-1
    _store(router, "decode-1", history)
    turn = history + [900, 901, 902, 903]
    decision = router.choose(turn)
    assert decision.decode.name == "decode-1" and decision.num_cached_blocks == 12
    router.workers["decode-1"].num_running = 8  # busy: load (w=0.5) outweighs 92 % overlap
    router.config = PDConfig(pd_threshold_tokens=0, weights=RouterWeights(overlap=0.3, load=1))
    assert router.choose(turn).decode.name == "decode-0"


def test_the_router_hashes_prompts_with_the_workers_algorithm() -> None:
    workers = [("decode-0", "decode", "http://d0"), ("decode-1", "decode", "http://d1")]
    router = Router(workers, PDConfig(pd_threshold_tokens=0), block_size=4, hash_algo="sha256")
    for worker in router.workers.values():
        worker.is_up = True
        router.index.add_instance(worker.name)
    prompt = list(range(40))
    hashes = BlockHasher(4, "sha256").hash_tokens(prompt[:32])  # as a sha256 worker reports
    router.index.apply("decode-1", BlockStored(tuple(hashes), None, tuple(prompt[:32]), 4,
                                               tuple(range(len(hashes)))))
    assert router.choose(prompt).num_cached_blocks == 8


def test_decider_skips_short_uncached_part() -> None:
    router = _router(pd_threshold_tokens=16)
    prompt = list(range(40))
    assert router.choose(prompt[:12]).reason == "short_prompt"
    assert router.choose(prompt).prefill is not None
    _store(router, "decode-0", prompt[:32])
    _store(router, "decode-1", prompt[:32])
    decision = router.choose(prompt)  # 8 uncached tokens left on the decode worker
    assert decision.prefill is None and decision.num_cached_blocks == 8


def test_no_decode_worker_is_an_error_and_down_workers_get_nothing() -> None:
    router = _router()
    router.mark_down("prefill-0")
    router.mark_down("prefill-1")
    assert router.choose(list(range(100))).reason == "no_prefill_worker"
    router.mark_down("decode-0")
    router.mark_down("decode-1")
    with pytest.raises(LookupError):
        router.choose([1, 2, 3])


# ---- DP: whole engines (Router.pick) ------------------------------------------------------------
def _replicas(num_replicas: int = 2, block_size: int = 4) -> Router:
    workers = [(f"replica-{i}", COLOCATED, f"http://r{i}") for i in range(num_replicas)]
    router = Router(workers, Settings(), block_size=block_size)
    for worker in router.workers.values():
        worker.is_up = True
        router.index.add_instance(worker.name)
    return router


def test_pick_follows_the_prefix_then_spreads_by_load() -> None:
    router = _replicas()
    prompt = list(range(40))
    _store(router, "replica-1", prompt[:32])
    pick = router.pick(COLOCATED, prompt)
    assert (pick.worker.name, pick.reason, pick.num_cached_blocks) == ("replica-1", "prefix", 8)
    other = router.pick(COLOCATED, list(range(100, 120)))  # no prefix: replica-1 has one in flight
    assert (other.worker.name, other.reason) == ("replica-0", "load")
    third = router.pick(COLOCATED, list(range(200, 220)))  # equal load, equal picks: the first
    assert third.worker.name == "replica-0"
    assert [w.num_in_flight for w in router.workers.values()] == [2, 1]
    for name in ("replica-1", "replica-0", "replica-0"):
        router.done(name)
    assert [w.num_in_flight for w in router.workers.values()] == [0, 0]


def test_ties_alternate_and_load_beats_a_small_overlap() -> None:
    router = _replicas()
    names = []
    for i in range(4):  # idle replicas: ties go to the one picked least
        pick = router.pick(COLOCATED, [1000 + i])
        router.done(pick.worker.name)
        names.append(pick.worker.name)
    assert names == ["replica-0", "replica-1", "replica-0", "replica-1"]
    prompt = list(range(40))  # 10 blocks, 1 of them on replica-0 (score 0.1 - 0.5 < 0)
    _store(router, "replica-0", prompt[:4])
    router.workers["replica-0"].num_running = 3  # polled load counts as well as in-flight
    assert router.pick(COLOCATED, prompt).worker.name == "replica-1"


def test_remember_routes_a_repeated_prefix_before_any_kv_event() -> None:
    router = _replicas()
    prompt = list(range(64))
    first = router.pick(COLOCATED, prompt, remember=True)
    router.done(first.worker.name)  # without the prefix, the tie would go to the other one
    again = router.pick(COLOCATED, prompt[:48] + [7, 7, 7, 7], remember=True)
    assert again.worker.name == first.worker.name and again.reason == "prefix"
    assert again.num_cached_blocks == 12
    salted = router.pick(COLOCATED, prompt, "tenant-b")  # another salt shares no block
    assert salted.reason == "load"


def test_no_replica_up_is_a_lookup_error() -> None:
    router = _replicas()
    router.mark_down("replica-0")
    assert router.pick(COLOCATED, [1, 2, 3]).worker.name == "replica-1"
    router.mark_down("replica-1")
    with pytest.raises(LookupError, match="no colocated worker is up"):
        router.pick(COLOCATED, [1, 2, 3])


# ---- the wire: KV events and the state reply ----------------------------------------------------
def _kv_with_a_request() -> tuple[KVCacheManager, EventLog]:
    """8 blocks of 4 tokens and their event log, after request "a" committed 9 tokens (two
    full blocks stored: one event)."""
    kv = KVCacheManager(8, 4)
    log = EventLog(kv)
    kv.match_prefix("a", list(range(9)))
    kv.try_allocate("a", 9)
    kv.commit("a", list(range(9)))
    return kv, log


def test_event_json_round_trip() -> None:
    _, log = _kv_with_a_request()
    first, last, events = log.since(0)
    assert (first, last) == (1, 1)
    stored = event_from_json(events[0])
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 2
    assert log.since(last)[2] == []


def _stats(kv: KVCacheManager, num_running: int) -> EngineStats:
    return EngineStats(num_steps=0, num_computed_prompt_tokens=0, num_generated_tokens=0,
                       num_preemptions=0, num_waiting=1, num_running=num_running, kv=kv.stats())


def test_the_router_reads_what_state_reply_says() -> None:
    """``state_reply`` (every worker's state route) and ``Router.poll`` agree on the wire."""
    kv, events = _kv_with_a_request()
    incarnation = ["one"]

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/dp/state" and request.headers["authorization"] == "Bearer s"
        since = int(request.url.params["since"])
        reply = state_reply("replica-0", COLOCATED, incarnation[0], alive=True,
                            stats=_stats(kv, 2), events=events, since=since, extra_field=7)
        return httpx.Response(200, json=json.loads(json.dumps(reply)))

    router = Router([("replica-0", COLOCATED, "http://r0")], Settings(), block_size=4,
                    secret="s", state_path="/dp/state")
    router._client = httpx.Client(transport=httpx.MockTransport(handler),  # no sockets
                                  headers=router._client.headers)
    router.poll_all()
    worker = router.workers["replica-0"]
    assert worker.is_up and (worker.num_running, worker.num_waiting, worker.seq) == (2, 1, 1)
    assert worker.kv_usage == pytest.approx(3 / 8) and worker.limits is None  # 9 tokens
    assert router.pick(COLOCATED, list(range(9))).num_cached_blocks == 2
    incarnation[0] = "two"  # restarted: its blocks are forgotten, then re-learned from seq 1
    router.poll_all()
    assert worker.incarnation == "two" and worker.seq == 1
    router.close()


def test_a_worker_without_events_reports_none() -> None:
    stats = _stats(KVCacheManager(8, 4), 0)
    reply = state_reply("prefill-0", "prefill", "i", alive=True, stats=stats, events=None,
                        since=5, num_pinned=0)
    assert (reply["first_seq"], reply["last_seq"], reply["events"]) == (1, 0, [])
    assert "limits" not in reply and reply["num_pinned"] == 0


# ---- a worker's life ----------------------------------------------------------------------------
def test_the_secret_is_taken_out_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KTHENA_PD_SECRET", "s3cret")
    assert take_secret() == "s3cret" and "KTHENA_PD_SECRET" not in os.environ
    monkeypatch.setenv("KTHENA_PD_SECRET", "")
    assert take_secret() is None


def test_pinning_sets_openmp_for_each_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = owned_cores()  # pin to what this process has already: nothing changes for pytest
    monkeypatch.setenv("OMP_NUM_THREADS", "99")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert pin_to_cores(",".join(map(str, cores))) == len(cores)
    assert os.environ["OMP_NUM_THREADS"] == str(len(cores))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert pin_to_cores("", num_ranks=len(cores) + 1) == 1  # at least one thread per rank


def test_the_ready_file_is_whole_and_an_orphan_tidies_it(tmp_path: Path) -> None:
    folder = tmp_path / "kthena-workers-x"
    folder.mkdir()
    first, second = folder / "a.port", folder / "b.port"
    write_ready_file(str(first), 8123)
    write_ready_file(str(second), 8124)
    write_ready_file(None, 1)  # no ready file asked for: nothing
    assert first.read_text() == "8123" and sorted(p.name for p in folder.iterdir()) == \
        ["a.port", "b.port"]  # no .tmp left behind
    remove_ready_file(str(first))  # another worker's file is still there: the folder stays
    assert folder.is_dir() and not first.exists()
    remove_ready_file(str(second))  # the last one takes the launcher's folder with it
    assert not folder.exists()
    remove_ready_file(str(second))  # gone already: fine
    remove_ready_file(None)


def test_a_worker_pins_itself_before_torch_loads() -> None:
    """What a worker imports before ``pin_to_cores`` must not load torch (OpenMP reads its
    environment once, when torch loads)."""
    code = ("import sys, kthena_serve.cluster.worker, kthena_serve.pd.worker, "
            "kthena_serve.dp.replica; print(sorted(m for m in sys.modules if m == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
