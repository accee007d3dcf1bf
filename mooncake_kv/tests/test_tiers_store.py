"""Mooncake Store tier against a real mooncake_master on 127.0.0.1 (skipped without one)."""

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _support import free_port

from mooncake_kv.tiers import (
    MooncakeStoreTier,
    StoreTierConfig,
    TierError,
    TierUnavailableError,
    open_tier,
)
from mooncake_kv.tiers.master import master_binary, start_local_master
from mooncake_kv.tiers.master import stop_master as stop_local

pytestmark = pytest.mark.mooncake


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def start_master() -> tuple[subprocess.Popen, str]:
    if not master_binary().exists():
        pytest.skip(f"mooncake_master not found at {master_binary()}; install mooncake-kv[store]")
    pytest.importorskip("mooncake.store", reason="Mooncake wheel (or libibverbs1) missing")
    return start_local_master("--default_kv_lease_ttl=100")


def stop_master(proc: subprocess.Popen) -> None:
    stop_local(proc)
    assert processes_with(f"--rpc_port={proc.args[1].split('=')[1]}") == [], "stray master"


@pytest.fixture(scope="module")
def master():
    proc, address = start_master()
    yield address
    stop_master(proc)


@pytest.fixture(scope="module")
def store(master):
    tier = open_tier(StoreTierConfig(master_address=master, namespace=f"t{os.getpid()}",
                                     global_segment_size=32 << 20, local_buffer_size=8 << 20))
    yield tier
    tier.close()
    tier.close()  # harmless


def test_store_roundtrip(store):
    assert isinstance(store, MooncakeStoreTier)
    value = os.urandom(300_000)
    assert store.get("roundtrip") is None and not store.contains("roundtrip")
    assert store.put("roundtrip", value) == []
    assert store.contains("roundtrip")
    assert store.get("roundtrip") == value
    store.remove("roundtrip")
    assert not store.contains("roundtrip") and store.get("roundtrip") is None


def test_namespaces_keep_caches_apart(store, master):
    store.put("shared-key", b"from the first cache")
    other = MooncakeStoreTier(StoreTierConfig(master_address=master, namespace="other",
                                              global_segment_size=16 << 20,
                                              local_buffer_size=4 << 20))
    try:
        assert other.get("shared-key") is None
        other.put("shared-key", b"from the second cache")
        assert store.get("shared-key") == b"from the first cache"
    finally:
        other.close()


def test_unreachable_master_fails_fast():
    start = time.monotonic()
    with pytest.raises(TierUnavailableError, match="does not answer"):
        open_tier(StoreTierConfig(master_address=f"127.0.0.1:{free_port()}",
                                  connect_timeout_s=0.5))
    assert time.monotonic() - start < 5


def test_closed_store_raises_tier_error(master):
    tier = MooncakeStoreTier(StoreTierConfig(master_address=master, namespace="closing",
                                             global_segment_size=16 << 20,
                                             local_buffer_size=4 << 20))
    tier.close()
    with pytest.raises(TierError, match="closed"):
        tier.get("anything")


def test_bad_master_address_is_refused():
    with pytest.raises(ValueError, match="host:port"):
        StoreTierConfig(master_address="localhost")


# ---- where the client listens -------------------------------------------------------------------

READ_BACK = """
import sys
from mooncake_kv.listen import wildcard_listeners
from mooncake_kv.tiers import MooncakeStoreTier, StoreTierConfig
tier = MooncakeStoreTier(StoreTierConfig(master_address=sys.argv[1], namespace=sys.argv[2],
                                         global_segment_size=16 << 20, local_buffer_size=4 << 20))
hits = sum(tier.get(f"k{i}") == bytes([i]) * 65536 for i in range(8))
print(hits, wildcard_listeners())
tier.close()
"""


def test_store_client_listens_on_loopback_only(store, master):
    """Mooncake binds every interface by itself (0.0.0.0 RPC, [::] data); here it listens on
    127.0.0.1 only, and another client still reads the blocks this one's segment holds."""
    from mooncake_kv.listen import listening_sockets, wildcard_listeners

    listening = listening_sockets()
    assert wildcard_listeners() == [], listening
    assert len(listening) >= 2  # Mooncake's handshake RPC and TCP data ports
    assert {host for host, _ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}
    for i in range(8):  # the reader mounts no segment before these land: they are in ours
        store.put(f"k{i}", bytes([i]) * 65536)
    reader = subprocess.run([sys.executable, "-c", READ_BACK, master, store.config.namespace],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "GLOG_minloglevel": "2"})
    assert reader.returncode == 0, reader.stderr[-2000:]
    assert reader.stdout.split(maxsplit=1) == ["8", "[]\n"]


def test_remote_master_with_a_loopback_client_is_refused():
    # the master would hand 127.0.0.1 to clients on other hosts as this client's address
    with pytest.raises(TierUnavailableError, match="other hosts cannot reach"):
        open_tier(StoreTierConfig(master_address="192.0.2.1:50051"))


def test_listen_address_must_be_ipv4(master):
    with pytest.raises(TierUnavailableError, match="IPv4"):
        open_tier(StoreTierConfig(master_address=master, local_hostname="::1",
                                  global_segment_size=16 << 20, local_buffer_size=4 << 20))


# ---- the offload coordinator over the real store ---------------------------------------------

def make_cache(tiers, num_blocks=4):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from mooncake_kv.layout import KVLayout
    from mooncake_kv.manager import KVCacheManager
    from mooncake_kv.pool import KVPool
    from mooncake_kv.sizing import KVShape
    from mooncake_kv.tiers import TieredKVCache

    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bf16")
    manager = KVCacheManager(num_blocks, 4, check_invariants=True)
    pool = KVPool.create(KVLayout(shape, num_blocks))
    return TieredKVCache(manager, pool, tiers)


def serve(cache, request_id, tokens, written):
    """Match via tiers, 'compute' missing blocks with random bytes, commit, free."""
    manager, pool = cache.manager, cache.pool
    match = cache.match_prefix(request_id, tokens)
    table = manager.try_allocate(request_id, len(tokens) - match.num_cached_tokens)
    hashes = manager.hasher.hash_tokens(tokens)
    for position in range(match.num_cached_blocks, len(hashes)):
        written[hashes[position]] = os.urandom(pool.layout.bytes_per_block)
        pool.write_block(table.block_ids[position], written[hashes[position]])
    seen = [pool.read_block(b) for b in table.block_ids[: len(hashes)]]
    manager.commit(request_id, tokens)
    manager.free(request_id)
    return match.num_cached_tokens, seen, [written[h] for h in hashes]


PROMPT_A, PROMPT_B = list(range(1000, 1013)), list(range(2000, 2016))


def test_offload_to_store_and_restore_identical_bytes(store):
    from mooncake_kv.tiers import HostMemoryTier

    cache = make_cache([HostMemoryTier(capacity_bytes=1, name="host"), store])
    written = {}
    prompt_a, prompt_b = PROMPT_A, PROMPT_B
    serve(cache, "a1", prompt_a, written)
    serve(cache, "b1", prompt_b, written)  # A's blocks: too big for host, pushed to the store
    cached, seen, expected = serve(cache, "a2", prompt_a, written)
    assert cached == 12 and seen == expected
    host, remote = cache.stats().tiers
    assert (host.num_stores, host.num_hits, remote.num_hits) == (0, 0, 3)
    assert remote.num_stores >= 3
    cache.manager.unsubscribe(cache.on_event)  # the store is the module's, left open
    cache.pool.close()


def test_corrupt_store_value_is_recomputed_with_warning(store, caplog):
    cache = make_cache([store])
    written = {}
    prompt_a, prompt_b = [t + 1 for t in PROMPT_A], [t + 1 for t in PROMPT_B]
    serve(cache, "a1", prompt_a, written)
    serve(cache, "b1", prompt_b, written)
    first = cache.manager.hasher.hash_tokens(prompt_a)[0]
    key = f"{cache.pool.layout.shape.fingerprint()}/{first.hex()}"
    damaged = store.get(key)[:-8] + b"garbage!"  # same length, wrong bytes
    store.remove(key)  # Mooncake ignores a put to an existing key
    store.put(key, damaged)
    with caplog.at_level(logging.WARNING, logger="mooncake_kv.tiers.offload"):
        cached, seen, expected = serve(cache, "a2", prompt_a, written)
    assert cached == 0 and seen == expected
    assert "checksum" in caplog.text and cache.stats().tiers[0].num_corrupt == 1
    assert not store.contains(key)  # the bad value was dropped
    cache.manager.unsubscribe(cache.on_event)
    cache.pool.close()


@pytest.mark.slow
def test_store_going_down_mid_run_degrades_to_recompute(caplog):
    proc, address = start_master()
    try:
        store = MooncakeStoreTier(StoreTierConfig(master_address=address, namespace="down",
                                                  global_segment_size=16 << 20,
                                                  local_buffer_size=4 << 20))
        cache = make_cache([store])
        written = {}
        serve(cache, "a1", PROMPT_A, written)
        serve(cache, "b1", PROMPT_B, written)
        assert cache.stats().tiers[0].num_stores == 3
    finally:
        stop_master(proc)
    with caplog.at_level(logging.WARNING, logger="mooncake_kv.tiers.offload"):
        cached, seen, expected = serve(cache, "a2", PROMPT_A, written)
    assert cached == 0 and seen == expected  # recomputed, never stale
    assert "mooncake_store failed" in caplog.text
    assert cache.stats().tiers[0].num_errors >= 1
    cache.close()  # Mooncake's client retries the dead master for ~10 s here
    cache.pool.close()
