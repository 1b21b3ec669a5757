"""``KVCacheManager``: the one owner of the KV cache (block pool, prefix index, lower tiers).

The scheduler decides *who* runs; this decides whether their blocks exist. It is the only caller
of the block pool, and the only one that talks to the lower tiers (``LowerTier``)::

    scheduler                         KVCacheManager
    ---------                         --------------
    poll_restores(waiting, idle) ──►  finished tier restores -> index their blocks, hold them;
                                      start restores of waiting prefixes found below HBM
    match(req)                   ──►  MatchResult (HBM prefix; .computing: the next block is
                                      being computed by a running request, so waiting beats recompute)
    admit(req, match, n)         ──►  block table (matched + n new)  |  QueueReason
    grow(tenant, n)              ──►  n new blocks                   |  QueueReason
    commit(req id, table, ...)   ──►  index newly full blocks (may swap in a resident duplicate)
    retain(tenant, table, n, spans) ► keep the indexed blocks inside explicit retention spans
                                      (cache_control ttl, prompt_cache_retention) from eviction
    free(req id, table)          ──►  drop the request's references, in-flight marks, restore

Every block the index gains (commit, a finished restore, an import) or loses (eviction) is told
to the ``BlockEventObserver`` if one is given (``engine.kv_events`` publishes it to a fleet's router).

Admission arithmetic (per-tenant HBM quota, free blocks, evictable blocks a hit revives) lives in
``_fits`` only. Quotas are per tenant (``TenantScope.tenant_key``), never per namespace: every
reference is taken for the requesting tenant, and a tenant is charged once for each distinct block
its requests (and restores held for them) reference, shared or not (``engine.block_pool``). A prefix in flight: ``admit`` marks the prompt blocks a request will compute
(``_computing``); ``commit`` and ``free`` unmark them. A later request of the same namespace whose
next block is marked waits (``QueueReason.PREFIX_COMPUTING``) and hits the blocks once committed,
instead of computing the same prefix a second time.

Torch-free (import-linter contract ``engine-core-torch-free``); single-threaded (the step loop).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from engine.block_pool import BlockPool, IntegrityError
from engine.config import EvictionPolicyName
from engine.kv_types import (
    EMPTY_MATCH,
    BlockEventObserver,
    BlockHash,
    CacheObserver,
    CachePhase,
    CacheRequest,
    EvictedBlock,
    LowerTier,
    MatchResult,
    QueueReason,
    TierName,
)
from engine.prefix_index import max_cacheable_blocks
from engine.protocol import Retention, TenantScope

_UNOBSERVED = nullcontext()
# Longest a step with nothing else to run waits for a restore (instead of spinning empty steps,
# which would also compete with the decrypting worker for the GIL).
IDLE_RESTORE_WAIT_S = 0.05


@dataclass
class _Restore:
    holder: bytes  # the requesting tenant's key: the references below are held for it
    hbm_ids: list[int]  # the request's HBM prefix, held so that allocating cannot evict it
    new_ids: list[int]  # fresh blocks the restored KV goes into
    hashes: tuple[BlockHash, ...]  # what goes into new_ids, in chain order


class KVCacheManager:
    """Args:
    num_blocks, block_size: the KV cache's geometry.
    eviction_policy: "cost" or "lru" (``engine.eviction``).
    enable_caching: False = nothing is indexed or matched (every prompt is computed).
    lower: the tiers below HBM (None = evicted KV is dropped).
    observer: times the phases of cache work (None = untimed).
    events: told of every block the HBM index gains or loses (None = nobody; ``engine.kv_events``).
    clock: the monotonic clock retention deadlines are kept in (tests pass a fake one).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        eviction_policy: EvictionPolicyName = "cost",
        enable_caching: bool = True,
        lower: LowerTier | None = None,
        observer: CacheObserver | None = None,
        events: BlockEventObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lower = lower if enable_caching else None
        self._observer = observer
        self._events = events if enable_caching else None
        self._clock = clock
        watching = self._lower is not None or self._events is not None
        self._pool = BlockPool(num_blocks, block_size, eviction_policy, enable_caching,
                               on_evict=self._evicted if watching else None, observer=observer,
                               clock=clock)
        self.block_size = block_size
        self.enable_caching = enable_caching
        # (tenant key, namespace) -> its scope: whose evicted blocks are spilled, under which cipher and caps
        self._tenants: dict[tuple[bytes, bytes], TenantScope] = {}
        self._computing: Counter[BlockHash] = Counter()  # prompt blocks running requests will compute
        self._computing_of: dict[str, list[BlockHash]] = {}  # request id -> its marks not committed yet
        self._restoring: dict[str, _Restore] = {}
        # request id -> (tenant key, restored prefix held for it until admission)
        self._holding: dict[str, tuple[bytes, list[int]]] = {}
        self._looked_up: set[tuple[str, int]] = set()  # (request id, preemptions) already looked up below
        self.restored_blocks = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_used(self) -> int:
        return self._pool.num_used

    @property
    def num_evictable(self) -> int:
        return self._pool.num_evictable

    @property
    def num_evictions(self) -> int:
        return self._pool.num_evictions

    @property
    def num_indexed(self) -> int:
        return len(self._pool.index)

    def used_by(self, tenant_key: bytes) -> int:
        """HBM blocks the tenant ``tenant_key`` holds (what its ``kv_block_quota`` counts): each
        distinct block its requests reference, in whichever of its namespaces, shared or not."""
        return self._pool.used_by(tenant_key)

    def indexed_by(self, namespace: bytes) -> int:
        return self._pool.indexed_by(namespace)

    def retained_by(self, tenant_key: bytes) -> int:
        """HBM blocks the tenant ``tenant_key`` retains whose explicit retention has not ended."""
        return self._pool.retained_by(tenant_key)

    def cached_blocks(self, namespace: bytes) -> dict[str, int]:
        """Blocks cached for ``namespace`` per tier (``hbm`` plus any lower tier) and ``retained``.

        Reads counters only; safe from another thread (a count may be one step old)."""
        lower = self._lower.blocks_of(namespace) if self._lower is not None else {}
        return {"hbm": self._pool.indexed_by(namespace), **lower, "retained": self._pool.retained_in(namespace)}

    def blocks_held(self, tenant_key: bytes) -> dict[str, int]:
        """Blocks the tenant ``tenant_key`` holds per tier (``hbm``: what its ``kv_block_quota``
        counts, plus any lower tier): its own, never another's sharing its metrics label.

        Reads counters only; safe from another thread (a count may be one step old)."""
        lower = self._lower.blocks_held(tenant_key) if self._lower is not None else {}
        return {"hbm": self._pool.used_by(tenant_key), **lower}

    def blocks_by_tenant(self) -> dict[TierName, dict[str, int]]:
        """Blocks each tenant (``metrics_label``; tenants sharing a label are summed) holds per
        tier: HBM blocks in use (what ``kv_block_quota`` counts), and the lower tiers' blocks."""
        labels = {key: tenant.metrics_label for (key, _ns), tenant in self._tenants.items()}
        hbm: dict[str, int] = {}
        for key, label in labels.items():
            n = self._pool.used_by(key)
            if n:
                hbm[label] = hbm.get(label, 0) + n
        out = {TierName.HBM: hbm}
        if self._lower is not None:
            out.update(self._lower.blocks_by_tenant())
        return out

    def is_restoring(self, request_id: str) -> bool:
        return request_id in self._restoring

    # ------------------------------------------------------------------ the scheduler's calls

    def match(self, req: CacheRequest) -> MatchResult:
        """The request's cached prefix in HBM (empty with caching off, or for a request that does
        not read the cache: ``CacheRequest.reads_prefix_cache``)."""
        if not self.enable_caching or not req.reads_prefix_cache:
            return EMPTY_MATCH
        with self._phase(CachePhase.MATCH):
            m = self._pool.index.match_hashes(req.block_hashes, req.num_tokens)
            limit = max_cacheable_blocks(req.num_tokens, self.block_size)
            if m.num_blocks < min(limit, len(req.block_hashes)) and self._computing[req.block_hashes[m.num_blocks]]:
                return MatchResult(m.block_ids, m.block_hashes, m.cached_tokens, computing=True)
            return m

    def admit(self, req: CacheRequest, match: MatchResult, num_new_blocks: int) -> list[int] | QueueReason:
        """Take references on ``match``'s blocks and allocate ``num_new_blocks`` after them.

        Returns the request's block table, or why it must wait (no change then):
        ``PREFIX_COMPUTING`` (``match.computing``), ``RESTORING``, ``TENANT_OVER_QUOTA``, ``NO_KV_BLOCKS``.
        The prompt blocks it will compute are marked in flight until ``commit`` or ``free``.
        """
        rid, tenant = req.request_id, req.tenant
        if rid in self._restoring:
            return QueueReason.RESTORING
        if match.computing:
            return QueueReason.PREFIX_COMPUTING
        reason = self._fits(tenant, num_new_blocks, match.block_ids)
        if reason is not None:
            return reason
        self._remember(tenant)
        self._pool.touch(match.block_ids, tenant.namespace, tenant.tenant_key)
        new = self._pool.allocate(num_new_blocks, tenant.namespace, tenant.tenant_key)
        assert new is not None  # _fits counted free blocks
        self._release_held(rid)  # the request now holds its restored prefix itself
        if self.enable_caching:
            marks = list(req.block_hashes[match.num_blocks:])
            self._computing.update(marks)
            self._computing_of[rid] = marks
        return list(match.block_ids) + new

    def grow(self, tenant: TenantScope, num_blocks: int) -> list[int] | QueueReason:
        """``num_blocks`` more blocks for a running request, or ``TENANT_OVER_QUOTA`` /
        ``NO_KV_BLOCKS`` (then the scheduler preempts someone and asks again)."""
        reason = self._fits(tenant, num_blocks, ())
        if reason is not None:
            return reason
        new = self._pool.allocate(num_blocks, tenant.namespace, tenant.tenant_key)
        assert new is not None
        return new

    def commit(self, request_id: str, tenant: TenantScope, block_table: Sequence[int],
               hashes: Sequence[BlockHash], start: int) -> list[int]:
        """Index blocks ``start .. start+len(hashes)-1`` of ``block_table`` (a request of ``tenant``),
        which just became full (``hashes`` are theirs). Returns their ids: one differs where another
        request committed the same hash first (the reference moved to that block); write them back
        into the table."""
        out: list[int] = []
        with self._phase(CachePhase.REGISTER):
            parent = block_table[start - 1] if start > 0 else None
            for i, h in enumerate(hashes):
                parent = self._pool.register(block_table[start + i], h, start + i, parent, tenant.tenant_key)
                out.append(parent)
        self._unmark(request_id, len(hashes))
        # a returned id that differs from the table's names a block another request stored first
        self._stored([h for i, h in enumerate(hashes) if out[i] == block_table[start + i]])
        return out

    def retain(self, tenant: TenantScope, block_table: Sequence[int], num_indexed: int,
               spans: Sequence[Retention]) -> int:
        """Keep the indexed blocks inside each span (its first ``tokens // block_size`` blocks, at
        most ``num_indexed``) from eviction for ``span.seconds`` while other victims exist. Call
        before ``free``, while the request still holds ``block_table``. Returns the most blocks
        one span retained.

        A tenant retains at most its HBM block quota, or a quarter of the pool without one, so one
        tenant's retention cannot push every other tenant's cache out of HBM."""
        if not spans or not block_table:
            return 0
        now = self._clock()
        limit = tenant.kv_block_quota or max(1, self._pool.num_blocks // 4)
        kept = 0
        for span in spans:
            n = min(span.tokens // self.block_size, num_indexed, len(block_table))
            kept = max(kept, self._pool.retain(block_table[:n], now + span.seconds, limit, tenant.tenant_key))
        return kept

    def free(self, request_id: str, tenant: TenantScope, block_table: Sequence[int]) -> None:
        """The request (of ``tenant``) finished, was aborted or preempted: drop its references, its
        in-flight marks, and any restore or restored prefix the manager holds for it."""
        if block_table:
            self._pool.free(block_table, tenant.tenant_key)
        self._unmark(request_id, None)
        self._release_held(request_id)
        restore = self._restoring.pop(request_id, None)
        if restore is not None:
            assert self._lower is not None
            self._lower.cancel_restore(request_id)
            self._pool.free(restore.hbm_ids + restore.new_ids, restore.holder)

    def _release_held(self, request_id: str) -> None:
        """Drop the references on a restored prefix the manager held for ``request_id``."""
        held = self._holding.pop(request_id, None)
        if held is not None and held[1]:
            self._pool.free(held[1], held[0])

    def _remember(self, tenant: TenantScope) -> None:
        """Keep ``tenant``'s scope for its blocks' spills (its cipher, its tier caps)."""
        self._tenants[(tenant.tenant_key, tenant.namespace)] = tenant

    # ------------------------------------------------------------------ KV from another engine

    def import_chain(
        self, tenant: TenantScope, chain: Sequence[BlockHash], start: int, write: Callable[[list[int], int], None]
    ) -> int | QueueReason:
        """Index blocks ``start ..`` of ``chain`` (hashes from depth 0) whose KV another engine
        computed (prefill/decode split, ``engine.disagg``); they end free and indexed, a hit for
        the tenant's next request like any committed block.

        ``chain[:start]`` must be resident (else nothing happens: 0, a miss). Blocks already
        indexed are kept; for the rest fresh blocks are allocated and ``write(block_ids, first)``
        must fill them with the KV of chain blocks ``first, first+1, ..``. Returns how many
        blocks were imported, or ``NO_KV_BLOCKS`` / ``TENANT_OVER_QUOTA`` (nothing changed).
        """
        if not self.enable_caching or start >= len(chain):
            return 0
        index = self._pool.index
        held = [index.get(h) for h in chain[:start]]
        if any(b is None for b in held):
            return 0  # the chain broke (an earlier chunk was refused, or evicted meanwhile)
        have = start
        while have < len(chain) and chain[have] in index:
            held.append(index.get(chain[have]))
            have += 1
        todo = list(chain[have:])
        if not todo:
            return 0
        ids = [b for b in held if b is not None]
        reason = self._fits(tenant, len(todo), ids[-1:])
        if reason is not None:
            return reason
        self._remember(tenant)
        key = tenant.tenant_key
        parent = ids[-1] if ids else None
        if parent is not None:
            self._pool.touch([parent], tenant.namespace, key)  # register needs an in-use parent
        new = self._pool.allocate(len(todo), tenant.namespace, key)
        assert new is not None  # _fits counted free blocks
        kept: list[int] = []
        try:
            write(new, have)
            with self._phase(CachePhase.REGISTER):
                for i, h in enumerate(todo):
                    parent = self._pool.register(new[i], h, have + i, parent, key)
                    kept.append(parent)
            self._stored([h for i, h in enumerate(todo) if kept[i] == new[i]])
        finally:
            # drop the references taken here: the blocks stay indexed (evictable) or, where
            # write failed before registering, go back to the free queue unindexed
            self._pool.free(ids[-1:] + kept + new[len(kept):], key)
        return len(todo)

    def resident_prefix(self, chain: Sequence[BlockHash]) -> int:
        """How many leading hashes of ``chain`` are indexed in HBM now."""
        n = 0
        while n < len(chain) and chain[n] in self._pool.index:
            n += 1
        return n

    def evict_all_cached(self) -> int:
        """Evict every evictable block (``reset_prefix_cache``; spilled if there is a lower tier)."""
        n = self._pool.evict_all_cached()
        if self._lower is not None:
            self._lower.flush_spills()
        return n

    # ------------------------------------------------------------------ lower tiers

    def flush_spills(self) -> None:
        """Hand every pending spill to the lower tier now (the engine has gone idle: a run kept
        for more of its chain would otherwise wait for the next step, which may be far off)."""
        if self._lower is not None:
            with self._phase(CachePhase.TIER):
                self._lower.flush_spills()

    def poll_restores(self, waiting: Iterable[CacheRequest], idle: bool) -> None:
        """Call once per step before admitting: hand spills down, index finished restores, and
        start restores for waiting requests whose prefix continues below HBM.

        ``idle``: nothing is running, so if every waiting request is restoring, wait a little for
        one to finish rather than return an empty step."""
        if self._lower is None:
            return
        waiting = list(waiting)
        # with no request waiting, no lookup needs this step's spills: a run may keep growing
        due_only = not waiting
        with self._phase(CachePhase.TIER):
            self._lower.flush_spills(due_only=due_only)
            for req in waiting:
                self._remember(req.tenant)
            ids = {r.request_id for r in waiting}
            self._looked_up = {k for k in self._looked_up if k[0] in ids}
            self._finish_restores(0.0)
            for req in waiting:
                self._maybe_start_restore(req)
            self._lower.flush_spills(due_only=due_only)  # allocations for restores may have evicted blocks
            if self._restoring and idle and all(r.request_id in self._restoring for r in waiting):
                self._finish_restores(IDLE_RESTORE_WAIT_S)

    def _maybe_start_restore(self, req: CacheRequest) -> None:
        assert self._lower is not None
        rid, tenant = req.request_id, req.tenant
        key = (rid, req.num_preemptions)
        if rid in self._restoring or rid in self._holding or key in self._looked_up or not req.reads_prefix_cache:
            return
        self._looked_up.add(key)
        hbm = self.match(req)
        limit = max_cacheable_blocks(req.num_tokens, self.block_size)
        below = tuple(req.block_hashes[hbm.num_blocks:limit])
        n = self._lower.lookup(tenant.namespace, below) if below else 0
        if n == 0:
            return
        reason = self._fits(tenant, n, hbm.block_ids)
        if reason is QueueReason.NO_KV_BLOCKS:
            self._looked_up.discard(key)  # no room now; try again next step
        if reason is not None:
            return
        hbm_ids = list(hbm.block_ids)
        holder = tenant.tenant_key
        self._pool.touch(hbm_ids, tenant.namespace, holder)
        new_ids = self._pool.allocate(n, tenant.namespace, holder)
        assert new_ids is not None
        self._restoring[rid] = _Restore(holder, hbm_ids, new_ids, below[:n])
        self._lower.start_restore(rid, tenant, below[:n], new_ids)

    def _finish_restores(self, timeout_s: float) -> None:
        assert self._lower is not None
        for done in self._lower.finished_restores(timeout_s):
            r = self._restoring.pop(done.request_id, None)
            if r is None:
                continue  # cancelled meanwhile
            n = done.num_blocks
            kept = list(r.hbm_ids)
            with self._phase(CachePhase.REGISTER):
                parent = r.hbm_ids[-1] if r.hbm_ids else None
                for i in range(n):
                    parent = self._pool.register(r.new_ids[i], r.hashes[i], len(r.hbm_ids) + i, parent, r.holder)
                    kept.append(parent)  # differs from new_ids[i] if the hash reappeared meanwhile
            self._stored([r.hashes[i] for i in range(n) if kept[len(r.hbm_ids) + i] == r.new_ids[i]])
            self.restored_blocks += n
            if r.new_ids[n:]:
                self._pool.free(r.new_ids[n:], r.holder)  # blocks whose restore failed: recomputed instead
            if kept:
                self._holding[done.request_id] = (r.holder, kept)

    def _evicted(self, block: EvictedBlock) -> None:
        """The pool is about to reuse an indexed block: spill its bytes, then say it is gone."""
        if self._lower is not None:
            # spilled as the tenant that last held it: its cipher, charged to its tier caps
            tenant = self._tenants.get((block.holder, block.namespace))
            if tenant is not None:
                self._lower.spill(tenant, block)
        if self._events is not None:
            self._events.blocks_removed((block.block_hash,))

    def _stored(self, hashes: Sequence[BlockHash]) -> None:
        if self._events is not None and hashes:
            self._events.blocks_stored(hashes, None)

    def tier_stats(self) -> dict[str, Any] | None:
        if self._lower is None:
            return None
        out = self._lower.stats()
        out["restoring"] = len(self._restoring)
        out["restored_blocks"] = self.restored_blocks
        return out

    def close(self) -> None:
        if self._lower is not None:
            self._lower.close()
        if self._events is not None:
            self._events.close()

    # ------------------------------------------------------------------ internals

    def _fits(self, tenant: TenantScope, num_new: int, hit_ids: Sequence[int]) -> QueueReason | None:
        """The admission arithmetic: None if ``num_new`` fresh blocks plus the hit blocks
        ``hit_ids`` fit the tenant's quota (charged: the hit blocks it does not hold yet, including
        blocks another tenant's request holds) and the pool (taken from the free count: the
        evictable hit blocks, which the hit revives)."""
        quota = tenant.kv_block_quota
        used = self._pool.used_by(tenant.tenant_key) if quota is not None else 0
        if self._fit_bounded(quota, used, num_new + len(hit_ids)):
            # even were every hit block evictable and new to the tenant it would fit: no need to
            # count them (a 7,680-token hit is 480 refcount reads on the time to first token)
            return None
        if quota is not None and used + num_new + self._pool.count_not_held(hit_ids, tenant.tenant_key) > quota:
            return QueueReason.TENANT_OVER_QUOTA
        if num_new + self._count_evictable(hit_ids) > self._pool.num_free:
            return QueueReason.NO_KV_BLOCKS
        return None

    def _fit_bounded(self, quota: int | None, used: int, most_taken: int) -> bool:
        """True if taking ``most_taken`` blocks out of the free count (``used`` by the tenant now)
        fits both the tenant's quota and the pool: an upper bound of what an admission takes."""
        return (quota is None or used + most_taken <= quota) and most_taken <= self._pool.num_free

    def _count_evictable(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are evictable (refcount 0): a hit revives those."""
        return sum(1 for b in block_ids if self._pool.ref_count(b) == 0)

    def _unmark(self, request_id: str, count: int | None) -> None:
        """Drop the first ``count`` (None: all) in-flight marks of ``request_id``."""
        marks = self._computing_of.get(request_id)
        if not marks:
            return
        k = len(marks) if count is None else min(count, len(marks))
        self._computing.subtract(marks[:k])
        for h in marks[:k]:
            if self._computing[h] <= 0:
                del self._computing[h]
        del marks[:k]
        if not marks:
            del self._computing_of[request_id]

    def _phase(self, phase: CachePhase) -> AbstractContextManager[None]:
        return self._observer.phase(phase) if self._observer is not None else _UNOBSERVED

    def check_integrity(self, block_tables: Iterable[Sequence[int]]) -> None:
        """``BlockPool.check_integrity`` over the requests' tables plus what the manager holds
        (restores under way, restored prefixes not yet admitted); and the in-flight marks."""
        tables = list(block_tables)
        tables += [r.hbm_ids + r.new_ids for r in self._restoring.values()]
        tables += [ids for _holder, ids in self._holding.values()]
        self._pool.check_integrity(tables)
        expected: Counter[BlockHash] = Counter()
        for marks in self._computing_of.values():
            expected.update(marks)
        if +expected != +self._computing:
            raise IntegrityError("in-flight prefix marks disagree with the requests that hold them")
