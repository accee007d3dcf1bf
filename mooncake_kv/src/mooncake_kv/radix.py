"""Radix prefix index: a page-granular radix tree over block token bytes (SGLang-style).

One tree per root key (the chain root, which digests the salt and adapter id). Each node
holds a run of pages (a page = one full block: its packed tokens plus any non-token input
digest) and the blocks caching them; children are keyed by their first page::

    root(ns) ─┬─ [sys0 sys1 sys2] ─┬─ [user0 gen0]          a match walks pages,
              │                    └─ [user1 user1' gen1]   comparing token bytes, so
              └─ [other0 ...]                               a hash collision cannot
                                                            return wrong blocks
An insert below the middle of a node splits it. Eviction always removes the last page of
a leaf (the manager evicts chain tails first), so nodes shrink from the end and vanish
when empty; they are not re-merged (as in SGLang).

``lock_ref`` accounting: a node's ``lock_ref`` counts its pages whose block is referenced.
``protected_size`` sums them, ``evictable_size`` counts the rest, and
``evictable_size + protected_size == total_size`` always holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mooncake_kv.hashing import BlockChain
from mooncake_kv.types import BlockHash, BlockId

__all__ = ["RadixIndex"]


class _Node:
    __slots__ = ("block_ids", "children", "hashes", "keys", "lock_ref", "namespace", "parent")

    def __init__(
        self,
        parent: _Node | None,
        keys: list[bytes],
        block_ids: list[BlockId],
        hashes: list[BlockHash],
        namespace: bytes = b"",
    ) -> None:
        self.parent = parent
        self.keys = keys
        self.block_ids = block_ids
        self.hashes = hashes
        self.children: dict[bytes, _Node] = {}
        self.lock_ref = 0
        self.namespace = namespace


class RadixIndex:
    """Radix tree of pages with per-node ``lock_ref`` and evictable/protected sizes."""

    __slots__ = ("_protected", "_roots", "_where", "evictable_size", "protected_size")
    tracks_refs = True

    def __init__(self) -> None:
        self._roots: dict[bytes, _Node] = {}
        self._where: dict[BlockId, _Node] = {}
        self._protected: set[BlockId] = set()
        self.evictable_size = 0
        self.protected_size = 0

    def __len__(self) -> int:
        return len(self._where)

    @property
    def total_size(self) -> int:
        return len(self._where)

    # ---- match / insert -----------------------------------------------------------------
    def match(self, chain: BlockChain, max_blocks: int) -> list[BlockId]:
        found: list[BlockId] = []
        node = self._roots.get(chain.root)
        if node is None or max_blocks <= 0:
            return found
        keys = chain.page_keys(0, min(max_blocks, len(chain)))
        i, n = 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            j = 0
            run = len(child.keys)
            while j < run and i < n and child.keys[j] == keys[i]:
                found.append(child.block_ids[j])
                i += 1
                j += 1
            if j < run:
                break
            node = child
        return found

    def insert(self, chain: BlockChain, start: int, block_ids: Sequence[BlockId],
               parent_block: BlockId | None) -> list[BlockId]:
        if parent_block is None:
            node = self._roots.get(chain.root)
            if node is None:
                node = self._roots[chain.root] = _Node(None, [], [], [], chain.root)
            pos = 0
        else:
            node = self._where[parent_block]
            ids = node.block_ids
            pos = len(ids) if ids[-1] == parent_block else ids.index(parent_block) + 1
        stop = start + len(block_ids)
        keys = chain.page_keys(start, stop)
        held: list[BlockId] = []
        for key, block_id, block_hash in zip(
            keys, block_ids, chain.hashes[start:stop], strict=True
        ):
            node, pos, holder = self._insert_page(node, pos, key, block_id, block_hash)
            held.append(holder)
        return held

    def _insert_page(
        self, node: _Node, pos: int, key: bytes, block_id: BlockId, block_hash: BlockHash
    ) -> tuple[_Node, int, BlockId]:
        """Place one page after position ``pos`` of ``node``; return where it now lives."""
        if pos < len(node.keys):
            if node.keys[pos] == key:
                return node, pos + 1, node.block_ids[pos]
            self._split(node, pos)
        child = node.children.get(key)
        if child is not None:
            return child, 1, child.block_ids[0]
        if node.parent is not None and not node.children:
            target = node  # extend a leaf in place: keeps runs long
            target.keys.append(key)
            target.block_ids.append(block_id)
            target.hashes.append(block_hash)
        else:
            target = _Node(node, [key], [block_id], [block_hash])
            node.children[key] = target
        self._where[block_id] = target
        # the committing request holds the block, so it starts protected
        target.lock_ref += 1
        self._protected.add(block_id)
        self.protected_size += 1
        return target, len(target.keys), block_id

    def _split(self, node: _Node, pos: int) -> None:
        tail = _Node(node, node.keys[pos:], node.block_ids[pos:], node.hashes[pos:])
        tail.children = node.children
        for child in tail.children.values():
            child.parent = tail
        tail.lock_ref = sum(1 for b in tail.block_ids if b in self._protected)
        node.lock_ref -= tail.lock_ref
        for block_id in tail.block_ids:
            self._where[block_id] = tail
        del node.keys[pos:], node.block_ids[pos:], node.hashes[pos:]
        node.children = {tail.keys[0]: tail}

    # ---- removal and ref accounting -----------------------------------------------------
    def remove(self, evicted: Sequence[tuple[BlockId, BlockHash]]) -> None:
        for block_id, block_hash in evicted:
            self._remove_tail(block_id, block_hash)

    def _remove_tail(self, block_id: BlockId, block_hash: BlockHash) -> None:
        node = self._where.pop(block_id)
        assert node.block_ids[-1] == block_id and not node.children, (
            f"block {block_id} is not the tail of a leaf; evict chain tails first"
        )
        assert node.hashes[-1] == block_hash and block_id not in self._protected
        key = node.keys.pop()
        node.block_ids.pop()
        node.hashes.pop()
        self.evictable_size -= 1
        if node.keys:
            return
        parent = node.parent
        assert parent is not None
        del parent.children[key]
        if parent.parent is None and not parent.children:
            del self._roots[parent.namespace]

    def clear(self) -> None:
        self._roots.clear()
        self._where.clear()
        self._protected.clear()
        self.evictable_size = 0
        self.protected_size = 0

    def protect(self, block_ids: list[BlockId]) -> None:
        where = self._where
        for block_id in block_ids:
            where[block_id].lock_ref += 1
            self._protected.add(block_id)
        self.protected_size += len(block_ids)
        self.evictable_size -= len(block_ids)

    def unprotect(self, block_ids: list[BlockId]) -> None:
        where = self._where
        for block_id in block_ids:
            where[block_id].lock_ref -= 1
            self._protected.remove(block_id)
        self.protected_size -= len(block_ids)
        self.evictable_size += len(block_ids)

    # ---- inspection -----------------------------------------------------------------------
    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def entries(self) -> Iterator[tuple[BlockHash, BlockId]]:
        pairs = [p for n in self._nodes() for p in zip(n.hashes, n.block_ids, strict=True)]
        return iter(pairs)

    def check_invariants(self, ref_counts: Sequence[int]) -> None:
        num_pages = num_locked = 0
        for node in self._nodes():
            self._check_node(node, ref_counts)
            num_pages += len(node.keys)
            num_locked += node.lock_ref
        assert num_pages == len(self._where), "page count disagrees with the block map"
        assert num_locked == self.protected_size == len(self._protected)
        assert self.evictable_size + self.protected_size == self.total_size

    def _check_node(self, node: _Node, ref_counts: Sequence[int]) -> None:
        if node.parent is None:
            assert not node.keys and self._roots[node.namespace] is node
            return
        assert node.keys and len(node.keys) == len(node.block_ids) == len(node.hashes)
        assert node.parent.children[node.keys[0]] is node, "child keyed by its first page"
        locked = [ref_counts[b] > 0 for b in node.block_ids]
        assert all(self._where[b] is node for b in node.block_ids)
        assert locked == [b in self._protected for b in node.block_ids], (
            "protected pages disagree with the blocks' ref counts"
        )
        assert node.lock_ref == sum(locked), "lock_ref counts the node's referenced pages"
        # referenced pages are prefix-closed: a locked page's parent page is locked too
        assert locked == sorted(locked, reverse=True), "unlocked page before a locked one"
        if locked[0] and node.parent.parent is not None:
            assert ref_counts[node.parent.block_ids[-1]] > 0, "locked node under unlocked one"
