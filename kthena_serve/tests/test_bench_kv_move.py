"""The KV-move bench (article B's table) on a tiny shape: every row, its counts, its check."""

from __future__ import annotations

import os
import re

import pytest
import torch

from kthena_serve.bench.kv_move import (
    METHODS,
    KVMoveMismatchError,
    _fresh_kv,
    _Geometry,
    _verify,
    bench_kv_move,
)
from mooncake_kv.pool import KVPool

LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 4, 2, 16, 32
KV_BYTES = TOKENS * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # tokens x layers x (K,V) x bf16 row
EXPECTED_CALLS = {"host_copy": 1, "per_token_put": 2 * TOKENS, "batched_put": 1,
                  "batched_async_put": 1, "layerwise_async_put": LAYERS, "zero_copy_shared": 0}


def _leaked(before: set[str]) -> list[str]:
    """New /dev/shm entries that this process made and left.

    Other sessions share this machine and make (and leave) their own entries, some named with
    numbers that are no live pid. The bench runs here without its network namespaces, so every
    transport runs in this process, and every segment it makes carries this process's pid as
    a whole number in its name (``kthena-<pid>-...``, ``mooncake_kv.<pid>....``): only those
    are counted.
    """
    ours = re.compile(rf"(?<![0-9]){os.getpid()}(?![0-9])")
    return sorted(name for name in set(os.listdir("/dev/shm")) - before if ours.search(name))


@pytest.fixture(scope="module")
def result():
    before = set(os.listdir("/dev/shm"))
    out = bench_kv_move(TOKENS, 1, False, layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    out["leaked"] = _leaked(before)
    return out


def test_every_transport_and_method_has_a_verified_row(result):
    rows = {(r["transport"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(t, m) for t in ("shm", "mooncake_loopback") for m in METHODS}
    assert result["kv_bytes"] == KV_BYTES
    for (transport, method), row in rows.items():
        if (transport, method) == ("mooncake_loopback", "zero_copy_shared"):
            assert row["applicable"] is False and row["reason"]
            assert row["bytes"] is None and row["transfer_s"] is None
            continue
        assert row["bytes"] == KV_BYTES, (transport, method)
        assert row["calls"] == EXPECTED_CALLS[method], (transport, method)
        assert row["verified"] is True and row["checks"] >= 1, (transport, method)
        assert row["ready_after_compute_s"] > 0 and row["layer_compute_ms"] > 0
        assert row["start_to_ready_s"] > row["ready_after_compute_s"]
        assert row["transfer_s"] > 0 or method == "zero_copy_shared"


def test_ranges_follow_the_layout():
    # PER_LAYER: a run of blocks is one range per (layer, K|V); per token: one per layer
    geometry = _Geometry(TOKENS, LAYERS, KV_HEADS, HEAD_DIM)
    assert len(geometry.layout.pair_ranges(geometry.src, geometry.dst)) == 2 * LAYERS


def test_ranges_reported(result):
    rows = {(r["transport"], r["method"]): r for r in result["rows"]}
    for transport in ("shm", "mooncake_loopback"):
        assert rows[(transport, "batched_put")]["ranges"] == 2 * LAYERS
        assert rows[(transport, "layerwise_async_put")]["ranges"] == 2 * LAYERS
        assert rows[(transport, "per_token_put")]["ranges"] == 2 * TOKENS * LAYERS
        assert rows[(transport, "host_copy")]["ranges"] == 1


def test_claims_stand_in_and_machine_are_labelled(result):
    assert "not measured" in result["article_claims"]["label"]
    assert "STAND-IN" in result["compute_stand_in"]["what"]
    assert result["compute_stand_in"]["calibrated_layer_ms"] > 0
    machine = result["machine"]
    assert machine["cores"] >= 1 and len(machine["load_start"]) == len(machine["load_end"]) == 3


def test_nothing_is_left_in_dev_shm(result):
    assert result["leaked"] == []


def test_the_check_raises_on_one_differing_byte():
    geometry = _Geometry(TOKENS, LAYERS, KV_HEADS, HEAD_DIM)
    fresh = _fresh_kv(geometry)
    pool = KVPool.create(geometry.layout)
    try:
        for layer in range(LAYERS):
            for view in ("k_cache", "v_cache"):
                getattr(pool, view)(layer)[geometry.dst_slice()].copy_(
                    getattr(fresh, view)(layer)[geometry.src_slice()])
        _verify(fresh, pool, geometry, "copy")  # identical: passes
        last = pool.v_cache(LAYERS - 1)[geometry.dst[-1]]
        last.view(torch.int16)[-1, -1, -1] ^= 1  # one bit of the last token's last V element
        wanted = f"layer {LAYERS - 1} V of token {TOKENS - 1}"
        with pytest.raises(KVMoveMismatchError, match=wanted):
            _verify(fresh, pool, geometry, "copy")
    finally:
        pool.close()
        fresh.close()


def test_bad_sizes_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        bench_kv_move(0)
