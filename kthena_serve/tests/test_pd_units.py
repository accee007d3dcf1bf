"""PD pieces without processes: core split, control messages, router scoring and decider."""

from __future__ import annotations

import pytest

from kthena_serve.pd.config import PDConfig, RouterWeights
from kthena_serve.pd.events import event_from_json
from kthena_serve.pd.launcher import split_cores
from kthena_serve.pd.protocol import (
    PoolRef,
    PrefillTask,
    output_from_json,
    output_to_json,
    params_from_json,
    params_to_json,
)
from kthena_serve.pd.router import Router
from kthena_serve.request import FinishReason, RequestOutput
from kthena_serve.sampling_params import SamplingParams
from mooncake_kv import BlockHasher, BlockStored


def test_split_cores_disjoint_then_shared() -> None:
    specs = split_cores([0, 1, 2, 3, 4], 1, 2)
    assert [s.cores for s in specs] == [(0, 1), (2, 3), (4,)]
    assert [s.role for s in specs] == ["prefill", "decode", "decode"]
    shared = split_cores([0], 1, 1)
    assert [s.cores for s in shared] == [(0,), (0,)]
    with pytest.raises(ValueError):
        split_cores([0], 0, 0)


def test_messages_round_trip() -> None:
    params = SamplingParams(temperature=0.5, seed=3, stop=["x"], max_tokens=7)
    assert params_from_json(params_to_json(params)) == params
    task = PrefillTask("r", (1, 2, 3), 0, (5,), params_to_json(params), PoolRef(8, 16, "bfloat16",
                       "mooncake_kv.1.ab"))
    assert PrefillTask.from_json(task.to_json()) == task
    out = RequestOutput("r", (1,), "a", (1,), "a", FinishReason.STOP, 3, 0, 1.0, 2.0, 3.0)
    assert output_from_json(output_to_json(out)) == out


def _router(**pd) -> Router:
    workers = [("prefill-0", "prefill", "http://p0"), ("prefill-1", "prefill", "http://p1"),
               ("decode-0", "decode", "http://d0"), ("decode-1", "decode", "http://d1")]
    router = Router(workers, PDConfig(**pd), block_size=4)
    for worker in router.workers.values():
        worker.is_up = True
        router.index.add_instance(worker.name)
    return router


def _store(router: Router, name: str, tokens: list[int]) -> None:
    hashes = BlockHasher(4).hash_tokens(tokens)
    event = BlockStored(tuple(hashes), None, tuple(tokens[: 4 * len(hashes)]), 4,
                        tuple(range(len(hashes))))
    router.index.apply(name, event)


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


def test_event_json_round_trip() -> None:
    from kthena_serve.pd.events import EventLog
    from mooncake_kv import KVCacheManager

    kv = KVCacheManager(8, 4)
    log = EventLog(kv)
    kv.match_prefix("a", list(range(9)))
    kv.try_allocate("a", 9)
    kv.commit("a", list(range(9)))
    first, last, events = log.since(0)
    assert (first, last) == (1, 1)
    stored = event_from_json(events[0])
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 2
    assert log.since(last)[2] == []
