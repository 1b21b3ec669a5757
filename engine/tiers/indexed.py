"""The read-side queries every tier answers from its in-memory ``SegmentIndex``.

DRAM and NVMe differ in where segment bytes live, not in how segments are found, aged or counted;
both tiers inherit these so the answers cannot drift apart.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from engine.kv_types import BlockHash
from engine.tiers.base import TierStats
from engine.tiers.placement import SegmentIndex


class IndexedTierQueries:
    """Mixin. The tier sets ``name``, ``capacity_bytes``, ``_index`` and ``_lock``."""

    name: str
    capacity_bytes: int
    _index: SegmentIndex
    _lock: threading.Lock

    def expired_segments(self, now_s: float) -> list[str]:
        with self._lock:
            return self._index.expired(now_s)

    def segments_of(self, namespace: bytes) -> list[str]:
        with self._lock:
            return self._index.of_namespace(namespace)

    def retain(self, namespace: bytes, hashes: Sequence[BlockHash], until_s: float) -> int:
        """Extend the retention of the segments holding ``hashes``; returns the blocks found."""
        with self._lock:
            found, moved = self._index.retain(namespace, hashes, until_s)
            self._retention_moved(moved)
            return found

    def _retention_moved(self, segment_ids: list[str]) -> None:
        """Hook for a tier that persists its index (NVMe); called under the lock."""

    def blocks_of(self, namespace: bytes) -> int:
        """KV blocks this tier holds for ``namespace`` (a tenant's "what do I have cached")."""
        with self._lock:
            return sum(len(self._index.segments[sid].hashes) for sid in self._index.of_namespace(namespace))

    def blocks_owned(self, owner: bytes) -> int:
        """KV blocks this tier charges to ``owner`` (a tenant key): what its block quota here counts."""
        with self._lock:
            return self._index.block_usage.get(owner, 0)

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.capacity_bytes, self._index.used_bytes,
                             len(self._index.segments), self._index.num_blocks(),
                             self._index.bytes_by_label(), self._index.blocks_by_label())
