"""Block allocator: ref counts and the free queue, ordered for eviction.

Every block is in exactly one of three states::

    referenced (ref_count > 0)     held by one or more requests
    free, cached (ref_count == 0)  in the LRU queue, still matchable by its hash
    free, uncached                 on the uncached stack, holds nothing worth keeping

The *free queue*, in allocation/eviction order, is the uncached stack (top first) followed
by the LRU queue (least recently released first)::

    allocate ◀── [uncached: top ... bottom] [LRU: oldest ............ newest] ◀── release

Callers release a request's blocks in reverse order (tail of the chain first), so among
blocks released together the tail is evicted first, and a cached block is always evicted
before its parent. Taking a ref on a free cached block ("touch") removes it from the
queue; all operations are O(1) per block (a list used as a stack and an ``OrderedDict``).

Allocating past the uncached stack evicts LRU blocks: their hashes are cleared and the
``(block_id, hash)`` pairs are returned so the caller can drop them from its index and
announce them *before* handing the blocks out. Running out returns ``None`` and changes
nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from mooncake_kv.types import BlockHash, BlockId

__all__ = ["BlockAllocator", "RefWatcher"]


class RefWatcher(Protocol):
    """Told when cached blocks become referenced (protected) or free again (evictable)."""

    def protect(self, block_ids: list[BlockId]) -> None: ...

    def unprotect(self, block_ids: list[BlockId]) -> None: ...


class BlockAllocator:
    """Ref-counted pool of ``num_blocks`` block ids with an eviction-ordered free queue."""

    __slots__ = ("_hash", "_lru", "_ref", "_uncached", "num_blocks", "watcher")

    def __init__(self, num_blocks: int, watcher: RefWatcher | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.watcher = watcher
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # pop() from the end hands out the lowest id first on a fresh pool
        self._uncached: list[BlockId] = [BlockId(b) for b in range(num_blocks - 1, -1, -1)]
        self._lru: OrderedDict[BlockId, None] = OrderedDict()

    # ---- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0 (cached or not): what an allocation may take."""
        return len(self._uncached) + len(self._lru)

    @property
    def num_evictable_blocks(self) -> int:
        """Free blocks that still carry a hash (the LRU queue)."""
        return len(self._lru)

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        return self._hash[block_id]

    def ref_counts(self) -> Sequence[int]:
        """Read-only view of all ref counts (for invariant checks)."""
        return tuple(self._ref)

    def free_queue(self) -> list[BlockId]:
        """Free blocks in the order they would be allocated (uncached first, then LRU)."""
        return self._uncached[::-1] + list(self._lru)

    # ---- mutation ----------------------------------------------------------------------
    def try_allocate(
        self, num_blocks: int
    ) -> tuple[list[BlockId], list[tuple[BlockId, BlockHash]]] | None:
        """Take ``num_blocks`` free blocks (ref_count 1 each), uncached ones first.

        Returns:
            ``(block_ids, evicted)`` where ``evicted`` lists the ``(block_id, old_hash)``
            of LRU blocks whose hash was dropped to serve this call; ``None`` (and no
            change) when fewer than ``num_blocks`` blocks are free.
        """
        uncached = self._uncached
        if num_blocks > len(uncached) + len(self._lru):
            return None
        take = min(num_blocks, len(uncached))
        blocks = uncached[len(uncached) - take :]
        blocks.reverse()
        del uncached[len(uncached) - take :]
        evicted = self._pop_lru(num_blocks - take)
        for block_id, _ in evicted:
            blocks.append(block_id)
        ref = self._ref
        for block_id in blocks:
            ref[block_id] = 1
        return blocks, evicted

    def take_refs(self, block_ids: Iterable[BlockId]) -> None:
        """Add one ref to each block; a free block must be cached and leaves the LRU queue."""
        ref = self._ref
        lru = self._lru
        touched: list[BlockId] | None = [] if self.watcher is not None else None
        for block_id in block_ids:
            count = ref[block_id]
            if count == 0:
                del lru[block_id]  # KeyError here means an uncached free block: a bug
                if touched is not None:
                    touched.append(block_id)
            ref[block_id] = count + 1
        if touched and self.watcher is not None:
            self.watcher.protect(touched)

    def release(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one ref from each block, in the given order (pass a chain tail first).

        A block reaching ref_count 0 joins the LRU tail if cached, else the uncached stack.
        """
        ref = self._ref
        hashes = self._hash
        lru = self._lru
        uncached = self._uncached
        released: list[BlockId] | None = [] if self.watcher is not None else None
        for block_id in block_ids:
            count = ref[block_id] - 1  # never negative: the manager releases what it took
            ref[block_id] = count
            if count:
                continue
            if hashes[block_id] is None:
                uncached.append(block_id)
            else:
                lru[block_id] = None
                if released is not None:
                    released.append(block_id)
        if released and self.watcher is not None:
            self.watcher.unprotect(released)

    def set_hashes(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        """Mark referenced, uncached blocks as holding the blocks named by ``block_hashes``."""
        hashes = self._hash
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            hashes[block_id] = block_hash  # the invariant check catches misuse

    def evict(self, num_blocks: int) -> list[tuple[BlockId, BlockHash]]:
        """Uncache up to ``num_blocks`` LRU blocks (they move to the uncached stack)."""
        evicted = self._pop_lru(min(num_blocks, len(self._lru)))
        self._uncached.extend(block_id for block_id, _ in evicted)
        return evicted

    def _pop_lru(self, num_blocks: int) -> list[tuple[BlockId, BlockHash]]:
        hashes = self._hash
        popitem = self._lru.popitem
        evicted: list[tuple[BlockId, BlockHash]] = []
        for _ in range(num_blocks):
            block_id, _ = popitem(last=False)
            evicted.append((block_id, hashes[block_id]))  # type: ignore[arg-type]
            hashes[block_id] = None
        return evicted
