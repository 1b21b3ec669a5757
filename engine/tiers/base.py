"""What every KV tier below HBM shares: the unit it stores, the ``Tier`` Protocol, its errors.

The unit is a *segment*: a run of consecutive blocks of one tenant's hash chain, encrypted as one
blob (one nonce, one tag). A segment's blocks stay addressable one by one: the tier keeps a map
``(namespace, block hash) -> (segment id, position)``, so a prefix lookup walks the chain block by
block and a restore decrypts each segment it touches once.

::

    chain of one prompt:  h0 -> h1 -> h2 -> h3 -> h4 -> h5      (h_i = SHA-256(h_{i-1} || tokens_i))
    segments in a tier:   [ seg A: h0 h1 h2 ][ seg B: h3 h4 ]   (h5 still in HBM, or gone)
    blob of seg B:        cipher.encrypt(bytes(block h3) || bytes(block h4), aad(ns, model, h3 h4))

This module imports only the standard library and ``engine.kv_types``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine.kv_types import BlockHash, TierName


class SkipReason(enum.StrEnum):
    """Why blocks were not written to a tier (the ``reason`` label of the skip metric)."""

    NO_CIPHER = "no_cipher"  # the tenant has no data key: never written in clear
    PRESENT = "present"  # already in the tier
    COST = "cost"  # recomputing is cheaper than restoring from there
    IO_ERROR = "io_error"
    FULL = "full"
    QUOTA = "quota"  # the tenant's cap (or the others' fair-share floors) leaves no room
    TOO_LARGE = "too_large"  # larger than the tier or the tenant's cap


@dataclass(frozen=True)
class TenantCap:
    """A tenant's limits in one tier (``None`` = none): bytes, and blocks (its block quota)."""

    bytes: int | None = None
    blocks: int | None = None


TenantCapFn = Callable[[bytes], TenantCap]  # a segment owner's (tenant key's) caps in one tier


class TierError(Exception):
    """Base for errors a tier reports to the manager (never to a user: the manager turns each
    into a skipped demotion or a miss, and a metric)."""


class TierWriteError(TierError):
    """The storage under the tier refused a write (ENOSPC, EROFS, EIO ...): the segment was not
    stored and nothing half-written remains."""


@dataclass
class SegmentMeta:
    """One stored segment. Mutable only in its access bookkeeping (``last_access_s``, ``hits``).

    Attributes:
        segment_id: unique in its tier (hex string; also the NVMe file name).
        namespace: the tenant namespace that seeded the hash chain (what a lookup matches on).
        owner: the tenant key charged for it (``TenantScope.tenant_key`` of the tenant whose
            request last held the blocks in HBM): the per-tenant caps, block quotas and fair-share
            floors count by owner, never by namespace. Empty = the namespace (one tenant per
            namespace).
        tenant_label: bounded-cardinality label for metrics.
        hashes: the segment's block hashes, in chain order.
        block_bytes: plaintext bytes of one block (``kv_bytes_per_block`` of the runner).
        nbytes: bytes the blob occupies in the tier (ciphertext incl. nonce and tag).
        created_s / last_access_s: wall-clock seconds (``time.time``), so TTLs survive restarts.
        expires_s: wall-clock deadline after which the segment must be deleted; None = never.
        hits: how many restores read this segment.
        retain_until_s: wall-clock end of an explicit retention (cache_control ttl,
            prompt_cache_retention, a tenant setting) the blocks carried when they left HBM, or
            extended later; None = none. Until then the tier evicts the segment only after every
            unretained candidate (``engine.tiers.placement``). It never outlives ``expires_s``.
    """

    segment_id: str
    namespace: bytes
    tenant_label: str
    hashes: tuple[BlockHash, ...]
    block_bytes: int
    nbytes: int
    created_s: float
    last_access_s: float
    expires_s: float | None = None
    hits: int = 0
    retain_until_s: float | None = None
    owner: bytes = b""

    def __post_init__(self) -> None:
        if not self.owner:
            self.owner = self.namespace

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def expired(self, now_s: float) -> bool:
        return self.expires_s is not None and now_s >= self.expires_s

    def retained(self, now_s: float) -> bool:
        """Under a live retention: evicted only after the tier's unretained candidates."""
        return self.retain_until_s is not None and now_s < self.retain_until_s


@dataclass(frozen=True)
class BlockLocation:
    """Where one block lives inside a tier."""

    segment_id: str
    position: int  # index of the block inside the segment's hashes


@dataclass(frozen=True)
class PutResult:
    """What a ``put`` did.

    ``stored`` is False when the tier refused the segment (``reason`` says why: "too_large",
    "quota", "full"; the values of ``SkipReason``). ``evicted`` lists the segments removed to make room, with their blobs when
    the tier can hand them back for free (DRAM: so the manager can demote them to NVMe) or
    ``None`` (NVMe: they are gone).
    """

    stored: bool
    reason: str | None = None
    evicted: Sequence[tuple[SegmentMeta, bytes | memoryview | None]] = field(default_factory=tuple)


@dataclass(frozen=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    num_segments: int
    num_blocks: int
    bytes_by_tenant: dict[str, int]
    blocks_by_tenant: dict[str, int] = field(default_factory=dict)  # metrics label -> blocks (its block quota counts these)


@runtime_checkable
class Tier(Protocol):
    """A bounded store of encrypted segments, keyed by (namespace, block hash).

    Contract (both tiers):
        - Thread-safe: the manager calls it from a worker pool and from the step loop.
        - ``contains`` is cheap (an in-memory map, no I/O) and never returns an expired block.
        - ``put`` is all-or-nothing: either the segment is stored and every one of its blocks is
          findable, or nothing of it remains. To make room it evicts other segments under the
          quota rules of ``engine.tiers.placement`` (per-tenant cap, fair-share floor, lowest
          value first) and reports them in ``PutResult.evicted``. A block already stored in an
          older segment is re-pointed to the new one (newest wins); a segment with no block left
          pointing at it is deleted.
        - ``get`` returns the segment's metadata and blob, or None if it is gone; it counts a hit.
        - ``evict`` removes one segment and returns its blob if the tier holds it in memory.
        - ``retain`` extends the retention of the segments holding ``hashes`` to ``until_s``
          (never shortens it) and returns how many of those blocks it found.
        - Eviction order: segments under a live retention (``SegmentMeta.retained``) go only after
          every unretained candidate, inside the same per-tenant caps and floors.
        - ``used_bytes <= capacity_bytes`` at all times.
    """

    name: TierName
    capacity_bytes: int

    def contains(self, namespace: bytes, block_hash: BlockHash) -> BlockLocation | None: ...

    def get(self, segment_id: str) -> tuple[SegmentMeta, bytes] | None: ...

    def put(self, meta: SegmentMeta, blob: bytes) -> PutResult: ...

    def evict(self, segment_id: str) -> tuple[SegmentMeta, bytes | None] | None: ...

    def expired_segments(self, now_s: float) -> list[str]: ...

    def segments_of(self, namespace: bytes) -> list[str]: ...

    def retain(self, namespace: bytes, hashes: Sequence[BlockHash], until_s: float) -> int: ...

    def stats(self) -> TierStats: ...
