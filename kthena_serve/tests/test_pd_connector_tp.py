"""The Kthena connector path (``kv_transfer_params``) with TP workers: on one host (shm), and
over Mooncake on 127.0.0.1.

Two deployments of test_pd_tp.py's tiny fp32 checkpoint (3 KV heads: 2 + 1 over two ranks)
share one secret: a TP2 prefill and a TP2 decode worker, and a tp=1 pair. A decode worker
pulls from whichever prefill worker the router's params name (loopback is a prefill host), so
the two deployments give the pairs 2:2, 1:2 and 2:1. Each gets the router's exact request
sequence (``_kthena_proxy``); transformers gives the reference tokens. Over
``--pd-transport mooncake`` two more (a TP2 pair, a tp=1 prefill worker alone) give 2:2 and
1:2, each decode worker getting the heads over Mooncake (``rank_pull.RankGet``).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
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

mooncake_installed = pytest.mark.skipif(  # a mark: the shm tests run without the wheel
    importlib.util.find_spec("mooncake") is None,
    reason="the mooncake wheel (and libibverbs1) is missing")

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
    _pull_a_pair(*(deployments[side] for side in PAIRS[pair]), pair, references)


def _pull_a_pair(prefill: PDLauncher, decode: PDLauncher, pair: str, references) -> None:  # noqa: ANN001
    """A prompt, then a prefix hit, through the router's sequence between ``prefill`` and
    ``decode``: each answer's tp_size is the prefill worker's, the hit moves only its tail, the
    tokens and logprobs are the references', both are pulled, and nothing is held after."""
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
    assert cached >= 32  # the hit's first 2 blocks were kept: only its tail was moved
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


# ---- over --pd-transport mooncake ----------------------------------------------------------
MOONCAKE_PAIRS = {"2:2": ("tp2", "tp2"), "1:2": ("tp1", "tp2")}  # prompts: the shm pairs'


@pytest.fixture(scope="module")
def mooncake_deployments(checkpoint):  # noqa: ANN001, F811
    """{"tp2": TP2 prefill + TP2 decode, "tp1": a tp=1 prefill worker alone}, both over
    --pd-transport mooncake on 127.0.0.1 with one secret; afterwards no /dev/shm file of any
    of their processes (ranks included) is left."""
    engine = EngineConfig(model=str(checkpoint), **ENGINE)
    pd = {**PD, "transport": "mooncake"}
    launchers = {"tp2": PDLauncher(engine, PDConfig(**pd, prefill_tp=2, decode_tp=2), 1, 1,
                                   quiet=True),
                 "tp1": PDLauncher(engine, PDConfig(**pd), 1, 0, quiet=True)}
    launchers["tp1"].secret = launchers["tp2"].secret
    pids: set[int] = set()
    try:
        for launcher in launchers.values():
            launcher.start()
            for name in launcher.workers:
                pids |= _descendants(launcher.pid(name))
        yield launchers
    finally:
        with ThreadPoolExecutor(len(launchers)) as pool:
            list(pool.map(PDLauncher.stop, launchers.values()))
    assert not shm_files(sorted(pids))


@mooncake_installed
@pytest.mark.parametrize("pair", list(MOONCAKE_PAIRS))
def test_tp_pairs_get_over_mooncake_and_match_transformers(mooncake_deployments, references,  # noqa: ANN001
                                                           pair: str) -> None:
    """The router's sequence over --pd-transport mooncake: the lease names each prefill
    rank's Mooncake handle, the decode worker gets the pinned blocks' heads into its ranks
    (only the tail on a prefix hit), greedy fp32 tokens equal transformers' and the top
    logprobs a colocated engine's, and afterwards no pin and no block is held."""
    _pull_a_pair(*(mooncake_deployments[side] for side in MOONCAKE_PAIRS[pair]), pair,
                 references)


@contextlib.contextmanager
def _rank_get(checkpoint, src_tp: int, dst_tp: int, num_blocks: int,  # noqa: ANN001, F811
              timeout_s: float) -> Iterator[tuple]:
    """In one process, a prefill instance's rank pools (random bytes) and two copies of a
    decode instance's, each side's registered with its own Mooncake engine on 127.0.0.1:
    (the prefill pools, the decode pools a same-host copy writes, the decode pools a
    ``RankGet`` gets into, that ``RankGet``, the lease a prefill worker would answer)."""
    import torch

    from kthena_serve.model.config import ModelConfig
    from kthena_serve.pd.protocol import PoolRef
    from kthena_serve.pd.rank_pull import RankGet
    from kthena_serve.pd.reshard import RankPools, rank_layouts
    from kthena_serve.pd.transfer import register_pool
    from mooncake_kv.pool import KVPool

    model, config = ModelConfig.from_pretrained(checkpoint), EngineConfig(model=str(checkpoint),
                                                                          **ENGINE)

    def pools(tp: int) -> RankPools:
        ref = PoolRef(num_blocks, config.block_size, config.dtype, tp=tp)
        made = [KVPool.create(layout) for layout in rank_layouts(model, config, ref)]
        return RankPools(made, owned=made)

    src, copied, got = pools(src_tp), pools(dst_tp), pools(dst_tp)
    engines, handles = [], []
    try:
        for pool in src.pools:
            pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
        for ranks in (src, got):
            engine, first = register_pool(ranks.pools[0], "127.0.0.1", 10)
            engines.append(engine)
            handles.append([first, *(engine.register(p.buffer) for p in ranks.pools[1:])])
        rank_get = RankGet(engines[1], handles[1], [p.layout for p in got.pools], model,
                           config, timeout_s)
        rank0 = src.pools[0].layout
        lease = {"tp": src_tp, "rank_mooncake_handles": [h.to_dict() for h in handles[0]],
                 "num_blocks": num_blocks, "fingerprint": rank0.shape.fingerprint(),
                 "kind": rank0.kind.value}
        yield src, copied, got, rank_get, lease
    finally:
        for engine in engines:
            engine.close()
        for ranks in (src, copied, got):
            ranks.close()


@mooncake_installed
def test_a_rank_get_writes_what_the_copy_writes(checkpoint) -> None:  # noqa: ANN001, F811
    """TP2 -> TP1 (2:2 and 1:2: the deployments): ``RankGet`` reads the lease a prefill
    worker answers over mooncake (one handle per rank; none: refused, naming the transport)
    and leaves the decode pool byte for byte as the same-host copy does; ids out of range are
    raised once every get has ended, and nothing is left running."""
    import torch

    from kthena_core.shape import kv_head_moves
    from kthena_serve.pd.reshard import copy_resharded
    from mooncake_kv.layout import BlockIdError

    with _rank_get(checkpoint, 2, 1, 6, 10) as (src, copied, got, rank_get, lease):
        src_ids, dst_ids = [1, 2, 5], [4, 0, 3]
        moved = copy_resharded(src, copied, kv_head_moves(3, 2, 1), src_ids, dst_ids)
        for bad in ({**lease, "rank_mooncake_handles": None},
                    {**lease, "rank_mooncake_handles": lease["rank_mooncake_handles"][:1]}):
            with pytest.raises(ValueError, match="--pd-transport mooncake"):
                rank_get.source(bad)
        source = rank_get.source(lease)
        assert rank_get.copy(source, src_ids, dst_ids) == moved
        for want, have in zip(copied.pools, got.pools, strict=True):
            assert torch.equal(want.buffer, have.buffer)
        with pytest.raises(BlockIdError, match="block id 6 is outside"):
            rank_get.copy(source, [0, 1], [3, 6])
        assert not rank_get.busy()


@mooncake_installed
def test_a_rank_get_past_its_deadline_is_busy_until_its_bytes_have_landed(checkpoint) -> None:  # noqa: ANN001, F811
    """TP2 -> TP2, 96 blocks in reverse order (a range each: they outlive any deadline of
    0 s): ``copy`` raises the timeout with its gets under way, and ``busy`` is True until every
    get has ended (the decode worker's quarantine frees the blocks only after that,
    ``DecodeConnector._quarantine``); by then each decode rank's pool is byte for byte what
    the same-host copy writes: nothing lands later."""
    import torch
    from _support import eventually

    from kthena_comm.errors import TransferTimeoutError
    from kthena_core.shape import kv_head_moves
    from kthena_serve.pd.reshard import copy_resharded

    with _rank_get(checkpoint, 2, 2, 96, 0.0) as (src, copied, got, rank_get, lease):
        src_ids = list(range(96))
        dst_ids = src_ids[::-1]
        copy_resharded(src, copied, kv_head_moves(3, 2, 2), src_ids, dst_ids)
        with pytest.raises(TransferTimeoutError):
            rank_get.copy(rank_get.source(lease), src_ids, dst_ids)
        assert rank_get.busy()  # may still write: the blocks stay quarantined
        assert eventually(lambda: not rank_get.busy(), 30, interval_s=0.01)
        for want, have in zip(copied.pools, got.pools, strict=True):
            assert torch.equal(want.buffer, have.buffer)
