"""Which evictable KV block to give up when the pool needs a free one.

An *evictable* block has refcount 0 but still holds the KV of an indexed prefix block, so a later
request can hit it. The pool asks its policy for a victim only when no never-indexed free block is
left. Policies see only free, indexed blocks and must return a **leaf**: a block no indexed block
names as its parent (``num_children == 0``). Evicting a parent first would strand its children:
a match walks the chain from the start and stops at the first missing hash, so an indexed child of
a missing parent can never be hit again, yet still holds a block.

Two policies (``EngineConfig.eviction_policy``):

- ``lru``: least recently released first (vLLM's order). Tail blocks are released before their
  parents, so the head of the queue is a leaf in practice; the scan past non-leaves is a guard.
- ``cost`` (default): GreedyDual-Size-Frequency. On release a block gets the priority
  ``H = L + uses * recompute_cost(depth)``; the lowest ``H`` among free leaves is evicted and the
  clock ``L`` rises to it, which ages blocks nobody touches. ``uses`` counts the requests that held
  the block (reuse frequency); ``recompute_cost`` grows with the block's depth in its chain because
  recomputing block ``d`` attends over ``d * block_size`` earlier tokens. So a shallow block used
  once goes before a deep block used often, while an old block is not kept forever.

Retention (explicit cache control: a ``cache_control`` ttl, ``prompt_cache_retention``, a warm-up):
a block whose ``retain_until`` lies in the future is passed over while any unretained leaf is
evictable. Only when nothing else is left does a retained block go (the one whose retention ends
first), so retention never makes an allocation fail; the tier hook then keeps its bytes in a lower
tier (demoted, not dropped). The pool bounds how many blocks one tenant may retain.

Policies are told of state changes by the pool; they never read scheduler or request state.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from engine.config import EvictionPolicyName


class Block:
    """One KV block's bookkeeping (the KV bytes live in the runner's cache at index ``block_id``).

    ``prev_free``/``next_free`` are the intrusive links of whichever free queue holds the block;
    a block sits in at most one queue, so one pair of links serves them all and no queue node is
    ever allocated.
    """

    __slots__ = (
        "block_id", "ref_cnt", "block_hash", "namespace", "depth", "parent", "num_children",
        "uses", "priority", "version", "retain_until", "prev_free", "next_free", "holder",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix index
        self.namespace: bytes | None = None  # owner while in use or indexed
        self.holder: bytes | None = None  # tenant key that last took a reference (its spill is charged to it)
        self.depth = -1  # position in its hash chain (0 = first block of a sequence)
        self.parent: Block | None = None  # the indexed block of the previous chain position
        self.num_children = 0  # indexed blocks whose parent this is
        self.uses = 0  # requests that held this block while it was indexed
        self.priority = 0.0  # cost policy: H at the last release
        self.version = 0  # cost policy: bumps invalidate stale heap entries
        self.retain_until = 0.0  # explicit cache control: not a victim before this (monotonic) time
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, depth={self.depth}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """An intrusive doubly linked list of blocks: O(1) append, popleft and remove from the middle.

    Why not ``collections.deque``: removing a block from the middle (a prefix hit revives an
    evictable block) is O(n) there, and every node is an allocation. Here the links live in the
    ``Block`` objects themselves, between two sentinel blocks, so no operation allocates.
    """

    def __init__(self) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, block: Block) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not queued"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> Block | None:
        first = self._head.next_free
        if first is self._tail or first is None:
            return None
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def check(self) -> list[Block]:
        """Walk both directions; raise AssertionError on a broken link. Returns the blocks in order."""
        forward = list(self)
        backward: list[Block] = []
        node = self._tail.prev_free
        while node is not None and node is not self._head:
            backward.append(node)
            node = node.prev_free
        assert forward == backward[::-1], "free queue links disagree forward vs backward"
        assert len(forward) == self._len, f"free queue length {self._len} != {len(forward)} linked"
        return forward


class EvictionPolicy(Protocol):
    """Orders the pool's evictable blocks (refcount 0, indexed).

    Contract: the pool calls ``push`` when a block becomes evictable, ``discard`` when a prefix hit
    takes it back into use, and ``leaf_exposed`` when an evictable block's last indexed child was
    evicted. ``pop_victim`` removes and returns an evictable block with ``num_children == 0``, or
    ``None`` if there is none. ``__len__`` is the number of evictable blocks the policy holds.
    """

    name: str

    def push(self, block: Block) -> None: ...

    def discard(self, block: Block) -> None: ...

    def leaf_exposed(self, block: Block) -> None: ...

    def pop_victim(self) -> Block | None: ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently released first; ties broken by release order (tails before parents)."""

    name = "lru"

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._queue = FreeBlockQueue()
        self._now = now

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, block: Block) -> None:
        self._queue.append(block)

    def discard(self, block: Block) -> None:
        self._queue.remove(block)

    def leaf_exposed(self, block: Block) -> None:
        pass  # it kept its place in the queue

    def pop_victim(self) -> Block | None:
        now = self._now()
        retained = None  # the first retained leaf: the victim only if no other leaf is left
        for block in self._queue:
            if block.num_children == 0:
                if block.retain_until > now:
                    retained = retained or block
                    continue
                self._queue.remove(block)
                return block
        if retained is not None:
            self._queue.remove(retained)
        return retained

    def blocks(self) -> list[Block]:
        return self._queue.check()


class CostPolicy:
    """GreedyDual-Size-Frequency over free leaves (see the module docstring).

    Args:
        block_size: tokens per block.
        attn_span_tokens: the context length at which one token's attention costs as much as its
            dense layers; sets how fast recompute cost grows with depth. 4096 is the right order
            for 1-8B Llama-family models (dense ~2*params FLOPs per token vs ~4*layers*hidden
            FLOPs per token of context).
    """

    name = "cost"

    def __init__(self, block_size: int, attn_span_tokens: float = 4096.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.attn_span_tokens = attn_span_tokens
        self.clock = 0.0
        self._now = now
        self._heap: list[tuple[float, int, int, Block]] = []
        # Retained leaves, ordered by when their retention ends (not by H): they rejoin the main
        # heap once it has, and are taken from here, nearest deadline first, only as a last resort.
        self._retained: list[tuple[float, int, int, Block]] = []
        self._count = 0
        self._seq = 0  # tie-break: earlier release first

    def __len__(self) -> int:
        return self._count

    def recompute_cost(self, depth: int) -> float:
        """Token-equivalents of work to recompute a block at chain position ``depth``."""
        mean_context = (depth + 0.5) * self.block_size
        return self.block_size * (1.0 + mean_context / self.attn_span_tokens)

    def push(self, block: Block) -> None:
        block.priority = self.clock + max(block.uses, 1) * self.recompute_cost(block.depth)
        block.version += 1
        self._count += 1
        if block.num_children == 0:
            self._heappush(block)

    def _heappush(self, block: Block) -> None:
        self._seq += 1
        if block.retain_until > self._now():
            heapq.heappush(self._retained, (block.retain_until, self._seq, block.version, block))
            self._retained = self._compacted(self._retained)
            return
        heapq.heappush(self._heap, (block.priority, self._seq, block.version, block))
        self._heap = self._compacted(self._heap)

    def _compacted(self, heap: list[tuple[float, int, int, Block]]) -> list[tuple[float, int, int, Block]]:
        if len(heap) > 4 * max(self._count, 64):
            # Entries go stale on every hit (discard) and are dropped only when popped, i.e. only
            # under eviction pressure; without it the heap would grow by one entry per release.
            # Rebuilding from the live entries is O(heap), amortised O(1) per push.
            heap = [e for e in heap if self._live(e)]
            heapq.heapify(heap)
        return heap

    @staticmethod
    def _live(entry: tuple[float, int, int, Block]) -> bool:
        block = entry[3]
        return entry[2] == block.version and block.ref_cnt == 0 and block.num_children == 0

    def discard(self, block: Block) -> None:
        block.version += 1  # its heap entry, if any, is now stale
        self._count -= 1

    def leaf_exposed(self, block: Block) -> None:
        self._heappush(block)

    def pop_victim(self) -> Block | None:
        now = self._now()
        while self._retained and self._retained[0][0] <= now:  # retention over: an ordinary leaf again
            entry = heapq.heappop(self._retained)
            if self._live(entry):
                self._seq += 1
                heapq.heappush(self._heap, (entry[3].priority, self._seq, entry[3].version, entry[3]))
        for heap in (self._heap, self._retained):
            while heap:
                entry = heapq.heappop(heap)
                if not self._live(entry):
                    continue  # stale: revived by a hit, or re-pushed since
                block = entry[3]
                block.version += 1
                self._count -= 1
                self.clock = max(self.clock, block.priority)
                return block
        return None


def make_policy(name: EvictionPolicyName, block_size: int,
                now: Callable[[], float] = time.monotonic) -> EvictionPolicy:
    """``now``: the monotonic clock that retention deadlines are compared with (tests pass a fake one)."""
    if name == "lru":
        return LRUPolicy(now)
    if name == "cost":
        return CostPolicy(block_size, now=now)
    raise ValueError(f"unknown eviction policy {name!r}: expected 'cost' or 'lru'")
