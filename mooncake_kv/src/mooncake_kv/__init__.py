"""mooncake_kv: ref-counted paged KV blocks, prefix caching, KV events and the cluster index.

Pure Python over ints (torch only for the tensor pool). The scheduler talks to
``KVCacheManager``; see docs/mooncake_kv.md for the verb flow.
"""

from mooncake_kv.allocator import BlockAllocator
from mooncake_kv.cluster import ClusterPrefixIndex
from mooncake_kv.events import AllCleared, BlockRemoved, BlockStored, EventQueue, KVEvent
from mooncake_kv.hashing import BlockHasher, ExtraKeys, pack_tokens, register_hash_algorithm
from mooncake_kv.index import HashChainIndex, PrefixIndex, available_indexes, register_index
from mooncake_kv.manager import KVCacheManager
from mooncake_kv.radix import RadixIndex
from mooncake_kv.results import CacheSnapshot, KVCacheBlocks, KVCacheStats, PrefixMatch
from mooncake_kv.types import (
    BlockHash,
    BlockId,
    DoubleFreeError,
    DuplicateRequestError,
    InstanceId,
    KVCacheError,
    OwnerThreadError,
    RequestFinishedError,
    RequestId,
    RequestStateError,
    TokenCountError,
    UnknownIndexError,
    UnknownInstanceError,
    UnknownRequestError,
)

__all__ = [
    # block manager (scheduler-facing)
    "KVCacheManager",
    "PrefixMatch",
    "KVCacheBlocks",
    "KVCacheStats",
    "CacheSnapshot",
    "ExtraKeys",
    # ids and errors
    "BlockId",
    "BlockHash",
    "RequestId",
    "InstanceId",
    "KVCacheError",
    "UnknownRequestError",
    "RequestFinishedError",
    "DoubleFreeError",
    "DuplicateRequestError",
    "RequestStateError",
    "TokenCountError",
    "OwnerThreadError",
    "UnknownIndexError",
    "UnknownInstanceError",
    # building blocks and seams
    "BlockAllocator",
    "BlockHasher",
    "pack_tokens",
    "register_hash_algorithm",
    "PrefixIndex",
    "HashChainIndex",
    "RadixIndex",
    "register_index",
    "available_indexes",
    # events and the cluster index
    "KVEvent",
    "BlockStored",
    "BlockRemoved",
    "AllCleared",
    "EventQueue",
    "ClusterPrefixIndex",
]

# Pool, layout and tiers (torch for the pool): exports are added below this line.
