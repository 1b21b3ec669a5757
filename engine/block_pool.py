"""The KV block pool: preallocated blocks, refcounts, free queues, prefix index, eviction.

Block life cycle::

      allocate()                      free() -> ref 0, never indexed
    +-----------> [in use, ref>=1] ------------------------------------> [free, uncached]
    |               |      ^  touch() (prefix hit)                            |
    |   register()  |      |                                                  |
    |   (block full)v      |                                                  |
    |           [in use, indexed] --free() -> ref 0--> [evictable, indexed]   |
    |                                                      | evict (policy)   |
    +------------------------------------------------------+------------------+

- ``allocate`` takes never-indexed free blocks first (nothing is lost), then asks the eviction
  policy for a victim: a free, indexed *leaf* (tails go before their parents, so the index stays
  prefix-closed). Before a victim is reused ``on_evict`` sees it, so a lower tier can keep a copy.
- Blocks are shared only through the index, so a shared block is always indexed, and every block
  belongs to one namespace (the hash chain it is part of).
- Quota charging (``used_by``): every reference is taken for a *holder*, the tenant key of the
  request it is taken for (``TenantScope.tenant_key``; the block's namespace when the caller names
  none, i.e. one tenant per namespace). A block in use counts once against each tenant holding a
  reference to it, however many of that tenant's requests share it, and against no one once free
  (evictable). So tenants sharing a namespace (share scope ``group:NAME``) each pay for the blocks
  their own requests hold, shared ones included: one member can neither push another over its
  quota nor run on another's blocks for free; and one tenant's namespaces (share scope ``user``)
  all count against the same quota. ``Block.holder`` remembers the tenant that last took a
  reference: an evicted block's spill is charged to it in the lower tiers.
- ``register`` indexes a block that just filled. If its hash is already resident in another block
  (two requests computed the same prefix concurrently), the caller's reference moves to the
  resident block and the duplicate is freed, so the pool never holds one prefix twice.

No torch here (import-linter contract ``engine-core-torch-free``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext

from engine.config import EvictionPolicyName
from engine.eviction import Block, EvictionPolicy, FreeBlockQueue, make_policy
from engine.kv_types import BlockHash, CacheObserver, CachePhase, EvictedBlock
from engine.prefix_index import PrefixIndex


class IntegrityError(AssertionError):
    """``BlockPool.check_integrity`` found the pool's bookkeeping inconsistent."""


_UNOBSERVED = nullcontext()


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks with refcounts and a prefix index.

    Args:
        num_blocks: blocks in the runner's KV cache.
        block_size: tokens per block.
        eviction_policy: "cost" (default) or "lru", or an ``EvictionPolicy`` object.
        enable_caching: False = ``register`` indexes nothing, so nothing is ever hit.
        on_evict: told of every eviction before the block is reused (its bytes are still there).
        observer: times each eviction (``CachePhase.EVICT``).

    The pool is private to ``engine.kv_cache_manager.KVCacheManager``; only it and the pool's own
    tests call it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction_policy: EvictionPolicyName | EvictionPolicy = "cost",
        enable_caching: bool = True,
        on_evict: Callable[[EvictedBlock], None] | None = None,
        observer: CacheObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._on_evict = on_evict
        self._observer = observer
        self.clock = clock
        self.policy: EvictionPolicy = (
            make_policy(eviction_policy, block_size, clock) if isinstance(eviction_policy, str) else eviction_policy
        )
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.index = PrefixIndex(block_size)
        self._uncached = FreeBlockQueue()
        for block in self.blocks:
            self._uncached.append(block)
        # holder (tenant key) -> block id -> references it holds: len() is what its quota counts
        self._holds: dict[bytes, dict[int, int]] = {}
        self._indexed_by_ns: Counter[bytes] = Counter()
        # Retained blocks per holder (block id -> deadline), to bound what one tenant may keep.
        self._retained_by: dict[bytes, dict[int, float]] = {}
        self.num_evictions = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks an ``allocate`` can hand out now (never-indexed free + evictable)."""
        return len(self._uncached) + len(self.policy)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self.policy)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def used_by(self, holder: bytes) -> int:
        """Distinct blocks ``holder`` (a tenant key) holds references to: what its quota counts."""
        held = self._holds.get(holder)
        return len(held) if held else 0

    def usage_by_holder(self) -> dict[bytes, int]:
        return {h: len(held) for h, held in self._holds.items() if held}

    def count_not_held(self, block_ids: Sequence[int], holder: bytes) -> int:
        """How many of ``block_ids`` ``holder`` holds no reference to: taking them adds that to its use."""
        held = self._holds.get(holder)
        if not held:
            return len(block_ids)
        return sum(1 for b in block_ids if b not in held)

    def indexed_by(self, namespace: bytes) -> int:
        """Indexed blocks (in use or evictable) of ``namespace``."""
        return self._indexed_by_ns[namespace]

    # ------------------------------------------------------------------ operations

    def allocate(self, n: int, namespace: bytes, holder: bytes | None = None) -> list[int] | None:
        """``n`` fresh blocks (refcount 1) of ``namespace`` held by ``holder`` (default: the
        namespace), or ``None`` (and no change) if fewer than ``n`` are free. May evict indexed
        blocks, tails first."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > self.num_free:
            return None
        holder = namespace if holder is None else holder
        held = self._holds.setdefault(holder, {})  # once per call, as in touch
        out: list[int] = []
        for _ in range(n):
            block = self._uncached.popleft()
            if block is None:
                block = self._evict_one()
            block.ref_cnt = 1
            block.namespace = namespace
            block.holder = holder
            held[block.block_id] = 1  # a fresh block: nobody held it
            out.append(block.block_id)
        return out

    def _evict_one(self) -> Block:
        with self._observer.phase(CachePhase.EVICT) if self._observer is not None else _UNOBSERVED:
            victim = self.policy.pop_victim()
            if victim is None:  # num_free counted it, so a leaf must exist (the index is prefix-closed)
                raise IntegrityError("eviction policy found no evictable leaf although blocks were free")
            assert victim.block_hash is not None and victim.namespace is not None
            if self._on_evict is not None:
                left = max(0.0, victim.retain_until - self.clock()) if victim.retain_until else 0.0
                self._on_evict(EvictedBlock(BlockHash(victim.block_hash), victim.namespace, victim.depth,
                                            victim.block_id, retained_for_s=left,
                                            holder=victim.holder or victim.namespace))
            self._unindex(victim)
            self.num_evictions += 1
            return victim

    def _unindex(self, block: Block) -> None:
        assert block.block_hash is not None and block.namespace is not None
        self.index.remove(BlockHash(block.block_hash))
        self._indexed_by_ns[block.namespace] -= 1
        parent = block.parent
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0 and parent.ref_cnt == 0:
                self.policy.leaf_exposed(parent)
        if block.retain_until:
            for held in self._retained_by.values():  # few tenants; only for a retained block
                held.pop(block.block_id, None)
            block.retain_until = 0.0
        block.block_hash = None
        block.parent = None
        block.depth = -1
        block.uses = 0
        block.namespace = None
        block.holder = None

    def touch(self, block_ids: Sequence[int], namespace: bytes, holder: bytes | None = None) -> None:
        """Take a reference for ``holder`` (default: the namespace) on cached blocks of ``namespace``
        (a prefix hit); evictable ones come back into use."""
        holder = namespace if holder is None else holder
        blocks = self.blocks
        held = self._holds.setdefault(holder, {})  # once per call: a 7,680-token hit takes 480 blocks
        for block_id in block_ids:
            block = blocks[block_id]
            if block.block_hash is None or block.namespace != namespace:
                raise ValueError(f"block {block_id} is not an indexed block of this namespace")
            if block.ref_cnt == 0:
                self.policy.discard(block)
            block.ref_cnt += 1
            block.uses += 1
            held[block_id] = held.get(block_id, 0) + 1
            block.holder = holder

    def retain(self, block_ids: Sequence[int], until: float, limit: int, holder: bytes | None = None) -> int:
        """Keep the indexed blocks ``block_ids`` (one chain, head first) from eviction until ``until``
        (``clock`` time) while other victims exist; returns how many are retained now.

        Call while the caller still holds the blocks. ``holder`` (a tenant key; default: the
        chain's namespace) retains at most ``limit`` blocks at once (expired retentions do not
        count): past it, the chain's tail is not retained, so one tenant's retention cannot push
        every other tenant's cache out of HBM."""
        if not block_ids:
            return 0
        now = self.clock()
        namespace = self.blocks[block_ids[0]].namespace
        if namespace is None:
            return 0
        held = self._retained_by.setdefault(namespace if holder is None else holder, {})
        for block_id in [b for b, deadline in held.items() if deadline <= now]:
            del held[block_id]
        n = 0
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None or block.namespace != namespace:
                break  # past the indexed prefix of the chain
            if block_id not in held and len(held) >= limit:
                break
            block.retain_until = max(block.retain_until, until)
            held[block_id] = block.retain_until
            n += 1
        return n

    def retained_by(self, holder: bytes) -> int:
        """Blocks ``holder`` (a tenant key, or a namespace used as one) retains, retention not ended."""
        now = self.clock()
        return sum(1 for deadline in self._retained_by.get(holder, {}).values() if deadline > now)

    def retained_in(self, namespace: bytes) -> int:
        """Blocks of ``namespace`` under a retention that has not ended (whoever retained them)."""
        now = self.clock()
        blocks = self.blocks
        return len({b for held in self._retained_by.values() for b, deadline in held.items()
                    if deadline > now and blocks[b].namespace == namespace})

    def free(self, block_ids: Sequence[int], holder: bytes | None = None) -> None:
        """Drop one reference of ``holder`` (default: each block's namespace) on each block. Freed
        in reverse so that, among blocks released together, a sequence's tail is older than its
        head (evicted first under LRU)."""
        blocks, push = self.blocks, self.policy.push
        callers = self._holds.get(holder) if holder is not None else None  # once per call, as in touch
        for block_id in reversed(block_ids):
            block = blocks[block_id]
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block_id}")
            assert block.namespace is not None
            held = callers if holder is not None else self._holds.get(block.namespace)
            if not held or (refs := held.get(block_id, 0)) <= 0:
                raise ValueError(f"block {block_id} is not held by this tenant")
            if refs > 1:
                held[block_id] = refs - 1
            else:
                del held[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            if block.block_hash is not None:
                push(block)
            else:
                block.namespace = None
                block.holder = None
                self._uncached.append(block)

    def register(self, block_id: int, block_hash: BlockHash, depth: int, parent_id: int | None,
                 holder: bytes | None = None) -> int:
        """Index a block that just became full; returns the block id that now holds ``block_hash``.

        ``depth`` is its chain position and ``parent_id`` the block holding the previous hash of
        the chain (``None`` at depth 0); the caller holds both. If ``block_hash`` is already
        indexed elsewhere (another request computed the same prefix concurrently), the caller's
        reference moves there and ``block_id`` is freed: replace it in the block table by the
        returned id. With caching disabled nothing is indexed and ``block_id`` is returned.
        ``holder``: the tenant key the caller's reference is held for (default: the namespace).
        """
        block = self.blocks[block_id]
        if block.ref_cnt < 1 or block.namespace is None:
            raise ValueError(f"block {block_id} is not in use")
        if not self.enable_caching or block.block_hash == block_hash:
            return block_id
        if block.block_hash is not None:
            raise ValueError(f"block {block_id} is already indexed under another hash")
        resident = self.index.get(block_hash)
        if resident is not None:
            assert block.ref_cnt == 1, "an unindexed block is never shared"
            self.touch([resident], block.namespace, holder)
            self.free([block_id], holder)
            return resident
        parent: Block | None = None
        if depth > 0:
            if parent_id is None:
                raise ValueError("a block at depth > 0 needs its parent block")
            parent = self.blocks[parent_id]
            if parent.block_hash is None or parent.depth != depth - 1 or parent.ref_cnt < 1:
                raise ValueError(f"parent block {parent_id} is not an in-use indexed block at depth {depth - 1}")
        elif parent_id is not None:
            raise ValueError("a block at depth 0 has no parent")
        return self._index(block, block_hash, depth, parent)

    def _index(self, block: Block, block_hash: BlockHash, depth: int, parent: Block | None) -> int:
        assert block.namespace is not None
        self.index.insert(block_hash, block.block_id)
        block.block_hash = block_hash
        block.depth = depth
        block.parent = parent
        block.uses = 1
        if parent is not None:
            parent.num_children += 1
        self._indexed_by_ns[block.namespace] += 1
        return block.block_id

    def evict_all_cached(self) -> int:
        """Drop every evictable block from the index (``reset_prefix_cache``). Returns how many."""
        n = 0
        while len(self.policy):
            block = self._evict_one()
            self._uncached.append(block)
            n += 1
        return n

    # ------------------------------------------------------------------ checking

    def check_integrity(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raise ``IntegrityError`` unless every invariant holds.

        ``block_tables`` are the block tables of every live request (the only holders of
        references). Checks: refcounts equal table references; the never-indexed free queue is
        linked both ways and holds exactly the unreferenced unindexed blocks; evictable blocks are
        exactly the unreferenced indexed ones and the policy holds that many; free + used = total;
        the index maps every hash to the block that holds it and back; the index is prefix-closed
        with correct child counts; per-namespace indexed counts match; the holders' references
        to each block add up to its refcount.
        """

        def fail(msg: str) -> None:
            raise IntegrityError(msg)

        refs: Counter[int] = Counter()
        for table in block_tables:
            refs.update(table)
        for block in self.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                fail(f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} table refs")
        queued = self._uncached.check()
        expected_uncached = [b for b in self.blocks if b.ref_cnt == 0 and b.block_hash is None]
        if {b.block_id for b in queued} != {b.block_id for b in expected_uncached} or len(queued) != len(
            expected_uncached
        ):
            fail("free queue does not hold exactly the unreferenced, unindexed blocks")
        evictable = [b for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None]
        if len(evictable) != len(self.policy):
            fail(f"policy holds {len(self.policy)} evictable blocks, pool has {len(evictable)}")
        for b in evictable:
            if b.prev_free is not None and b in queued:
                fail(f"evictable block {b.block_id} is in the free queue")
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if used + self.num_free != self.num_blocks or used != self.num_used:
            fail(f"used {used} + free {self.num_free} != total {self.num_blocks}")
        if len(self.index) != sum(1 for b in self.blocks if b.block_hash is not None):
            fail("index size differs from the number of indexed blocks")
        children: Counter[int] = Counter()
        for block_hash, block_id in self.index.items():
            block = self.blocks[block_id]
            if block.block_hash != block_hash:
                fail(f"index maps a hash to block {block_id}, which holds another")
            if block.depth > 0:
                parent = block.parent
                if parent is None or parent.block_hash is None or self.index.get(BlockHash(parent.block_hash)) != parent.block_id:
                    fail(f"indexed block {block_id} has no indexed parent (index not prefix-closed)")
                    return
                if parent.depth != block.depth - 1 or parent.namespace != block.namespace:
                    fail(f"block {block_id}'s parent has the wrong depth or namespace")
                children[parent.block_id] += 1
            elif block.parent is not None:
                fail(f"block {block_id} at depth 0 has a parent")
        for block in self.blocks:
            if block.num_children != children.get(block.block_id, 0):
                fail(f"block {block.block_id}: num_children {block.num_children} != {children.get(block.block_id, 0)}")
        held_refs: Counter[int] = Counter()
        for held in self._holds.values():
            held_refs.update(held)
        for block in self.blocks:
            if held_refs.get(block.block_id, 0) != block.ref_cnt:
                fail(f"block {block.block_id}: holders' references {held_refs.get(block.block_id, 0)} "
                     f"!= ref_cnt {block.ref_cnt}")
        idx_ns: Counter[bytes] = Counter(b.namespace for b in self.blocks if b.block_hash is not None and b.namespace)
        if +idx_ns != +self._indexed_by_ns:
            fail("per-namespace indexed counts are off")
