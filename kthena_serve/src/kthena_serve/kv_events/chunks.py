"""RouterChunks: which router chunks our KV cache holds whole, from the KV manager's events.

The KV manager announces blocks of ``block_size`` tokens (``BlockStored`` with the parent's
hash, ``BlockRemoved``, ``AllCleared``); the router asks about chunks of ``chunk_size``
tokens. A chunk is held while every block it overlaps is cached, so it is attributed to the
block that holds its last token; the manager keeps the cache prefix-closed (a block is cached
only under a cached parent, and eviction takes a chain's tail first), so that block's being
cached means the chunk's earlier blocks are too::

    block_size 4, chunk_size 6:
    blocks    [ 0 1 2 3 ][ 4 5 6 7 ][ 8 9 10 11 ]
    chunks    [ 0 1 2 3   4 5 ][ 6 7   8 9 10 11 ]
                  chunk 0 -> block 1   chunk 1 -> block 2

The router hashes each chunk alone, so one chunk hash can be held by several blocks (the
same tokens at another position, or under another cache salt): ``ref_counts`` says how many,
and a key is owned while its count is above zero. Only chunks before ``max_chunks`` are
tracked, as the router looks no further.

The router hashes bare token ids, so blocks whose KV also depends on something else (a
tenant's ``cache_salt``, an adapter id, an image) are never announced: with the manager's
``BlockHasher`` a block counts only if its hash is the plain hash of its tokens under its
parent. A claim on them would draw requests that cannot reuse them.

Events lost on the way (a full queue) are survivable: a ``BlockStored`` whose parent is
unknown is skipped with its descendants (``num_skipped_blocks``, which counts the blocks
skipped as not plain too), and ``retain`` drops the blocks a fresh list of cached hashes no
longer has (a lost ``BlockRemoved``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from kthena_serve.kv_events.router_hash import ChunkHash, chunk_hash
from mooncake_kv import (
    AllCleared,
    BlockHash,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEvent,
    pack_tokens,
)

__all__ = ["RouterChunks"]


class _Block:
    """A cached block: where it sits and which chunks end in it."""

    __slots__ = ("chunks", "depth", "parent", "token_ids")

    def __init__(self, parent: BlockHash | None, depth: int, token_ids: tuple[int, ...],
                 chunks: tuple[ChunkHash, ...]) -> None:
        self.parent = parent
        self.depth = depth  # index of the block in its sequence
        self.token_ids = token_ids  # () once past the tracked chunks: no chunk needs them
        self.chunks = chunks


class RouterChunks:
    """The router chunks held whole by the cached blocks (see module docs).

    Args:
        chunk_size: tokens per router chunk (the plugin's ``blockSizeToHash``).
        max_chunks: chunks the router looks at per prompt (``maxBlocksToMatch``).
        hasher: the KV manager's block hasher, to skip blocks that are not plain token
            blocks (salted, adapter, non-token inputs); None trusts every block (tests).
    """

    def __init__(self, chunk_size: int, max_chunks: int,
                 hasher: BlockHasher | None = None) -> None:
        if chunk_size < 1 or max_chunks < 1:
            raise ValueError(f"chunk_size and max_chunks must be >= 1, got {chunk_size} and "
                             f"{max_chunks}")
        self.chunk_size = chunk_size
        self.max_chunks = max_chunks
        self.hasher = hasher
        self.ref_counts: Counter[ChunkHash] = Counter()
        self.num_skipped_blocks = 0
        self._blocks: dict[BlockHash, _Block] = {}
        self._changed: set[ChunkHash] = set()

    def __len__(self) -> int:
        """Number of blocks tracked."""
        return len(self._blocks)

    def held(self) -> set[ChunkHash]:
        """The chunk hashes held now."""
        return set(self.ref_counts)

    def take_changed(self) -> set[ChunkHash]:
        """Chunk hashes whose held/not-held state may have changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def apply(self, event: KVEvent) -> None:
        """Update from one KV manager event."""
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._remove(block_hash)
        elif isinstance(event, AllCleared):
            self._changed.update(self.ref_counts)
            self.ref_counts.clear()
            self._blocks.clear()

    def retain(self, cached: Collection[BlockHash]) -> int:
        """Forget every block not in ``cached`` (the manager's cached hashes); how many."""
        gone = [h for h in self._blocks if h not in cached]  # `cached`: a set, for speed
        for block_hash in gone:
            self._remove(block_hash)
        return len(gone)

    # ---- internals --------------------------------------------------------------------------
    def _stored(self, event: BlockStored) -> None:
        parent = event.parent_block_hash
        if parent is None:
            depth = 0
        elif parent in self._blocks:
            depth = self._blocks[parent].depth + 1
        else:  # the parent was skipped, or its BlockStored lost: nothing here can be placed
            self.num_skipped_blocks += len(event.block_hashes)
            return
        size = event.block_size
        num_plain = self._num_plain(event)
        self.num_skipped_blocks += len(event.block_hashes) - num_plain
        for i, block_hash in enumerate(event.block_hashes[:num_plain]):
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            self._add(block_hash, parent, depth + i, tokens, size)
            parent = block_hash

    def _num_plain(self, event: BlockStored) -> int:
        """How many leading blocks of ``event`` hash as bare tokens under their parent."""
        if self.hasher is None:
            return len(event.block_hashes)
        parent = event.parent_block_hash or self.hasher.root()
        plain = self.hasher.chain(pack_tokens(event.token_ids), parent)
        for i, (ours, theirs) in enumerate(zip(plain, event.block_hashes, strict=True)):
            if ours != theirs:
                return i
        return len(event.block_hashes)

    def _add(self, block_hash: BlockHash, parent: BlockHash | None, depth: int,
             token_ids: tuple[int, ...], block_size: int) -> None:
        if block_hash in self._blocks:  # announced again (its removal was lost)
            self._remove(block_hash)
        start, stop = depth * block_size, (depth + 1) * block_size
        first = start // self.chunk_size  # first chunk that may end in this block
        last = min(stop // self.chunk_size, self.max_chunks)  # chunks < last end by `stop`
        chunks: list[ChunkHash] = []
        if first < last:
            offset = first * self.chunk_size  # the window starts with chunk `first`
            tail = self._tail_tokens(parent, start - offset)
            if tail is None:  # an ancestor's tokens are gone (events were lost): skip
                self.num_skipped_blocks += 1
                return
            window = tail + token_ids
            for j in range(first, last):
                begin = j * self.chunk_size - offset
                chunks.append(chunk_hash(window[begin : begin + self.chunk_size]))
        keep = token_ids if start < self.max_chunks * self.chunk_size else ()
        self._blocks[block_hash] = _Block(parent, depth, keep, tuple(chunks))
        for chunk in chunks:
            if self.ref_counts[chunk] == 0:
                self._changed.add(chunk)
            self.ref_counts[chunk] += 1

    def _remove(self, block_hash: BlockHash) -> None:
        block = self._blocks.pop(block_hash, None)
        if block is None:  # never placed (its BlockStored or an ancestor's was lost)
            return
        for chunk in block.chunks:
            self.ref_counts[chunk] -= 1
            if self.ref_counts[chunk] == 0:
                del self.ref_counts[chunk]
                self._changed.add(chunk)

    def _tail_tokens(self, block_hash: BlockHash | None, count: int) -> tuple[int, ...] | None:
        """The last ``count`` tokens of the sequence that ends with ``block_hash``; None if
        a block on the way is not tracked."""
        parts: list[tuple[int, ...]] = []
        while count > 0 and block_hash is not None:
            block = self._blocks.get(block_hash)
            if block is None:
                return None
            parts.append(block.token_ids[max(0, len(block.token_ids) - count):])
            count -= len(block.token_ids)
            block_hash = block.parent
        return tuple(t for part in reversed(parts) for t in part)
