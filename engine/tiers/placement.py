"""In-memory bookkeeping of one tier and the rule that picks what to evict to make room.

Both tiers keep their index here (the NVMe tier rebuilds it from SQLite at start-up). Not
thread-safe: the owning tier holds its lock around every call.

Eviction rule for ``plan_room(tenant, need)``, in order:

Tenants are segment owners (``SegmentMeta.owner``, the tenant key), not namespaces: one tenant's
namespaces share its caps and floor, and tenants sharing a namespace keep their own.

1. The segment must fit the tier and the tenant's own caps (``tenant_cap_bytes``, and
   ``tenant_cap_blocks``: its ``kv_block_quota_dram`` / ``_nvme``); if the tenant would exceed a
   cap, only its own segments are candidates (lowest score, i.e. oldest, first) until it fits.
2. Fair-share floor: with ``n`` tenants holding data in the tier (the newcomer included), each is
   guaranteed ``floor = capacity * floor_fraction / n``. Another tenant's segment is a candidate
   only while that tenant holds more than its floor, so a tenant whose working set fits its
   share is never pushed out by someone else's flood. The putting tenant may always evict its own.
3. Among candidates, unretained segments go before retained ones (``SegmentMeta.retained``: an
   explicit retention the blocks carried out of HBM, still live), and within each group the lowest
   ``score`` goes first (the manager's score weighs recompute cost against restore cost, reuse and
   idleness; see ``engine.tiers.cost``). Retention changes the order only: a retained segment still
   counts against its tenant's caps and floor, so a tenant over its own cap gives up its retained
   segments too (after its unretained ones), and a tenant cannot keep more than its quota by
   marking everything retained. Once the retention ends the segment is ranked by score alone.

If no set of candidates frees enough bytes, the put is refused ("quota") and nothing is evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.kv_types import BlockHash
from engine.tiers.base import BlockLocation, SegmentMeta

ScoreFn = Callable[[SegmentMeta, float], float]


def lru_score(meta: SegmentMeta, now_s: float) -> float:
    """Plain least-recently-used: the oldest access is evicted first."""
    return meta.last_access_s


class SegmentIndex:
    """Segments, the per-block map into them, and per-tenant byte usage of one tier."""

    def __init__(self, capacity_bytes: int, *, floor_fraction: float = 1.0, score: ScoreFn = lru_score):
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        if not 0.0 <= floor_fraction <= 1.0:
            raise ValueError("floor_fraction must be in [0, 1]")
        self.capacity_bytes = capacity_bytes
        self.floor_fraction = floor_fraction
        self.score = score
        self.segments: dict[str, SegmentMeta] = {}
        self._blocks: dict[tuple[bytes, BlockHash], BlockLocation] = {}
        self._live: dict[str, int] = {}  # segment id -> blocks of the map still pointing at it
        self.usage: dict[bytes, int] = {}  # owner (tenant key) -> bytes held
        self.block_usage: dict[bytes, int] = {}  # owner (tenant key) -> blocks held (segment sizes)
        self._by_label: dict[str, int] = {}  # metrics label -> bytes held (kept for cheap stats)
        self._blocks_by_label: dict[str, int] = {}  # metrics label -> blocks held (the panel's use per tier)
        self.used_bytes = 0

    # ---- queries -------------------------------------------------------------------------------
    def lookup(self, namespace: bytes, block_hash: BlockHash, now_s: float) -> BlockLocation | None:
        loc = self._blocks.get((namespace, block_hash))
        if loc is None or self.segments[loc.segment_id].expired(now_s):
            return None
        return loc

    def num_blocks(self) -> int:
        return len(self._blocks)

    def expired(self, now_s: float) -> list[str]:
        return [sid for sid, m in self.segments.items() if m.expired(now_s)]

    def of_namespace(self, namespace: bytes) -> list[str]:
        return [sid for sid, m in self.segments.items() if m.namespace == namespace]

    def bytes_by_label(self) -> dict[str, int]:
        return {label: n for label, n in self._by_label.items() if n}

    def blocks_by_label(self) -> dict[str, int]:
        return {label: n for label, n in self._blocks_by_label.items() if n}

    def eviction_order(self, now_s: float) -> list[SegmentMeta]:
        """Every segment, first to evict first: unretained before retained, then by ``score``."""
        return sorted(self.segments.values(), key=lambda m: (m.retained(now_s), self.score(m, now_s)))

    # ---- mutation ------------------------------------------------------------------------------
    def add(self, meta: SegmentMeta) -> list[str]:
        """Insert ``meta``; its blocks now point at it (newest wins). Returns the ids of older
        segments left with no block pointing at them: the caller must remove them."""
        if meta.segment_id in self.segments:
            raise ValueError(f"segment {meta.segment_id} already stored")
        self.segments[meta.segment_id] = meta
        self._live[meta.segment_id] = 0
        self._charge(meta.owner, meta.nbytes, meta.num_blocks)
        self._by_label[meta.tenant_label] = self._by_label.get(meta.tenant_label, 0) + meta.nbytes
        self._blocks_by_label[meta.tenant_label] = self._blocks_by_label.get(meta.tenant_label, 0) + meta.num_blocks
        self.used_bytes += meta.nbytes
        orphans = []
        for pos, h in enumerate(meta.hashes):
            key = (meta.namespace, h)
            old = self._blocks.get(key)
            if old is not None and old.segment_id != meta.segment_id:
                self._live[old.segment_id] -= 1
                if self._live[old.segment_id] == 0:
                    orphans.append(old.segment_id)
            if old is None or old.segment_id != meta.segment_id:
                self._live[meta.segment_id] += 1
            self._blocks[key] = BlockLocation(meta.segment_id, pos)
        return orphans

    def retain(self, namespace: bytes, hashes: Sequence[BlockHash], until_s: float) -> tuple[int, list[str]]:
        """Extend the retention of the segments holding ``hashes`` of ``namespace`` to ``until_s``
        (never shortened). Returns (blocks found, ids of the segments whose deadline moved)."""
        found, moved = 0, []
        for h in hashes:
            loc = self._blocks.get((namespace, h))
            if loc is None:
                continue
            found += 1
            meta = self.segments[loc.segment_id]
            if meta.retain_until_s is None or meta.retain_until_s < until_s:
                meta.retain_until_s = until_s
                moved.append(meta.segment_id)
        return found, moved

    def remove(self, segment_id: str) -> SegmentMeta | None:
        meta = self.segments.pop(segment_id, None)
        if meta is None:
            return None
        del self._live[segment_id]
        for h in meta.hashes:
            key = (meta.namespace, h)
            loc = self._blocks.get(key)
            if loc is not None and loc.segment_id == segment_id:
                del self._blocks[key]
        self._charge(meta.owner, -meta.nbytes, -meta.num_blocks)
        self._by_label[meta.tenant_label] -= meta.nbytes
        self._blocks_by_label[meta.tenant_label] -= meta.num_blocks
        self.used_bytes -= meta.nbytes
        return meta

    def rekey_owner(self, segment_id: str, owner: bytes) -> None:
        """Charge a stored segment to ``owner`` from now on (a recovered segment's owner found)."""
        meta = self.segments[segment_id]
        if meta.owner == owner:
            return
        self._charge(meta.owner, -meta.nbytes, -meta.num_blocks)
        meta.owner = owner
        self._charge(owner, meta.nbytes, meta.num_blocks)

    def _charge(self, owner: bytes, nbytes: int, blocks: int) -> None:
        """Add (or, negative, take back) bytes and blocks to ``owner``'s use; zero entries go."""
        for usage, n in ((self.usage, nbytes), (self.block_usage, blocks)):
            left = usage.get(owner, 0) + n
            if left:
                usage[owner] = left
            else:
                usage.pop(owner, None)

    # ---- the eviction rule ---------------------------------------------------------------------
    def plan_room(
        self, owner: bytes, need: int, tenant_cap_bytes: int | None, now_s: float,
        *, need_blocks: int = 0, tenant_cap_blocks: int | None = None,
    ) -> list[str] | str:
        """Victims (segment ids, in eviction order) that make room for ``need`` more bytes
        (``need_blocks`` blocks) owned by ``owner`` (a tenant key), or the reason it cannot be
        placed: "too_large" or "quota".

        Pure: evicts nothing itself.
        """
        cap = self.capacity_bytes if tenant_cap_bytes is None else min(tenant_cap_bytes, self.capacity_bytes)
        if need > cap or (tenant_cap_blocks is not None and need_blocks > tenant_cap_blocks):
            return "too_large"
        usage = dict(self.usage)
        tenants = set(usage) | {owner}
        floor = self.capacity_bytes * self.floor_fraction / len(tenants)
        free = self.capacity_bytes - self.used_bytes
        own_over = usage.get(owner, 0) + need - cap  # bytes of its own it must give up
        own_over_blocks = (0 if tenant_cap_blocks is None
                           else self.block_usage.get(owner, 0) + need_blocks - tenant_cap_blocks)
        if free >= need and own_over <= 0 and own_over_blocks <= 0:
            return []
        ranked = self.eviction_order(now_s)
        victims: list[str] = []
        # Pass 1: a tenant over its own cap makes room from its own segments only.
        if own_over > 0 or own_over_blocks > 0:
            for m in ranked:
                if own_over <= 0 and own_over_blocks <= 0:
                    break
                if m.owner == owner:
                    victims.append(m.segment_id)
                    own_over -= m.nbytes
                    own_over_blocks -= m.num_blocks
                    free += m.nbytes
                    usage[owner] -= m.nbytes
            if own_over > 0 or own_over_blocks > 0:
                return "quota"
        # Pass 2: free bytes. One pass in score order is exact: eligibility only shrinks as
        # usages drop, so a segment skipped once stays ineligible.
        chosen = set(victims)
        for m in ranked:
            if free >= need:
                break
            if m.segment_id in chosen:
                continue
            if m.owner == owner or usage[m.owner] > floor:
                victims.append(m.segment_id)
                free += m.nbytes
                usage[m.owner] -= m.nbytes
        if free < need:
            return "quota"
        return victims

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with itself (tests call it)."""
        assert self.used_bytes == sum(m.nbytes for m in self.segments.values())
        assert self.used_bytes <= self.capacity_bytes, (self.used_bytes, self.capacity_bytes)
        assert sum(self._blocks_by_label.values()) == sum(m.num_blocks for m in self.segments.values())
        by_owner: dict[bytes, int] = {}
        for m in self.segments.values():
            by_owner[m.owner] = by_owner.get(m.owner, 0) + m.nbytes
        assert by_owner == self.usage, (by_owner, self.usage)
        blocks_owner: dict[bytes, int] = {}
        for m in self.segments.values():
            blocks_owner[m.owner] = blocks_owner.get(m.owner, 0) + m.num_blocks
        assert blocks_owner == self.block_usage, (blocks_owner, self.block_usage)
        by_label: dict[str, int] = {}
        for m in self.segments.values():
            by_label[m.tenant_label] = by_label.get(m.tenant_label, 0) + m.nbytes
        assert by_label == self.bytes_by_label(), (by_label, self._by_label)
        live: dict[str, int] = dict.fromkeys(self.segments, 0)
        for (ns, h), loc in self._blocks.items():
            meta = self.segments[loc.segment_id]
            assert meta.namespace == ns and meta.hashes[loc.position] == h
            live[loc.segment_id] += 1
        assert live == self._live, (live, self._live)
        assert all(n > 0 for n in live.values()), "a segment with no live block was kept"
