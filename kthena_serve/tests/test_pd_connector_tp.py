"""The Kthena connector path (``kv_transfer_params``) with TP workers on one host (shm).

Two deployments of test_pd_tp.py's tiny fp32 checkpoint (3 KV heads: 2 + 1 over two ranks)
share one secret: a TP2 prefill and a TP2 decode worker, and a tp=1 pair. A decode worker
pulls from whichever prefill worker the router's params name (loopback is a prefill host), so
the two deployments give the pairs 2:2, 1:2 and 2:1. Each gets the router's exact request
sequence (``_kthena_proxy``); transformers gives the reference tokens.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _kthena_proxy import decode_body, prefill_body, proxy
from _support import eventually
from test_pd_connector import metric, shm_files, state
from test_pd_tp import (  # noqa: F401 - checkpoint: a fixture
    ENGINE,
    TOP,
    _check,
    _descendants,
    _prompt,
    checkpoint,
    colocated_logprobs,
    greedy_transformers,
)

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.launcher import PDLauncher

PD = {"kv_pin_timeout_s": 8.0, "transfer_timeout_s": 30}
NEW_TOKENS = 6
# (prefill deployment, decode deployment): the TP sizes of the pair
PAIRS = {"2:2": ("tp2", "tp2"), "1:2": ("tp1", "tp2"), "2:1": ("tp2", "tp1")}
# per pair: a 3-block prompt, then one sharing its first 2 blocks (a decode-side prefix hit)
PROMPTS = {f"{pair} {kind}": ids for pair in PAIRS for kind, ids in (
    ("first", _prompt(40, f"{pair} first: ")),
    ("hit", _prompt(40, f"{pair} first: ")[:32] + _prompt(12, f"{pair} tail: ")))}
PULLED = 'kthena_pd_requests_total{path="pulled"'
RECOMPUTED = 'kthena_pd_requests_total{path="recomputed"'


@pytest.fixture(scope="module")
def deployments(checkpoint):  # noqa: ANN001, F811
    """{"tp2": TP2 prefill + TP2 decode, "tp1": tp=1 prefill + decode};
    afterwards no /dev/shm file of any of their processes (ranks included) is left."""
    engine = EngineConfig(model=str(checkpoint), **ENGINE)
    launchers = {"tp2": PDLauncher(engine, PDConfig(**PD, prefill_tp=2, decode_tp=2), 1, 1,
                                   quiet=True),
                 "tp1": PDLauncher(engine, PDConfig(**PD), 1, 1, quiet=True)}
    launchers["tp1"].secret = launchers["tp2"].secret  # leases across them are signed with it
    pids: set[int] = set()
    try:
        for launcher in launchers.values():  # from this thread: a worker dies with its parent's
            launcher.start()
            for name in launcher.workers:
                pids |= _descendants(launcher.pid(name))
        yield launchers
    finally:
        with ThreadPoolExecutor(len(launchers)) as pool:  # each waits for its workers to stop
            list(pool.map(PDLauncher.stop, launchers.values()))
    assert not shm_files(sorted(pids))  # every rank's pool and segment unlinked


@pytest.fixture(scope="module")
def references(checkpoint) -> tuple[dict, dict]:  # noqa: ANN001, F811
    """(greedy tokens from transformers, top logprobs from a colocated engine) per prompt:
    the tokens alone may not show a head copied into the wrong slot, the runners-up do."""
    return (greedy_transformers(checkpoint, PROMPTS, NEW_TOKENS),
            colocated_logprobs(checkpoint, PROMPTS, NEW_TOKENS))


def _held(prefill: PDLauncher, decode: PDLauncher) -> tuple[int, int, int, int]:
    """(prefill used blocks, pins; decode used blocks, quarantined), once all are 0 or after
    10 s (a release is a message to the compute thread)."""
    def now() -> tuple[int, int, int, int]:
        p, d = state(prefill, "prefill-0"), state(decode, "decode-0")
        return (p["kv"]["num_used_blocks"], p["num_pinned"], d["kv"]["num_used_blocks"],
                d["num_quarantined"])
    eventually(lambda: not any(now()), 10, interval_s=0.1)
    return now()


@pytest.mark.parametrize("pair", list(PAIRS))
def test_tp_pairs_pull_and_match_transformers(deployments, references, pair: str) -> None:  # noqa: ANN001
    """The router's sequence between a prefill and a decode worker of these TP sizes: the
    prefill answer carries its tp_size, the decode worker copies the pinned blocks' heads
    into its ranks (only the tail on a prefix hit), greedy fp32 tokens equal transformers'
    and the top logprobs a colocated engine's, and afterwards no pin and no block is held."""
    prefill, decode = (deployments[side] for side in PAIRS[pair])
    prefill_url, decode_url = prefill.url("prefill-0"), decode.url("decode-0")
    pulled, recomputed = (metric(decode, "decode-0", series) for series in (PULLED, RECOMPUTED))
    with httpx.Client(timeout=120) as client:
        for kind in ("first", "hit"):
            body = {"model": "default", "prompt": PROMPTS[f"{pair} {kind}"],
                    "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": TOP}
            exchange = proxy(client, "/v1/completions", body, prefill_url, decode_url)
            assert exchange.prefill.status_code == 200, exchange.prefill.text
            params = exchange.kv_transfer_params
            assert params["tp_size"] == int(pair[0]) and len(params["remote_block_ids"]) == 3
            cached = _check(exchange.decode, f"{pair} {kind}", *references, NEW_TOKENS)
    assert cached >= 32  # the hit's first 2 blocks were kept: only its tail was copied
    assert metric(decode, "decode-0", PULLED) - pulled == 2  # neither recomputed
    assert metric(decode, "decode-0", RECOMPUTED) == recomputed
    assert _held(prefill, decode) == (0, 0, 0, 0)


def test_a_tp_size_other_than_the_workers_is_refused(deployments) -> None:  # noqa: ANN001
    """tp_size must be the prefill worker's own: on the prefill request, and on the decode
    request (checked against the prefill worker's lease); the genuine request still pulls."""
    tp2 = deployments["tp2"]
    prefill_url, decode_url = tp2.url("prefill-0"), tp2.url("decode-0")
    body = {"model": "default", "prompt": _prompt(20, "refused sizes: "), "max_tokens": 3,
            "temperature": 0}
    with httpx.Client(timeout=120) as client:
        for size, why in ((1, "tp_size=1, but this prefill worker is a TP2 engine"),
                          ("two", "a TP size is an int in 1..")):
            asked = prefill_body(body)
            asked["kv_transfer_params"]["tp_size"] = size
            reply = client.post(f"{prefill_url}/v1/completions", json=asked)
            assert reply.status_code == 400 and why in reply.text, reply.text
        params = client.post(f"{prefill_url}/v1/completions",
                             json=prefill_body(body)).json()["kv_transfer_params"]
        for size, why in ((1, "tp_size=1, but the prefill worker at"), (0, "a TP size")):
            reply = client.post(f"{decode_url}/v1/completions",
                                json=decode_body(body, {**params, "tp_size": size}))
            assert reply.status_code == 400 and why in reply.text, reply.text
            assert reply.json()["error"]["param"] == "kv_transfer_params"
        genuine = client.post(f"{decode_url}/v1/completions", json=decode_body(body, params))
        assert genuine.status_code == 200, genuine.text
    assert _held(tp2, tp2) == (0, 0, 0, 0)


def test_a_lease_without_rank_pools_or_of_another_geometry_is_refused(checkpoint) -> None:  # noqa: ANN001, F811
    """What a decode worker reads from a lease before it copies anything (no processes): the
    prefill's TP size, one pool name per rank, and rank 0's geometry; a pool that is gone
    fails the copy (a failed pull: the policy decides)."""
    from kthena_serve.model.config import ModelConfig
    from kthena_serve.pd.protocol import PoolRef
    from kthena_serve.pd.rank_pull import RankPull
    from kthena_serve.pd.reshard import RankPools, rank_layouts
    from mooncake_kv.pool import KVPool, PoolNotFoundError

    model, config = ModelConfig.from_pretrained(checkpoint), EngineConfig(model=str(checkpoint),
                                                                          **ENGINE)
    shape = PoolRef(4, config.block_size, config.dtype, tp=2, rank_shm_names=("r0", "r1"))
    own = [KVPool.create(layout) for layout in rank_layouts(model, config, shape)]
    ranks = RankPull(RankPools(own, owned=own), model, config)
    try:
        rank0 = own[0].layout
        good = {"tp": 2, "rank_shm_names": ["gone-0", "gone-1"], "num_blocks": 4,
                "fingerprint": rank0.shape.fingerprint(), "kind": rank0.kind.value}
        source = ranks.source(good)
        assert (source.tp, source.rank_names()) == (2, ("gone-0", "gone-1"))
        for bad, why in (({**good, "tp": "2"}, "is not a TP size"),
                         ({**good, "tp": 0}, "is not a TP size"),
                         ({**good, "rank_shm_names": ["gone-0"]}, "for each of its 2 rank"),
                         ({**good, "rank_shm_names": None}, "--pd-transport shm"),
                         ({**good, "tp": 1, "rank_shm_names": ["gone-0"]},  # H2 is no
                          "blocks are L2-H2-.*TP1 worker of this deployment's L2-H3"),  # tp=1 pool
                         ({**good, "fingerprint": "L2-H3-D16-B16-fp32"}, "same model")):
            with pytest.raises(ValueError, match=why):
                ranks.source(bad)
        with pytest.raises(PoolNotFoundError, match="gone-0"):
            ranks.copy(source, [0], [1])
    finally:
        ranks.close()
