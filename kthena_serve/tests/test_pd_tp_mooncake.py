"""PD between TP instances across hosts (``--pd-transport mooncake``, on 127.0.0.1): each
prefill rank's KV heads put over the Mooncake Transfer Engine into the decode ranks that own
them (pd/reshard_put.py), re-sharded between TP sizes.

The checkpoint, the prompts and the transformers reference are test_pd_tp.py's (SmolLM2's
uneven head split: 3 KV heads, 2 + 1 over two ranks); three prompts keep it cheap.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _support import metric_value
from _tiny import default_tokenizer
from test_pd_tp import (  # noqa: F401 - checkpoint, transformers_tokens: fixtures
    ENGINE,
    HEADS,
    NEW_TOKENS,
    PROMPTS,
    _descendants,
    checkpoint,
    transformers_tokens,
)

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster, shm_pools

pytest.importorskip("mooncake.engine", reason="the mooncake wheel (and libibverbs1) is missing")

NUM_LAYERS = 2  # tiny_checkpoint's


def _kv_bytes(num_tokens: int, block_size: int) -> int:
    """The whole model's K/V of a prompt's blocks (fp32): what its hand-off must put."""
    num_blocks = -(-num_tokens // block_size)
    return (num_blocks * NUM_LAYERS * 2 * block_size * HEADS["num_key_value_heads"]
            * HEADS["head_dim"] * 4)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1)])
def test_tp_instances_hand_kv_off_over_mooncake(checkpoint: Path, transformers_tokens,  # noqa: ANN001, F811
                                                prefill_tp: int, decode_tp: int) -> None:
    """``--pd-transport mooncake --prefill-tp 2 --decode-tp B``: greedy tokens equal
    transformers' (fp32); the decode pool is named by Mooncake handles only (no /dev/shm name
    a prefill worker could copy into), and the bytes put are exactly the KV of the blocks the
    decode worker lacked (a prefix hit: the tail only); no rank's pool is left in /dev/shm."""
    pd = PDConfig(transport="mooncake", pd_threshold_tokens=8, transfer_timeout_s=60,
                  health_interval_s=0.2, prefill_tp=prefill_tp, decode_tp=decode_tp)
    config = EngineConfig(model=str(checkpoint), **ENGINE)
    cluster = PDCluster(config, pd).start()
    pids: set[int] = set()
    try:
        for name in cluster.launcher.workers:
            pids |= _descendants(cluster.launcher.pid(name))
        pool = cluster.worker_state("decode-0")["pool"]
        assert pool["tp"] == decode_tp
        assert pool["shm_name"] is None and not pool["rank_shm_names"]
        assert len(pool["rank_mooncake_handles"]) == (decode_tp if decode_tp > 1 else 0)
        want = 0  # the blocks each prompt's decode worker lacked, all of the model's heads
        for name in ("short", "long", "prefix"):  # "prefix": a decode-side hit, the tail put
            reply = cluster.complete(PROMPTS[name], max_tokens=NEW_TOKENS)
            assert reply.status_code == 200, reply.text
            body = reply.json()
            text = body["choices"][0]["text"]
            assert text == default_tokenizer().decode(transformers_tokens[name]), name
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= (496 if name == "prefix" else 0)  # 31 of 32 shared blocks
            want += (_kv_bytes(len(PROMPTS[name]), config.block_size)
                     - _kv_bytes(cached, config.block_size))
        put = metric_value(cluster.worker_metrics("prefill-0"), "kthena_pd_transferred_bytes_total")
        assert put == want
        decode = cluster.worker_metrics("decode-0")
        assert metric_value(decode, "kthena_pd_requests_total", path="disaggregated") == 3
    finally:
        cluster.stop()
    left = [p for p in shm_pools() for pid in pids if f".{pid}." in os.path.basename(p)]
    assert not left  # every rank's pool unlinked


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 2), (1, 2), (2, 1)])
def test_a_reshard_put_writes_what_the_copy_writes(src_tp: int, dst_tp: int) -> None:
    """In one process, two Mooncake engines on 127.0.0.1: ``ReshardPut`` leaves every decode
    rank's pool byte for byte as the same-host copy does, counts its bytes, and has settled
    when ``finish`` returns; ids out of range are raised after every session settled."""
    import torch
    from test_pd_reshard import _pools

    from kthena_core.shape import kv_head_moves
    from kthena_serve.pd.reshard import copy_resharded
    from kthena_serve.pd.reshard_put import ReshardPut
    from kthena_serve.pd.transfer import PushSession, register_pool
    from mooncake_kv.layout import BlockIdError

    config = EngineConfig(dtype="float32", block_size=4, num_kv_blocks=12)
    src, copied, put = _pools(3, src_tp, config), _pools(3, dst_tp, config), _pools(3, dst_tp, config)
    engines = []
    try:
        for pool in src.pools:
            pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
        moves = kv_head_moves(3, src_tp, dst_tp)
        src_ids, dst_ids = [1, 2, 5], [7, 0, 3]
        moved = copy_resharded(src, copied, moves, src_ids, dst_ids)
        handles = []
        for ranks in (src, put):
            engine, first = register_pool(ranks.pools[0], "127.0.0.1", 10)
            engines.append(engine)
            handles.append([first, *(engine.register(p.buffer) for p in ranks.pools[1:])])

        def push() -> ReshardPut:
            return ReshardPut([(move, PushSession(
                engines[0], handles[0][move.src_rank], src.pools[move.src_rank].layout,
                handles[1][move.dst_rank], put.pools[move.dst_rank].layout, 10,
                layerwise=False)) for move in moves])

        done = push()
        assert done.finish(src_ids, dst_ids) == moved
        assert done.settled()
        for want, got in zip(copied.pools, put.pools, strict=True):
            assert torch.equal(want.buffer, got.buffer)
        bad = push()
        with pytest.raises(BlockIdError, match="block id 12 is outside this pool"):
            bad.finish([0, 1], [3, 12])
        assert bad.settled()
    finally:
        for engine in engines:
            engine.close()
        for pools in (src, copied, put):
            pools.close()


_PRIVATE_NETNS = "KTHENA_TEST_PRIVATE_NETNS"


def test_a_reshard_put_past_its_deadline_stays_unsettled_until_its_bytes_have_landed(
        tmp_path: Path) -> None:
    """In one process, two Mooncake engines on 127.0.0.1: a TP2 -> TP2 ``ReshardPut`` (two
    head moves, one ``PushSession`` each) whose deadline passes at once (timeout 0) raises the
    timeout with its puts under way; ``settled()`` is then False, and the decode worker's
    release condition (pd/decode.py ``_settle_and_release``: the prefill worker no longer
    writing, ``PrefillExecutor.cancel`` over ``settled()``, and ``LateWrites.drained``) first
    holds once every decode rank's pool is byte for byte what the same-host copy writes: no
    byte of it can land in blocks handed out again.

    It runs in a network namespace of its own (``unshare --net``, this test again in a fresh
    pytest): a failed put settles only once no socket of this process to the decode host, and
    no orphan of any process to it, holds a byte (tcp_queues.py), and on a shared loopback the
    suite's other servers keep such sockets open."""
    if os.environ.get(_PRIVATE_NETNS) != "1":
        import shutil
        import subprocess
        import sys

        if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
            pytest.skip("needs root, unshare and ip for a network namespace of its own")
        test = f"{__file__}::test_a_reshard_put_past_its_deadline_stays_unsettled_until_its_" \
               "bytes_have_landed"
        done = subprocess.run(
            ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
             sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:randomly",
             "-p", "no:cacheprovider", "-q", f"--junitxml={tmp_path / 'run.xml'}", test],
            env={**os.environ, _PRIVATE_NETNS: "1"}, capture_output=True, text=True,
            timeout=300, check=False)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        import xml.etree.ElementTree as ET

        suite = ET.parse(tmp_path / "run.xml").getroot().find("testsuite")
        assert (suite.get("tests"), suite.get("skipped"), suite.get("failures")) == ("1", "0", "0")
        return
    import torch
    from _support import eventually
    from test_pd_reshard import _pools

    from kthena_comm.errors import TransferTimeoutError
    from kthena_core.shape import kv_head_moves
    from kthena_serve.pd.late_writes import LateWrites
    from kthena_serve.pd.reshard import copy_resharded
    from kthena_serve.pd.reshard_put import ReshardPut
    from kthena_serve.pd.transfer import PushSession, register_pool

    # ~4 MiB over two moves: a loopback put of it outlives a deadline of 0 s on any machine
    config = EngineConfig(dtype="float32", block_size=256, num_kv_blocks=40)
    src, copied, put = _pools(3, 2, config), _pools(3, 2, config), _pools(3, 2, config)
    engines = []
    try:
        for pool in src.pools:
            pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
        moves = kv_head_moves(3, 2, 2)
        src_ids = list(range(config.num_kv_blocks))
        dst_ids = src_ids[::-1]
        copy_resharded(src, copied, moves, src_ids, dst_ids)
        handles = []
        for ranks in (src, put):
            engine, first = register_pool(ranks.pools[0], "127.0.0.1", 10)
            engines.append(engine)
            handles.append([first, *(engine.register(p.buffer) for p in ranks.pools[1:])])
        push = ReshardPut([(move, PushSession(
            engines[0], handles[0][move.src_rank], src.pools[move.src_rank].layout,
            handles[1][move.dst_rank], put.pools[move.dst_rank].layout, 0.0,
            layerwise=False)) for move in moves])

        def landed() -> bool:
            return all(torch.equal(want.buffer, got.buffer)
                       for want, got in zip(copied.pools, put.pools, strict=True))

        with pytest.raises(TransferTimeoutError):  # it gave up with its puts under way
            push.finish(src_ids, dst_ids)
        late = LateWrites("127.0.0.1")  # the decode side's view, made as the hand-off fails
        assert not push.settled()  # may still be writing: /pd/cancel answers busy

        def releasable() -> bool:  # the decode worker's release condition, as it checks it
            return push.settled() and late.drained(True)

        assert eventually(releasable, 30, interval_s=0.01), "never settled"
        assert landed()  # every put had ended before the blocks could be handed out again
        assert all(session.settled() for _move, session in push.moves)
    finally:
        for engine in engines:
            engine.close()
        for pools in (src, copied, put):
            pools.close()
