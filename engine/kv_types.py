"""The small core types of the KV cache, and the two seams the cache manager talks through.

Everything here is shared by the cache manager (``engine.kv_cache_manager``), the block pool, the
prefix index, the scheduler and the lower tiers (``engine.tiers``), so it lives in one file that
imports nothing heavy (no torch: import-linter contract ``engine-core-torch-free``)::

    scheduler ──match/admit/grow/commit/free/poll_restores──► KVCacheManager ──► BlockPool + PrefixIndex
                                                                   │  ▲
                                 CacheObserver.phase(CachePhase) ◄─┘  │ LowerTier (engine.tiers.TierHook)
                                 (LLMEngine's timers)                 └ spill / lookup / restore
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NewType, Protocol, runtime_checkable

from engine.protocol import TenantScope

BlockHash = NewType("BlockHash", bytes)  # chained SHA-256 of a full block and its whole prefix


class TierName(enum.StrEnum):
    """Where KV bytes live. HBM is the block pool; the others are ``engine.tiers``."""

    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"


class CachePhase(enum.StrEnum):
    """Engine-thread work of cache management, timed by a ``CacheObserver``
    (the ``phase`` label of ``prefixgate_cache_manage_seconds``)."""

    HASH = "hash"  # hashing full blocks (Request construction, decode blocks filling)
    MATCH = "match"  # prefix lookups in the HBM index
    EVICT = "evict"  # evicting indexed blocks (with a lower tier: their spill copy too)
    REGISTER = "register"  # indexing blocks that became full
    TIER = "tier"  # lower-tier work per step (restores, spills), less the phases above done inside


class QueueReason(enum.StrEnum):
    """Why a waiting request was not admitted at the last step."""

    NO_KV_BLOCKS = "no_kv_blocks"
    BATCH_FULL = "batch_full"
    TENANT_OVER_QUOTA = "tenant_over_quota"
    TOKEN_BUDGET = "token_budget"
    RESTORING = "restoring"  # its prefix is being restored from a lower KV tier
    PREFIX_COMPUTING = "prefix_computing"  # its next prefix block is being computed by a running request


@dataclass(frozen=True)
class MatchResult:
    """The cached prefix of a sequence in HBM.

    Attributes:
        block_ids: cached blocks in order (block ``i`` holds tokens ``i*bs .. (i+1)*bs-1``).
        block_hashes: their hashes (the first ``len(block_ids)`` of the sequence's hashes).
        cached_tokens: ``len(block_ids) * block_size``; always < the sequence length, so at least
            its last token is computed and there are logits to sample from.
        computing: the block right after the match is being computed by a running request; once
            that request commits it, the match grows (so waiting beats recomputing it).
    """

    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    cached_tokens: int
    computing: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


EMPTY_MATCH = MatchResult((), (), 0)


@dataclass(frozen=True)
class EvictedBlock:
    """A block leaving HBM; its bytes are still in ``block_id`` while the lower tier is told."""

    block_hash: BlockHash
    namespace: bytes
    depth: int  # chain position: the block holds tokens depth*bs .. (depth+1)*bs-1
    block_id: int
    # seconds left of its explicit retention (cache_control ttl & co) when it left HBM; 0 = none.
    # A duration, not a deadline: HBM keeps monotonic time, the tiers wall-clock time.
    retained_for_s: float = 0.0
    # the tenant key that last held it (``BlockPool``'s holder): whose lower-tier caps its spill counts against
    holder: bytes = b""


@dataclass(frozen=True)
class FinishedRestore:
    """A restore is over: the first ``num_blocks`` of its blocks hold the restored KV (0 = a miss)."""

    request_id: str
    num_blocks: int


class CacheRequest(Protocol):
    """What the cache manager reads of a request (``engine.request.Request`` has these)."""

    @property
    def request_id(self) -> str: ...

    @property
    def tenant(self) -> TenantScope: ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def reads_prefix_cache(self) -> bool:
        """False: the request must compute its prompt (it scores every position), so it gets no
        hit in any tier; what it computes is still indexed."""
        ...


@runtime_checkable
class CacheObserver(Protocol):
    """Told of the cache manager's work; ``LLMEngine`` times it into ``CachePhase`` totals.

    Contract: ``phase`` returns a context manager entered around one piece of work. Phases nest
    (an eviction inside a tier restore's allocation); an observer that times them should count a
    nested phase's seconds once, in the inner phase. Called from the step-loop thread only.
    """

    def phase(self, phase: CachePhase) -> AbstractContextManager[None]: ...


@runtime_checkable
class BlockEventObserver(Protocol):
    """Told which blocks the HBM prefix index gains and loses, so that a router elsewhere can know
    where a prefix lives (``engine.kv_events.KVEventPublisher`` publishes them to the gateway).

    Contract: called from the step-loop thread only, after the index changed; an implementation
    must not block it (queue and return) and must not call back into the manager. A hash already
    names its whole prefix (chained), so ``parent`` is informative only (None where unknown).
    """

    def blocks_stored(self, hashes: Sequence[BlockHash], parent: BlockHash | None) -> None: ...

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class LowerTier(Protocol):
    """The KV tiers below HBM, as the cache manager uses them; ``engine.tiers.TierHook`` implements it.

    Contract (all calls but ``blocks_of`` come from the step-loop thread):
        - ``spill`` is called before ``block.block_id`` is reused: copy its bytes out now (the
          manager hands the block out right after); store them, encrypted with ``tenant.cipher``,
          under ``(namespace, block_hash)``, in batches at ``flush_spills``. It must not call back
          into the manager. A block with ``retained_for_s > 0`` stays retained below HBM for that
          long: evicted there only after unretained blocks, within the tenant's tier quotas.
        - ``lookup`` returns how many leading ``hashes`` (the chain right after the HBM match) the
          tiers hold. In-memory only: no I/O, no crypto.
        - ``start_restore`` begins reading and decrypting ``hashes`` into the HBM blocks
          ``block_ids`` (the manager allocated and holds them). ``finished_restores`` reports the
          restores that are over, after writing their bytes into the blocks; it may wait up to
          ``timeout_s`` for the first one. ``cancel_restore`` forgets one (its bytes are never
          written); the manager frees its blocks.
        - What the tiers keep of a tenant stays within its DRAM / NVMe block quotas
          (``TenantScope.kv_block_quota_dram`` / ``kv_block_quota_nvme``): over one, its own
          oldest blocks in that tier go first.
        - ``blocks_of`` counts the blocks held for a namespace per tier (``{"dram": n, "nvme": m}``
          for the enabled ones); called from any thread (a tenant's ``GET /v1/cache``), so it only
          reads counters under the tiers' own locks.
    """

    def spill(self, tenant: TenantScope, block: EvictedBlock) -> None: ...

    def flush_spills(self, *, due_only: bool = False) -> None:
        """Hand the pending spills down. ``due_only``: nothing waits for them now (no request is
        about to look the tiers up), so a run that may still grow can stay pending a little longer
        (the implementation bounds how long and how large)."""
        ...

    def lookup(self, namespace: bytes, hashes: Sequence[BlockHash]) -> int: ...

    def start_restore(
        self, request_id: str, tenant: TenantScope, hashes: Sequence[BlockHash], block_ids: Sequence[int]
    ) -> None: ...

    def finished_restores(self, timeout_s: float = 0.0) -> list[FinishedRestore]: ...

    def cancel_restore(self, request_id: str) -> None: ...

    def blocks_of(self, namespace: bytes) -> dict[str, int]: ...

    def stats(self) -> dict[str, Any]: ...

    def blocks_by_tenant(self) -> dict[TierName, dict[str, int]]:
        """Blocks held per tier (DRAM, NVMe) per tenant ``metrics_label``; in-memory, no I/O."""
        ...

    def blocks_held(self, tenant_key: bytes) -> dict[str, int]:
        """Blocks the one tenant ``tenant_key`` holds per tier (``{"dram": n, "nvme": m}`` for the
        enabled ones); like ``blocks_of``, called from any thread, reading counters under the tiers' locks."""
        ...

    def close(self) -> None: ...
