"""Value objects the manager hands to a scheduler: a prefix match, a block table, stats.

They are frozen ``attrs`` classes of ints and tuples, safe to keep, compare and send to
another thread or process; they never expose the manager's internals.
"""

from __future__ import annotations

import attrs

from mooncake_kv.types import BlockHash, BlockId

__all__ = ["CacheSnapshot", "KVCacheBlocks", "KVCacheStats", "PrefixMatch"]


@attrs.frozen(slots=True)
class PrefixMatch:
    """Result of ``match_prefix``.

    Attributes:
        block_ids: cached blocks holding the prompt's leading full blocks (now referenced
            by the request).
        num_cached_tokens: tokens whose KV need not be computed
            (``len(block_ids) * block_size``; always less than the prompt length).
    """

    block_ids: tuple[BlockId, ...]
    num_cached_tokens: int

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_ids)


@attrs.frozen(slots=True)
class KVCacheBlocks:
    """A request's block table after ``try_allocate``/``try_append``.

    Attributes:
        block_ids: every block of the request, in token order (token ``t`` lives in
            ``block_ids[t // block_size]`` at slot ``t % block_size``).
        num_new_blocks: how many trailing entries this call allocated.
    """

    block_ids: tuple[BlockId, ...]
    num_new_blocks: int

    @property
    def new_block_ids(self) -> tuple[BlockId, ...]:
        """Blocks allocated by the call that returned this value."""
        return self.block_ids[len(self.block_ids) - self.num_new_blocks :]


@attrs.frozen(slots=True)
class KVCacheStats:
    """A consistent snapshot of one manager (``KVCacheManager.stats()``).

    Prefix queries and hits are counted in tokens: every ``match_prefix`` adds its prompt
    length to ``num_query_tokens`` and its matched tokens to ``num_hit_tokens``.
    """

    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_running_requests: int
    num_queries: int
    num_query_tokens: int
    num_hit_tokens: int
    num_evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        """Matched prompt tokens / prompt tokens (0.0 before any query)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return self.num_used_blocks / self.num_blocks


@attrs.frozen(slots=True)
class CacheSnapshot:
    """Every block's state at one moment (``KVCacheManager.snapshot()``; for tests, debugging).

    Attributes:
        ref_counts: ``ref_counts[b]`` for every block id ``b``.
        free_queue: free blocks in allocation/eviction order (uncached first, then LRU).
        cached: ``(hash, block_id)`` of every cached block, sorted by block id.
    """

    ref_counts: tuple[int, ...]
    free_queue: tuple[BlockId, ...]
    cached: tuple[tuple[BlockHash, BlockId], ...]
