"""The warm tier: encrypted segments held in host memory, bounded in bytes.

On a host with CUDA the blobs live in page-locked (pinned) host memory, so the driver can DMA them
without a bounce copy: extents of one arena the tier pins once when it is made
(``engine.tiers.pinned_arena``), never a page-locked allocation per blob in the step loop's way.
Elsewhere they are plain ``bytes``. Either way ``get`` hands back a read-only buffer the cipher
decrypts in place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.kv_types import BlockHash, TierName
from engine.tiers.base import BlockLocation, PutResult, SegmentMeta, TenantCap, TenantCapFn
from engine.tiers.indexed import IndexedTierQueries
from engine.tiers.placement import ScoreFn, SegmentIndex, lru_score

if TYPE_CHECKING:
    import numpy as np

    from engine.tiers.pinned_arena import ArenaStats, PinnedArena

# Arena room beyond the tier's capacity, by default: a blob is copied (or sealed) into the arena
# before the put that stores it evicts, extents are aligned, and a dropped segment keeps its extent
# while a restore or a cascade to NVMe still reads it. The tier manager sizes it from its workers.
DEFAULT_ARENA_SLACK = 1 / 16


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; kept for a bare stdlib use
        return False
    return torch.cuda.is_available()


class PinnedBlob:
    """A blob in a host uint8 array (an extent of the tier's page-locked arena on a CUDA host);
    ``view()`` is a zero-copy memoryview of it. ``copy_of`` copies bytes in; ``adopt`` takes an array
    a GPU sealer has just filled by DMA (``engine.tiers.gpu_sealer``), so a spill is written into
    host memory once."""

    __slots__ = ("_a",)

    def __init__(self, array: np.ndarray):
        self._a = array  # [nbytes] uint8

    @classmethod
    def copy_of(cls, blob: bytes | memoryview, alloc: Callable[[int], np.ndarray]) -> PinnedBlob:
        a = alloc(len(blob))
        a[:] = memoryview(blob)
        return cls(a)

    @classmethod
    def adopt(cls, array: np.ndarray) -> PinnedBlob:
        if array.itemsize != 1 or array.ndim != 1:
            raise ValueError("a blob is a 1-D byte array")
        return cls(array)

    def __len__(self) -> int:
        return int(self._a.size)

    def view(self) -> memoryview:
        # .data is memoryview(array): numpy's stubs give ndarray the buffer protocol for Python 3.12+ only
        return self._a.data.toreadonly()


class DramTier(IndexedTierQueries):
    """``Tier`` in host memory. See ``engine.tiers.base.Tier`` for the contract."""

    name = TierName.DRAM

    def __init__(
        self,
        capacity_bytes: int,
        *,
        pin_memory: bool | None = None,
        score: ScoreFn = lru_score,
        tenant_cap: TenantCapFn = lambda ns: TenantCap(),
        floor_fraction: float = 1.0,
        clock: Callable[[], float] = time.time,
        arena_slack_bytes: int | None = None,
    ):
        """``arena_slack_bytes``: page-locked room beyond ``capacity_bytes`` (where the tier pins)
        for blobs in flight: at least the segments being sealed or copied in at once."""
        self.capacity_bytes = capacity_bytes
        self.pin_memory = cuda_available() if pin_memory is None else pin_memory
        self._arena: PinnedArena | None = None
        if self.pin_memory:
            from engine.tiers.pinned_arena import PinnedArena

            slack = int(capacity_bytes * DEFAULT_ARENA_SLACK) if arena_slack_bytes is None else arena_slack_bytes
            self._arena = PinnedArena(capacity_bytes + slack, pin=True)
        self._index = SegmentIndex(capacity_bytes, floor_fraction=floor_fraction, score=score)
        self._blobs: dict[str, bytes | PinnedBlob] = {}
        self._tenant_cap = tenant_cap
        self._clock = clock
        self._lock = threading.Lock()

    def contains(self, namespace: bytes, block_hash: BlockHash) -> BlockLocation | None:
        with self._lock:
            return self._index.lookup(namespace, block_hash, self._clock())

    def get(self, segment_id: str) -> tuple[SegmentMeta, bytes | memoryview] | None:
        with self._lock:
            meta = self._index.segments.get(segment_id)
            if meta is None or meta.expired(self._clock()):
                return None
            meta.hits += 1
            meta.last_access_s = self._clock()
            blob = self._blobs[segment_id]
            return meta, (blob.view() if isinstance(blob, PinnedBlob) else blob)

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array for a blob bound for this tier (a GPU sealer's D2H target):
        page-locked from the arena where the tier pins, plain host memory otherwise."""
        if self._arena is not None:
            return self._arena.allocate(nbytes)
        import numpy as np

        return np.empty(nbytes, dtype=np.uint8)

    def arena_stats(self) -> ArenaStats | None:
        """The page-locked arena's use (None where the tier keeps plain ``bytes``)."""
        return self._arena.stats() if self._arena is not None else None

    def put(self, meta: SegmentMeta, blob: bytes | memoryview | PinnedBlob) -> PutResult:
        """A ``PinnedBlob`` is kept as it is (no copy); other blobs are copied, into pinned memory
        on a CUDA host."""
        if len(blob) != meta.nbytes:
            raise ValueError(f"blob has {len(blob)} bytes, meta says {meta.nbytes}")
        # Copy into pinned memory outside the lock: it is the slow part.
        stored: bytes | PinnedBlob
        if isinstance(blob, PinnedBlob):
            stored = blob
        else:
            stored = PinnedBlob.copy_of(blob, self.host_buffer) if self.pin_memory else bytes(blob)
        with self._lock:
            cap = self._tenant_cap(meta.owner)
            plan = self._index.plan_room(meta.owner, meta.nbytes, cap.bytes, self._clock(),
                                         need_blocks=meta.num_blocks, tenant_cap_blocks=cap.blocks)
            if isinstance(plan, str):
                return PutResult(stored=False, reason=plan)
            evicted = [self._remove_locked(sid) for sid in plan]
            orphans = self._index.add(meta)
            self._blobs[meta.segment_id] = stored
            # Older segments whose every block is now newer here carry nothing findable.
            evicted += [self._remove_locked(sid) for sid in orphans]
            return PutResult(stored=True, evicted=tuple(e for e in evicted if e is not None))

    def evict(self, segment_id: str) -> tuple[SegmentMeta, bytes | memoryview | None] | None:
        with self._lock:
            return self._remove_locked(segment_id)

    def _remove_locked(self, segment_id: str) -> tuple[SegmentMeta, bytes | memoryview | None] | None:
        meta = self._index.remove(segment_id)
        if meta is None:
            return None
        blob = self._blobs.pop(segment_id)
        # a view keeps the pinned buffer alive for the cascade to NVMe; no copy of a segment that is
        # most often simply dropped (every put into a full DRAM tier evicts one)
        return meta, (blob.view() if isinstance(blob, PinnedBlob) else blob)

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()
            assert set(self._blobs) == set(self._index.segments)
