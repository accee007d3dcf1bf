"""KVCacheManager: the only object a scheduler talks to about KV blocks.

Verb flow for one request (``rid``)::

    m = mgr.match_prefix(rid, prompt_ids)        registers rid; refs the cached prefix
    b = mgr.try_allocate(rid, n)                 prefill (repeat per chunk); None = wait
    mgr.commit(rid, token_ids_so_far)            after KV is written: cache filled blocks
    b = mgr.try_append(rid)                      decode: one more slot; None = preempt
    mgr.commit(rid, token_ids_so_far)            ... generated blocks become matchable too
    mgr.free(rid)                                finished or preempted (tail first)

* ``match_prefix`` hashes the prompt's full blocks, finds the longest cached prefix (never
  the whole prompt: at least one token is always computed) and takes a ref on those
  blocks at once, so nothing can evict them before ``try_allocate``. Its hit counts feed
  ``stats().hit_rate``. ``num_cached_tokens`` says where computing starts.
* ``try_allocate(rid, n)`` reserves slots for ``n`` more tokens after those already
  reserved (the cached ones first), allocating blocks as needed; it returns the whole
  block table or ``None`` when out of blocks, and then changes nothing. It covers the
  tokens given to ``match_prefix`` and no more: the first call after a hit of ``c`` tokens
  takes ``n = len(prompt) - c`` (or a chunk of it), and asking past the prompt raises
  ``TokenCountError`` (the classic slip, ``n = len(prompt)``, would silently double-book).
  ``try_append`` reserves decode slots (default one token) once prefill has started.
* ``commit(rid, token_ids)`` takes the request's tokens whose KV is now written (the
  whole sequence so far, prompt and generated) and caches every block that filled since
  the last commit, so a later turn of the conversation matches the previous answer. If
  an identical block was cached meanwhile by another request (or the request computed a
  prefix it did not look up: ``match_prefix(lookup=False)``), the request refs the cached
  twin in its block table and releases its own copy: it never holds two blocks for one
  position, and the cached chain stays prefix-closed (a block is cached only under a cached
  parent). The block table can therefore change at a commit: read it again with
  ``block_ids(rid)``.
* ``free(rid)`` drops the request's refs, tail first: cached blocks join the LRU end of
  the free queue, so a chain's tail is evicted before its head. Preemption is ``free``
  then, later, ``match_prefix`` again (recompute what is no longer cached).
* ``evict(n)`` trims cached free blocks (for a cache capped below the pool size);
  ``reset_prefix_cache`` drops them all (only when no request holds a block; otherwise
  it logs a warning and returns False).

Misuse raises an error naming the request: ``UnknownRequestError`` (never matched),
``RequestFinishedError`` (verb after ``free``), ``DoubleFreeError``,
``DuplicateRequestError`` (``match_prefix`` twice), ``RequestStateError`` (``try_append``
before prefill), ``TokenCountError``, ``TokenIdError`` (a token id outside ``[0, 2**32)``);
the manager's state is unchanged by a failed verb.

Threading contract: one *owner* thread (the scheduler) calls the mutating verbs above;
the owner is the first thread that calls one, and ``release_owner`` hands it over. A
mutating verb from another thread raises ``OwnerThreadError``. ``stats()``,
``snapshot()``, ``holders()``, ``subscribe``/``unsubscribe`` and ``EventQueue.drain`` may be
called from any thread: verbs hold an internal lock, so ``stats()`` and ``snapshot()``
always see the state between two verbs (single-value properties are plain, unsynchronised
reads). Event callbacks run on the owner thread, inside the verb, and must not call mutating verbs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from mooncake_kv._invariants import check_consistency
from mooncake_kv._request import LiveRequest, RequestTable, mutating
from mooncake_kv.allocator import BlockAllocator
from mooncake_kv.events import (
    AllCleared,
    BlockRemoved,
    EventBus,
    EventQueue,
    KVEventCallback,
    stored_events,
)
from mooncake_kv.hashing import DEFAULT_HASH_ALGO, BlockChain, BlockHasher, ExtraKeys
from mooncake_kv.index import PrefixIndex, create_index
from mooncake_kv.results import CacheSnapshot, KVCacheBlocks, KVCacheStats, PrefixMatch
from mooncake_kv.types import (
    BlockHash,
    BlockId,
    RequestId,
    RequestStateError,
    TokenCountError,
    TokenIdError,
)

__all__ = ["KVCacheManager"]

_log = logging.getLogger(__name__)


class KVCacheManager:
    """Ref-counted paged KV blocks with prefix caching, for one instance.

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks-1``).
        block_size: tokens per block.
        index: registered prefix index name: ``"hash"`` (default) or ``"radix"``.
        hash_algo: ``"xxh3_128"`` (default) or ``"sha256"``.
        enable_prefix_caching: if False, nothing is ever matched or cached.
        max_finished_ids: how many freed request ids are remembered to tell a double
            free from an unknown id.
        check_invariants: run the full consistency check after every mutating verb
            (slow; tests switch it on).
    """

    __slots__ = (
        "_allocator",
        "_block_size",
        "_bus",
        "_caching",
        "_hasher",
        "_index",
        "_index_name",
        "_lock",
        "_num_evicted",
        "_num_hit_tokens",
        "_num_queries",
        "_num_query_tokens",
        "_owner",
        "_requests",
        "_self_check",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        index: str = "hash",
        hash_algo: str = DEFAULT_HASH_ALGO,
        enable_prefix_caching: bool = True,
        max_finished_ids: int = 65536,
        check_invariants: bool = False,
    ) -> None:
        self._hasher = BlockHasher(block_size, hash_algo)
        self._block_size = block_size
        self._index_name = index
        self._index = create_index(index)
        watcher = self._index if self._index.tracks_refs else None
        self._allocator = BlockAllocator(num_blocks, watcher)
        self._caching = enable_prefix_caching
        self._bus = EventBus()
        self._requests = RequestTable(max_finished_ids)
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._self_check = check_invariants
        self._num_queries = self._num_query_tokens = self._num_hit_tokens = 0
        self._num_evicted = 0

    # ---- read-only properties (any thread) --------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._allocator.num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def hasher(self) -> BlockHasher:
        """The block hasher, for computing the same keys elsewhere (router, cluster index)."""
        return self._hasher

    @property
    def index_name(self) -> str:
        return self._index_name

    @property
    def index(self) -> PrefixIndex:
        """The prefix index, for inspection only (e.g. radix sizes); never mutate it."""
        return self._index

    @property
    def num_free_blocks(self) -> int:
        return self._allocator.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    # ---- scheduler verbs (owner thread) -----------------------------------------------
    @mutating
    def match_prefix(
        self,
        request_id: RequestId,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
        *,
        lookup: bool = True,
    ) -> PrefixMatch:
        """Register ``request_id`` and ref the longest cached prefix of its prompt.

        Args:
            token_ids: the prompt.
            extra_keys: cache salt, adapter id, non-token input digests (see hashing).
            lookup: False matches nothing (the prompt is computed in full, e.g. for its
                prompt logprobs) while its blocks are still committed for others to reuse.

        Returns:
            The matched blocks and ``num_cached_tokens`` (< ``len(token_ids)``).

        Raises:
            DuplicateRequestError: ``request_id`` is live (free it first).
            TokenIdError: a token id is not an integer in ``[0, 2**32)``.
        """
        self._requests.check_new(request_id)
        chain = self._chain(request_id, token_ids, extra_keys) if self._caching else None
        matched: list[BlockId] = []
        if chain is not None and lookup:
            matched = self._index.match(chain, (len(token_ids) - 1) // self._block_size)
            self._allocator.take_refs(matched)
        request = LiveRequest(chain, matched, self._block_size, len(token_ids))
        self._requests.add(request_id, request)
        num_cached = len(matched) * self._block_size
        self._num_queries += 1
        self._num_query_tokens += len(token_ids)
        self._num_hit_tokens += num_cached
        return PrefixMatch(tuple(matched), num_cached)

    def block_ids(self, request_id: RequestId) -> tuple[BlockId, ...]:
        """The request's block table now (a ``commit`` may have swapped a block for its
        cached twin).

        Raises:
            UnknownRequestError, RequestFinishedError.
        """
        with self._lock:
            return tuple(self._requests.live(request_id).block_ids)

    @mutating
    def try_allocate(self, request_id: RequestId, num_new_tokens: int) -> KVCacheBlocks | None:
        """Reserve slots for ``num_new_tokens`` more tokens (prefill, or one prefill chunk).

        Args:
            num_new_tokens: tokens after those already reserved; right after
                ``match_prefix`` that is ``len(prompt) - match.num_cached_tokens`` (or a
                chunk of it), never ``len(prompt)``.

        Returns:
            The request's block table, or None when too few blocks are free (no change).

        Raises:
            UnknownRequestError, RequestFinishedError,
            TokenCountError: a negative count, or one that reaches past the tokens given to
                ``match_prefix`` (reserve decode slots with ``try_append``).
        """
        request = self._requests.live(request_id)
        total = request.num_tokens + num_new_tokens
        if num_new_tokens > 0 and total > request.num_prompt_tokens:
            raise TokenCountError(
                request_id,
                f"try_allocate({request_id!r}, {num_new_tokens}) would reserve {total} slots, "
                f"but request {request_id!r} was matched with {request.num_prompt_tokens} "
                f"tokens and {request.num_tokens} are reserved already (the cached prefix "
                "counts); pass the tokens after those, at most "
                f"{max(0, request.num_prompt_tokens - request.num_tokens)} now (the first call "
                "takes len(prompt) - match.num_cached_tokens), and reserve decode slots with "
                "try_append",
            )
        return self._grow(request, request_id, num_new_tokens)

    @mutating
    def try_append(self, request_id: RequestId, num_tokens: int = 1) -> KVCacheBlocks | None:
        """Reserve slots for ``num_tokens`` decoded tokens; None = out of blocks (preempt).

        Raises:
            UnknownRequestError, RequestFinishedError, TokenCountError,
            RequestStateError: the request's prefill was never allocated.
        """
        request = self._requests.live(request_id)
        if not request.is_allocated:
            raise RequestStateError(
                request_id,
                f"request {request_id!r} has no prefill allocation; call try_allocate first",
            )
        return self._grow(request, request_id, num_tokens)

    @mutating
    def commit(self, request_id: RequestId, token_ids: Sequence[int]) -> int:
        """Cache the blocks of ``token_ids`` (the request's sequence so far) that filled.

        The KV of these tokens must be written; earlier tokens must be unchanged.
        Returns the number of blocks that became matchable.

        Raises:
            UnknownRequestError, RequestFinishedError,
            TokenCountError: more tokens than slots reserved.
            TokenIdError: a newly hashed token id is not an integer in ``[0, 2**32)``.
        """
        request = self._requests.live(request_id)
        if len(token_ids) > request.num_tokens:
            raise TokenCountError(
                request_id,
                f"commit of {len(token_ids)} tokens for request {request_id!r} exceeds its "
                f"{request.num_tokens} reserved slots; reserve them with try_allocate/try_append",
            )
        chain = request.chain
        full = len(token_ids) // self._block_size
        start = request.num_committed
        if chain is None or full <= start:
            return 0
        if full > len(chain):
            try:
                chain.extend(token_ids)
            except ValueError as error:
                raise TokenIdError(request_id, f"request {request_id!r}: {error}") from None
        own = request.block_ids[start:full]
        holders = self._index.insert(chain, start, own, request.last_holder)
        if holders == own:
            self._allocator.set_hashes(own, chain.hashes[start:full])
            runs = [(start, full)]
        else:
            runs = self._adopt_holders(request, start, own, holders)
        request.last_holder = holders[-1]
        request.num_committed = full
        if self._bus.has_subscribers:
            for event in stored_events(request.chain.hashes, token_ids,  # type: ignore[union-attr]
                                       request.block_ids, runs, self._block_size):
                self._bus.emit(event)
        return sum(stop - first for first, stop in runs)

    @mutating
    def free(self, request_id: RequestId) -> None:
        """Release every block of the request, chain tail first; the id is finished.

        Raises:
            DoubleFreeError: already freed.  UnknownRequestError: never registered.
        """
        request = self._requests.finish(request_id)
        self._allocator.release(request.block_ids[::-1])

    @mutating
    def evict(self, num_blocks: int) -> int:
        """Uncache up to ``num_blocks`` least recently used free blocks; returns how many."""
        evicted = self._allocator.evict(num_blocks)
        if evicted:
            self._forget(evicted)
        return len(evicted)

    @mutating
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block and emit ``AllCleared``.

        Returns:
            True, or False (nothing dropped, and a warning logged saying who holds blocks)
            while any request holds a block: ``free`` every request first.
        """
        num_used = self._allocator.num_blocks - self._allocator.num_free_blocks
        if num_used:
            holders = [rid for rid, request in self._requests.items() if request.block_ids]
            _log.warning(
                "reset_prefix_cache() dropped nothing: %d live request(s) hold %d block(s) "
                "(e.g. %s); free them (finish or preempt) first, then reset again",
                len(holders), num_used, ", ".join(map(repr, holders[:3])),
            )
            return False
        self._num_evicted += len(self._allocator.evict(self._allocator.num_evictable_blocks))
        self._index.clear()
        if self._bus.has_subscribers:
            self._bus.emit(AllCleared())
        return True

    @mutating
    def release_owner(self) -> None:
        """Let another thread become the owner with its next mutating verb."""
        self._owner = None

    # ---- any thread ----------------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        """A consistent snapshot of usage and hit counters (thread-safe)."""
        with self._lock:
            num_free = self._allocator.num_free_blocks
            return KVCacheStats(
                num_blocks=self._allocator.num_blocks,
                block_size=self._block_size,
                num_used_blocks=self._allocator.num_blocks - num_free,
                num_free_blocks=num_free,
                num_cached_blocks=len(self._index),
                num_running_requests=len(self._requests),
                num_queries=self._num_queries,
                num_query_tokens=self._num_query_tokens,
                num_hit_tokens=self._num_hit_tokens,
                num_evicted_blocks=self._num_evicted,
            )

    def snapshot(self) -> CacheSnapshot:
        """Ref counts, free queue order and cached blocks, consistently (thread-safe)."""
        with self._lock:
            cached = sorted(self._index.entries(), key=lambda entry: entry[1])
            return CacheSnapshot(
                ref_counts=tuple(self._allocator.ref_counts()),
                free_queue=tuple(self._allocator.free_queue()),
                cached=tuple(cached),
            )

    def holders(self) -> dict[RequestId, int]:
        """How many blocks each registered request holds (thread-safe).

        The ref counts' owners: a request that its scheduler finished but never ``free``-d
        still appears here, which is how ``kthena doctor`` reports a leak.
        """
        with self._lock:
            return {rid: len(request.block_ids) for rid, request in self._requests.items()}

    def subscribe(self, callback: KVEventCallback) -> None:
        """Call ``callback(event)`` for every later KV event (thread-safe)."""
        self._bus.subscribe(callback)

    def unsubscribe(self, callback: KVEventCallback) -> None:
        """Stop calling ``callback``; ValueError if it is not subscribed (thread-safe)."""
        self._bus.unsubscribe(callback)

    def open_event_queue(self) -> EventQueue:
        """Subscribe a thread-safe queue of events; ``drain()`` it from any thread."""
        return self._bus.open_queue()

    def check_invariants(self) -> None:
        """Raise AssertionError if refs, free queue, index and requests disagree."""
        with self._lock:
            holders = {rid: r.block_ids[::-1] for rid, r in self._requests.items()}
            check_consistency(self._allocator, self._index, holders)

    # ---- internals -------------------------------------------------------------------------
    def _chain(
        self, request_id: RequestId, token_ids: Sequence[int], extra_keys: ExtraKeys | None
    ) -> BlockChain:
        try:
            return BlockChain(self._hasher, token_ids, extra_keys)
        except ValueError as error:  # pack_tokens names the bad id and its position
            raise TokenIdError(request_id, f"request {request_id!r}: {error}") from None

    def _grow(
        self, request: LiveRequest, request_id: RequestId, num_tokens: int
    ) -> KVCacheBlocks | None:
        if num_tokens < 0:
            raise TokenCountError(
                request_id, f"request {request_id!r}: token count must be >= 0, got {num_tokens}"
            )
        total = request.num_tokens + num_tokens
        needed = -(-total // self._block_size) - len(request.block_ids)
        if needed <= 0:
            request.num_tokens = total
            request.is_allocated = True
            return KVCacheBlocks(tuple(request.block_ids), 0)
        got = self._allocator.try_allocate(needed)
        if got is None:
            return None
        new_blocks, evicted = got
        request.block_ids += new_blocks
        request.num_tokens = total
        request.is_allocated = True
        if evicted:  # announced before the caller can hand the blocks to a worker
            self._forget(evicted)
        return KVCacheBlocks(tuple(request.block_ids), needed)

    def _forget(self, evicted: list[tuple[BlockId, BlockHash]]) -> None:
        self._index.remove(evicted)
        self._num_evicted += len(evicted)
        if self._bus.has_subscribers:
            hashes = tuple(h for _, h in evicted)
            self._bus.emit(BlockRemoved(hashes, tuple(b for b, _ in evicted)))

    def _adopt_holders(
        self, request: LiveRequest, start: int, own: list[BlockId], holders: list[BlockId]
    ) -> list[tuple[int, int]]:
        """Cache the inserted blocks; swap the others for their already-cached twins.

        A twin holds the same tokens under the same prefix, so its KV is the request's own:
        the request refs the twin in its block table and releases its copy (it never holds
        two blocks for one position). Returns the ``[first, stop)`` position runs that
        became cached.
        """
        hashes = request.chain.hashes  # type: ignore[union-attr]
        runs: list[tuple[int, int]] = []
        for position, (block_id, holder) in enumerate(zip(own, holders, strict=True), start):
            if block_id == holder:
                self._allocator.set_hashes([block_id], [hashes[position]])
                if runs and runs[-1][1] == position:
                    runs[-1] = (runs[-1][0], position + 1)
                else:
                    runs.append((position, position + 1))
                continue
            self._allocator.take_refs([holder])
            self._allocator.release([block_id])
            request.block_ids[position] = holder
        return runs
