"""KV tiers below the device pool: host memory, Mooncake Store, and the offload coordinators
(`TieredKVCache`, synchronous; `AsyncOffloader`, on background threads).

Importing this package does not import torch or the Mooncake wheel; the store tier loads
`mooncake.store` only when one is opened.
"""

from mooncake_kv.tiers.async_offload import (
    AsyncOffloader,
    OffloadSnapshot,
    PromotionJob,
    TierCounters,
)
from mooncake_kv.tiers.base import (
    CorruptBlockError,
    KVTier,
    TierConfig,
    TierError,
    TierUnavailableError,
    UnknownTierError,
    available_tiers,
    frame_block,
    open_tier,
    register_tier,
    unframe_block,
)
from mooncake_kv.tiers.host import HostMemoryTier, HostTierConfig
from mooncake_kv.tiers.offload import BlockStorage, OffloadStats, TieredKVCache, TierStats
from mooncake_kv.tiers.store import MooncakeStoreTier, StoreTierConfig

__all__ = [
    "AsyncOffloader",
    "BlockStorage",
    "OffloadSnapshot",
    "PromotionJob",
    "TierCounters",
    "OffloadStats",
    "TierStats",
    "TieredKVCache",
    "CorruptBlockError",
    "HostMemoryTier",
    "HostTierConfig",
    "KVTier",
    "MooncakeStoreTier",
    "StoreTierConfig",
    "TierConfig",
    "TierError",
    "TierUnavailableError",
    "UnknownTierError",
    "available_tiers",
    "frame_block",
    "open_tier",
    "register_tier",
    "unframe_block",
]
