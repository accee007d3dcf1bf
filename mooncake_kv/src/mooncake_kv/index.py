"""Prefix index: which cached block holds each block of a chain.

``PrefixIndex`` is the seam; implementations are registered by name and chosen with
``KVCacheManager(index=...)``:

* ``"hash"`` — ``HashChainIndex``: a dict from block hash to block id (as vLLM does). A
  match looks up the chain's hashes in order until the first miss.
* ``"radix"`` — ``RadixIndex`` (``mooncake_kv.radix``): a page-granular radix tree keyed by
  the blocks' token bytes under a root per salt/adapter (as SGLang does), with
  ``lock_ref`` accounting (evictable + protected = total).

The manager keeps the set of cached blocks *prefix-closed* (a block is cached only under
a cached parent, and eviction takes a chain's tail first), so both implementations hold
the same blocks and answer every match identically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from mooncake_kv.hashing import BlockChain
from mooncake_kv.types import BlockHash, BlockId, UnknownIndexError

__all__ = [
    "HashChainIndex",
    "PrefixIndex",
    "available_indexes",
    "create_index",
    "register_index",
]


@runtime_checkable
class PrefixIndex(Protocol):
    """Maps chains of full blocks to the cached blocks holding them."""

    tracks_refs: bool
    """True if the index wants ``protect``/``unprotect`` calls (ref 0 <-> 1 of cached blocks)."""

    def __len__(self) -> int:
        """Number of cached blocks."""
        ...

    def match(self, chain: BlockChain, max_blocks: int) -> list[BlockId]:
        """Blocks holding the longest cached prefix of ``chain``, at most ``max_blocks``."""
        ...

    def insert(self, chain: BlockChain, start: int, block_ids: Sequence[BlockId],
               parent_block: BlockId | None) -> list[BlockId]:
        """Cache ``chain`` blocks ``start ..`` in ``block_ids`` unless already cached.

        Args:
            parent_block: the cached block holding chain block ``start - 1``
                (None when ``start == 0``); it is referenced by the caller.

        Returns:
            For each position, the block that now holds it: the given block if it was
            inserted, else the one already cached (the caller's block is a duplicate).
        """
        ...

    def remove(self, evicted: Sequence[tuple[BlockId, BlockHash]]) -> None:
        """Forget evicted ``(block_id, hash)`` pairs, in eviction order.

        Each is a chain's tail (has no cached children) when its turn comes.
        """
        ...

    def clear(self) -> None:
        """Forget every block."""
        ...

    def protect(self, block_ids: list[BlockId]) -> None:
        """Cached blocks became referenced."""
        ...

    def unprotect(self, block_ids: list[BlockId]) -> None:
        """Cached blocks became free (evictable)."""
        ...

    def entries(self) -> Iterator[tuple[BlockHash, BlockId]]:
        """Every ``(hash, block_id)`` held (for invariant checks and debugging)."""
        ...

    def check_invariants(self, ref_counts: Sequence[int]) -> None:
        """Raise AssertionError if the index's own bookkeeping is inconsistent."""
        ...


class HashChainIndex:
    """``dict`` from block hash to block id; chaining makes a hash name its whole prefix."""

    __slots__ = ("_blocks",)
    tracks_refs = False

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, BlockId] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, chain: BlockChain, max_blocks: int) -> list[BlockId]:
        # one C-level pass of lookups, then cut at the first miss
        found: list[BlockId | None] = list(map(self._blocks.get, chain.hashes[:max_blocks]))
        if None in found:
            del found[found.index(None) :]
        return found  # type: ignore[return-value]

    def insert(self, chain: BlockChain, start: int, block_ids: Sequence[BlockId],
               parent_block: BlockId | None) -> list[BlockId]:
        setdefault = self._blocks.setdefault
        hashes = chain.hashes
        return [setdefault(hashes[i], b) for i, b in enumerate(block_ids, start)]

    def remove(self, evicted: Sequence[tuple[BlockId, BlockHash]]) -> None:
        pop = self._blocks.pop
        for block_id, block_hash in evicted:
            held = pop(block_hash)
            assert held == block_id, f"hash of block {block_id} was held by block {held}"

    def clear(self) -> None:
        self._blocks.clear()

    def protect(self, block_ids: list[BlockId]) -> None:
        pass

    def unprotect(self, block_ids: list[BlockId]) -> None:
        pass

    def entries(self) -> Iterator[tuple[BlockHash, BlockId]]:
        return iter(list(self._blocks.items()))

    def check_invariants(self, ref_counts: Sequence[int]) -> None:
        held = list(self._blocks.values())
        assert len(set(held)) == len(held), "a block is indexed under two hashes"


IndexFactory = Callable[[], PrefixIndex]
_INDEXES: dict[str, IndexFactory] = {}


def register_index(name: str, factory: IndexFactory) -> None:
    """Make ``factory`` available as ``KVCacheManager(index=name)``."""
    _INDEXES[name] = factory


def available_indexes() -> tuple[str, ...]:
    return tuple(sorted(_INDEXES))


def create_index(name: str) -> PrefixIndex:
    """Build the index registered as ``name``.

    Raises:
        UnknownIndexError: no index has that name; the message lists the known ones.
    """
    try:
        factory = _INDEXES[name]
    except KeyError:
        known = ", ".join(available_indexes())
        raise UnknownIndexError(f"unknown prefix index {name!r}; use one of: {known}") from None
    return factory()


def _register_builtins() -> None:
    from mooncake_kv.radix import RadixIndex  # radix imports nothing from here

    register_index("hash", HashChainIndex)
    register_index("radix", RadixIndex)


_register_builtins()
