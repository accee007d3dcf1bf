"""Tiers without a store: host LRU by bytes, the block frame, the registry."""

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_kv.tiers import (
    CorruptBlockError,
    HostMemoryTier,
    HostTierConfig,
    KVTier,
    UnknownTierError,
    available_tiers,
    frame_block,
    open_tier,
    unframe_block,
)


def test_host_tier_is_a_kv_tier_opened_from_its_config():
    tier = open_tier(HostTierConfig(capacity_bytes=100))
    assert isinstance(tier, HostMemoryTier) and isinstance(tier, KVTier)
    assert {"host", "mooncake_store"} <= set(available_tiers())


def test_host_tier_evicts_least_recently_used_by_bytes():
    tier = HostMemoryTier(capacity_bytes=10)
    assert tier.put("a", b"1234") == []
    assert tier.put("b", b"1234") == []
    assert tier.get("a") == b"1234"  # a is now the most recent
    assert tier.put("c", b"1234") == [("b", b"1234")]
    assert tier.keys() == ["a", "c"] and tier.used_bytes == 8
    assert tier.get("b") is None and not tier.contains("b")


def test_host_tier_replaces_and_refuses_oversized_values():
    tier = HostMemoryTier(capacity_bytes=10)
    tier.put("a", b"12")
    tier.put("a", b"12345")
    assert tier.used_bytes == 5 and len(tier) == 1
    assert tier.put("huge", b"x" * 11) == [("huge", b"x" * 11)]
    assert not tier.contains("huge") and tier.used_bytes == 5
    tier.remove("a")
    tier.remove("a")
    assert tier.used_bytes == 0
    tier.close()
    tier.close()


@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 6)), max_size=40))
def test_host_tier_matches_a_simple_lru_model(ops):
    tier, model = HostMemoryTier(capacity_bytes=12), []  # model: [(key, size)] oldest first
    for key, size in ops:
        evicted = tier.put(key, bytes(size))
        model = [item for item in model if item[0] != key] + [(key, size)]
        expected = []
        while sum(s for _, s in model) > 12:
            expected.append(model.pop(0))
        assert [(k, len(v)) for k, v in evicted] == expected
        assert tier.keys() == [k for k, _ in model]
        assert tier.used_bytes == sum(s for _, s in model) <= 12


def test_frame_roundtrip_and_every_kind_of_damage_is_caught():
    blob = frame_block("k1", "L1-H1-D1-B1-bf16", b"payload")
    assert unframe_block("k1", "L1-H1-D1-B1-bf16", blob) == b"payload"
    with pytest.raises(CorruptBlockError, match="not 'L2"):
        unframe_block("k1", "L2-H1-D1-B1-bf16", blob)
    with pytest.raises(CorruptBlockError, match="holds block"):
        unframe_block("k2", "L1-H1-D1-B1-bf16", blob)
    with pytest.raises(CorruptBlockError, match="checksum"):
        unframe_block("k1", "L1-H1-D1-B1-bf16", blob[:-1] + b"X")
    with pytest.raises(CorruptBlockError, match="checksum"):
        unframe_block("k1", "L1-H1-D1-B1-bf16", blob[:-1])
    with pytest.raises(CorruptBlockError, match="shorter than a frame"):
        unframe_block("k1", "L1-H1-D1-B1-bf16", b"abc")
    with pytest.raises(CorruptBlockError, match="not a version-1"):
        unframe_block("k1", "L1-H1-D1-B1-bf16", b"X" * 40)


def test_unknown_tier_kind_and_bad_capacity():
    @attrs.frozen
    class NvmeConfig:
        kind = "nvme"

    with pytest.raises(UnknownTierError, match="known kinds: host"):
        open_tier(NvmeConfig())
    with pytest.raises(ValueError, match="capacity_bytes must be a positive"):
        HostTierConfig(capacity_bytes=0)
