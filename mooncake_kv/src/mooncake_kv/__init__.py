"""mooncake_kv: ref-counted paged KV blocks, prefix caching, KV events and the cluster index.

Pure Python over ints (torch, the ``[pool]`` extra, only for the tensor pool and
``paged_batch``). The scheduler talks to ``KVCacheManager``; see docs/mooncake_kv.md for the
verb flow.
"""

from mooncake_kv.allocator import BlockAllocator
from mooncake_kv.cluster import ClusterPrefixIndex
from mooncake_kv.events import AllCleared, BlockRemoved, BlockStored, EventQueue, KVEvent
from mooncake_kv.hashing import (
    BlockHasher,
    ExtraKeys,
    available_hash_algorithms,
    pack_tokens,
    register_hash_algorithm,
)
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
    TokenIdError,
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
    "TokenIdError",
    "OwnerThreadError",
    "UnknownIndexError",
    "UnknownInstanceError",
    # building blocks and seams
    "BlockAllocator",
    "BlockHasher",
    "pack_tokens",
    "register_hash_algorithm",
    "available_hash_algorithms",
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
    # shared pools' /dev/shm files (no torch), then the torch-backed pool and the paged-ops
    # inputs, loaded on first access
    "shared_pool_paths",
    "KVPool", "KVPoolHandle", "PoolClosedError", "PoolExistsError", "PoolNotFoundError",
    "PoolMismatchError", "BlockPayloadError",
    "PagedBatch", "PagedBatchError", "paged_batch",
]

# name -> the torch-backed module that defines it
_TORCH_NAMES = {
    **dict.fromkeys(("KVPool", "KVPoolHandle", "PoolClosedError", "PoolExistsError",
                     "PoolNotFoundError", "PoolMismatchError", "BlockPayloadError"), "pool"),
    **dict.fromkeys(("PagedBatch", "PagedBatchError", "paged_batch"), "paged"),
}


def __getattr__(name: str):
    """Load the torch-backed modules only when one of their names is first used."""
    module_name = _TORCH_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mooncake_kv' has no attribute {name!r}")
    import importlib

    try:
        module = importlib.import_module(f"mooncake_kv.{module_name}")
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        raise ModuleNotFoundError(
            f"mooncake_kv.{name} needs torch, which is not installed; install the pool extra: "
            "pip install 'mooncake-kv[pool]' (from a checkout: pip install './mooncake_kv[pool]')",
            name="torch",
        ) from error
    return getattr(module, name)
