"""BlockAllocator: golden allocation and eviction order, touch, out-of-blocks."""

from __future__ import annotations

import pytest

from mooncake_kv import BlockAllocator


def _cache(allocator: BlockAllocator, block_ids: list[int], tag: str) -> None:
    allocator.set_hashes(block_ids, [f"{tag}{b}".encode() for b in block_ids])


def test_fresh_pool_hands_out_lowest_ids_first() -> None:
    allocator = BlockAllocator(4)
    assert allocator.try_allocate(3) == ([0, 1, 2], [])
    assert allocator.num_free_blocks == 1
    assert [allocator.ref_count(b) for b in range(4)] == [1, 1, 1, 0]


def test_out_of_blocks_returns_none_and_changes_nothing() -> None:
    allocator = BlockAllocator(3)
    allocator.try_allocate(2)
    before = (allocator.free_queue(), allocator.ref_counts())
    assert allocator.try_allocate(2) is None
    assert (allocator.free_queue(), allocator.ref_counts()) == before


def test_eviction_order_is_lru_with_chain_tail_first() -> None:
    allocator = BlockAllocator(6)
    first, _ = allocator.try_allocate(3)  # a chain 0 -> 1 -> 2
    second, _ = allocator.try_allocate(2)  # a chain 3 -> 4
    _cache(allocator, first, "a")
    _cache(allocator, second, "b")
    allocator.release(first[::-1])  # tail first
    allocator.release(second[::-1])
    # uncached block 5 first, then the older chain tail-first, then the newer one
    assert allocator.free_queue() == [5, 2, 1, 0, 4, 3]
    blocks, evicted = allocator.try_allocate(3)
    assert blocks == [5, 2, 1]
    assert evicted == [(2, b"a2"), (1, b"a1")]
    assert allocator.block_hash(2) is None and allocator.block_hash(0) == b"a0"


def test_touch_moves_a_block_to_the_most_recent_end() -> None:
    allocator = BlockAllocator(3)
    blocks, _ = allocator.try_allocate(3)
    _cache(allocator, blocks, "x")
    allocator.release([2, 1, 0])
    assert allocator.free_queue() == [2, 1, 0]
    allocator.take_refs([2])  # a prefix hit on block 2
    assert allocator.free_queue() == [1, 0]
    allocator.release([2])
    assert allocator.free_queue() == [1, 0, 2]


def test_uncached_blocks_are_reused_before_any_cached_one() -> None:
    allocator = BlockAllocator(4)
    blocks, _ = allocator.try_allocate(4)
    _cache(allocator, blocks[:2], "c")
    allocator.release(blocks[::-1])  # 3, 2 uncached; 1, 0 cached
    assert allocator.free_queue() == [2, 3, 1, 0]
    assert allocator.try_allocate(2) == ([2, 3], [])


def test_shared_block_is_free_only_when_the_last_ref_goes() -> None:
    allocator = BlockAllocator(2)
    (block,), _ = allocator.try_allocate(1)
    _cache(allocator, [block], "s")
    allocator.take_refs([block])
    allocator.release([block])
    assert allocator.ref_count(block) == 1 and block not in allocator.free_queue()
    allocator.release([block])
    assert allocator.free_queue() == [1, block]


def test_evict_uncaches_lru_blocks_onto_the_uncached_stack() -> None:
    allocator = BlockAllocator(3)
    blocks, _ = allocator.try_allocate(3)
    _cache(allocator, blocks, "e")
    allocator.release(blocks[::-1])
    assert allocator.evict(2) == [(2, b"e2"), (1, b"e1")]
    assert allocator.evict(5) == [(0, b"e0")]
    assert allocator.num_evictable_blocks == 0
    assert allocator.free_queue() == [0, 1, 2]


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
