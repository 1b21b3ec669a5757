"""KV tiers below HBM: encrypted DRAM and NVMe spill with cost-aware, quota-fair eviction.

The engine's cache manager sees them through ``TierHook``, which implements the engine-side
``engine.kv_types.LowerTier`` Protocol over a ``TierManager`` (see ``engine.tiers.manager``); the
tiers themselves implement the ``Tier`` Protocol of ``engine.tiers.base``.
"""

from engine.tiers.base import (
    BlockLocation,
    SegmentMeta,
    SkipReason,
    TenantCap,
    Tier,
    TierError,
    TierStats,
    TierWriteError,
)
from engine.tiers.codec import FORMAT_VERSION, segment_aad
from engine.tiers.cost import CostModel, TierRates
from engine.tiers.dram import DramTier
from engine.tiers.engine_hook import TierHook, build_tier_hook
from engine.tiers.manager import DemoteReport, RestoreResult, TenantTierPolicy, TierManager, TierMatch
from engine.tiers.null_cipher import InsecureNullCipher, NullCipher
from engine.tiers.nvme import NvmeTier

__all__ = [
    "FORMAT_VERSION", "BlockLocation", "CostModel", "DemoteReport", "DramTier", "InsecureNullCipher",
    "NullCipher", "NvmeTier", "RestoreResult", "SegmentMeta", "SkipReason", "TenantCap", "TenantTierPolicy", "Tier", "TierError",
    "TierManager", "TierMatch", "TierRates", "TierHook", "TierStats", "TierWriteError", "build_tier_hook", "segment_aad",
]
