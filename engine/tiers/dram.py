"""The warm tier: encrypted segments held in host memory, bounded in bytes.

On a host with CUDA the blobs live in page-locked (pinned) buffers, so the driver can DMA them
without a bounce copy and the allocator does not pin and unpin per transfer; elsewhere they are
plain ``bytes``. Either way ``get`` hands back a read-only buffer the cipher decrypts in place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine.kv_types import BlockHash, TierName
from engine.tiers.base import BlockLocation, PutResult, SegmentMeta, TenantCap, TenantCapFn
from engine.tiers.indexed import IndexedTierQueries
from engine.tiers.placement import ScoreFn, SegmentIndex, lru_score


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; kept for a bare stdlib use
        return False
    return torch.cuda.is_available()


class _PinnedBlob:
    """A blob copied into page-locked memory; ``view()`` is a zero-copy memoryview of it."""

    __slots__ = ("_t",)

    def __init__(self, blob: bytes):
        import torch

        # t: [len(blob)] uint8, page-locked
        self._t = torch.empty(len(blob), dtype=torch.uint8, pin_memory=True)
        self._t.numpy()[:] = memoryview(blob)

    def view(self) -> memoryview:
        return memoryview(self._t.numpy()).toreadonly()


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
    ):
        self.capacity_bytes = capacity_bytes
        self.pin_memory = cuda_available() if pin_memory is None else pin_memory
        self._index = SegmentIndex(capacity_bytes, floor_fraction=floor_fraction, score=score)
        self._blobs: dict[str, bytes | _PinnedBlob] = {}
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
            return meta, (blob.view() if isinstance(blob, _PinnedBlob) else blob)

    def put(self, meta: SegmentMeta, blob: bytes) -> PutResult:
        if len(blob) != meta.nbytes:
            raise ValueError(f"blob has {len(blob)} bytes, meta says {meta.nbytes}")
        # Copy into pinned memory outside the lock: it is the slow part.
        stored: bytes | _PinnedBlob = _PinnedBlob(blob) if self.pin_memory else bytes(blob)
        with self._lock:
            cap = self._tenant_cap(meta.namespace)
            plan = self._index.plan_room(meta.namespace, meta.nbytes, cap.bytes, self._clock(),
                                         need_blocks=meta.num_blocks, tenant_cap_blocks=cap.blocks)
            if isinstance(plan, str):
                return PutResult(stored=False, reason=plan)
            evicted = [self._remove_locked(sid) for sid in plan]
            orphans = self._index.add(meta)
            self._blobs[meta.segment_id] = stored
            # Older segments whose every block is now newer here carry nothing findable.
            evicted += [self._remove_locked(sid) for sid in orphans]
            return PutResult(stored=True, evicted=tuple(e for e in evicted if e is not None))

    def evict(self, segment_id: str) -> tuple[SegmentMeta, bytes | None] | None:
        with self._lock:
            return self._remove_locked(segment_id)

    def _remove_locked(self, segment_id: str) -> tuple[SegmentMeta, bytes | None] | None:
        meta = self._index.remove(segment_id)
        if meta is None:
            return None
        blob = self._blobs.pop(segment_id)
        return meta, (bytes(blob.view()) if isinstance(blob, _PinnedBlob) else blob)

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()
            assert set(self._blobs) == set(self._index.segments)
