"""Full consistency check of a manager's parts (slow; for tests and debugging).

Checked: ref counts equal the number of live requests holding each block; the free
queue is exactly the unreferenced blocks, each once, uncached ones before cached ones;
free + used = capacity; every index entry points at a block carrying that hash and every
hashed block is indexed; plus the index's own invariants (radix: evictable + protected =
total).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from mooncake_kv.allocator import BlockAllocator
from mooncake_kv.index import PrefixIndex
from mooncake_kv.types import BlockId

__all__ = ["check_consistency"]


def check_consistency(
    allocator: BlockAllocator,
    index: PrefixIndex,
    holders: Mapping[str, Sequence[BlockId]],
) -> None:
    """Raise AssertionError naming the first disagreement found."""
    expected = Counter(b for blocks in holders.values() for b in blocks)
    refs = allocator.ref_counts()
    for block_id, count in enumerate(refs):
        assert count == expected.get(block_id, 0), (
            f"block {block_id}: ref_count {count}, held {expected.get(block_id, 0)} times"
        )
    _check_free_queue(allocator, refs)
    _check_index(allocator, index, refs)


def _check_free_queue(allocator: BlockAllocator, refs: Sequence[int]) -> None:
    queue = allocator.free_queue()
    assert len(set(queue)) == len(queue), "a block is twice in the free queue"
    unreferenced = {b for b, count in enumerate(refs) if count == 0}
    assert set(queue) == unreferenced, "free queue is not exactly the unreferenced blocks"
    used = len(refs) - len(unreferenced)
    assert used + allocator.num_free_blocks == allocator.num_blocks, "free + used != capacity"
    cached = [allocator.block_hash(b) is not None for b in queue]
    assert cached == sorted(cached), "an uncached free block sits behind a cached one"


def _check_index(allocator: BlockAllocator, index: PrefixIndex, refs: Sequence[int]) -> None:
    entries = list(index.entries())
    for block_hash, block_id in entries:
        assert allocator.block_hash(block_id) == block_hash, (
            f"index maps a hash to block {block_id}, which carries another hash"
        )
    hashed = sum(allocator.block_hash(BlockId(b)) is not None for b in range(len(refs)))
    assert hashed == len(entries) == len(index), "hashed blocks and index entries differ"
    index.check_invariants(refs)
