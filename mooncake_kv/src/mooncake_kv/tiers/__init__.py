"""KV tiers below the device pool: host memory, Mooncake Store, and the offload coordinators
(`TieredKVCache`, synchronous; `AsyncOffloader`, on background threads).

Importing this package does not import torch or the Mooncake wheel; the store tier loads
`mooncake.store` only when one is opened.
"""

from mooncake_kv.tiers import base
from mooncake_kv.tiers.async_offload import (
           AsyncOffloader,
           OffloadSnapshot,
           PromotionJob,
           TierCounters,
)
from mooncake_kv.tiers.base import *  # noqa: F403 - the tier protocol, errors and registry
from mooncake_kv.tiers.host import HostMemoryTier, HostTierConfig
from mooncake_kv.tiers.offload import BlockStorage, OffloadStats, TieredKVCache, TierStats
from mooncake_kv.tiers.store import MooncakeStoreTier, StoreTierConfig

__all__ = [*base.__all__,
           "AsyncOffloader", "BlockStorage", "OffloadSnapshot", "PromotionJob",
           "TierCounters", "OffloadStats", "TierStats", "TieredKVCache",
           "HostMemoryTier", "HostTierConfig", "MooncakeStoreTier", "StoreTierConfig"]
