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
from mooncake_kv._shm_names import shared_pool_paths  # noqa: E402
from mooncake_kv.layout import (  # noqa: E402
    DEFAULT_LAYOUT,
    BlockIdError,
    ByteRange,
    KVLayout,
    KVPart,
    LayerIndexError,
    LayoutError,
    LayoutKind,
    LayoutMismatchError,
    RangePair,
)
from mooncake_kv.sizing import (  # noqa: E402
    KVDtype,
    KVShape,
    SizingError,
    kv_cache_max_tokens,
    max_num_blocks,
    max_num_tokens,
)
from mooncake_kv.tiers import (  # noqa: E402
    BlockStorage,
    CorruptBlockError,
    HostMemoryTier,
    HostTierConfig,
    KVTier,
    MooncakeStoreTier,
    OffloadStats,
    StoreTierConfig,
    TierConfig,
    TieredKVCache,
    TierError,
    TierStats,
    TierUnavailableError,
    UnknownTierError,
    available_tiers,
    open_tier,
    register_tier,
)

__all__ += [
    "DEFAULT_LAYOUT", "BlockIdError", "ByteRange", "KVLayout", "KVPart", "LayerIndexError", "LayoutError",
    "LayoutKind", "LayoutMismatchError", "RangePair",
    "KVDtype", "KVShape", "SizingError", "kv_cache_max_tokens", "max_num_blocks",
    "max_num_tokens",
    "BlockStorage", "CorruptBlockError", "HostMemoryTier", "HostTierConfig", "KVTier", "MooncakeStoreTier",
    "OffloadStats", "StoreTierConfig", "TierConfig", "TieredKVCache", "TierError", "TierStats",
    "TierUnavailableError", "UnknownTierError", "available_tiers", "open_tier", "register_tier",
    # shared pools' /dev/shm files (no torch), then the torch-backed pool, loaded on first access
    "shared_pool_paths",
    "KVPool", "KVPoolHandle", "PoolClosedError", "PoolExistsError", "PoolNotFoundError",
    "PoolMismatchError", "BlockPayloadError",
]

_POOL_NAMES = frozenset({"KVPool", "KVPoolHandle", "PoolClosedError", "PoolExistsError",
                         "PoolNotFoundError", "PoolMismatchError", "BlockPayloadError"})


def __getattr__(name: str):
    """Load the torch-backed pool only when one of its names is first used."""
    if name in _POOL_NAMES:
        from mooncake_kv import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'mooncake_kv' has no attribute {name!r}")
