"""An approximate fleet-wide index: which engine nodes hold which KV blocks.

Fed by the nodes' KV events (``gateway.kv_event_subscriber``), read by the router
(``gateway.routing_policy``)::

    entries: OrderedDict[block hash -> {node label: last stored (monotonic s)}]   oldest first
    stored(node, hashes)    add/refresh (node, h), move h to the young end
    removed(node, hashes)   drop (node, h)
    drop_node(node)         forget a node (unhealthy, a gap in its event stream, AllBlocksCleared)
    prefix_lengths(chain)   per node: how many leading hashes of the chain it holds

Approximate on purpose, and wrong only in ways that cost a cache hit, never a wrong answer (the
engine checks its own index): a lost ``BlockRemoved`` leaves a stale entry until it expires
(``ttl_s`` after its last ``BlockStored``) or is pushed out; memory is bounded by ``max_blocks``
hashes (the oldest-stored go first); a node that went away is dropped whole.

Thread-safe: the subscriber's thread writes, the event loop reads, under one lock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from engine.kv_events import ExternalBlockHash


class FleetIndex:
    """Args:
    max_blocks: most distinct block hashes kept (the oldest-stored are forgotten first).
    ttl_s: an entry not re-stored for this long counts as gone (its removal may have been lost).
    clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, max_blocks: int = 1_000_000, ttl_s: float = 900.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 1 or ttl_s <= 0:
            raise ValueError("max_blocks must be >= 1 and ttl_s > 0")
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[ExternalBlockHash, dict[str, float]] = OrderedDict()
        self._per_node: dict[str, int] = {}
        self.forgotten = 0  # hashes pushed out by max_blocks

    def __len__(self) -> int:
        return len(self._entries)

    def blocks_of(self, node: str) -> int:
        """How many blocks the index holds for ``node`` (expired ones included until read)."""
        return self._per_node.get(node, 0)

    def stored(self, node: str, hashes: Iterable[ExternalBlockHash]) -> None:
        now = self._clock()
        with self._lock:
            for h in hashes:
                nodes = self._entries.get(h)
                if nodes is None:
                    nodes = self._entries[h] = {}
                else:
                    self._entries.move_to_end(h)
                if node not in nodes:
                    self._per_node[node] = self._per_node.get(node, 0) + 1
                nodes[node] = now
            while len(self._entries) > self.max_blocks:
                _, evicted = self._entries.popitem(last=False)
                self._uncount(evicted)
                self.forgotten += 1

    def removed(self, node: str, hashes: Iterable[ExternalBlockHash]) -> None:
        with self._lock:
            for h in hashes:
                nodes = self._entries.get(h)
                if nodes is not None and nodes.pop(node, None) is not None:
                    self._per_node[node] -= 1
                    if not nodes:
                        del self._entries[h]

    def drop_node(self, node: str) -> int:
        """Forget every entry of ``node``; returns how many there were. O(entries)."""
        with self._lock:
            if not self._per_node.get(node):
                return 0
            n = 0
            for h in [h for h, nodes in self._entries.items() if node in nodes]:
                nodes = self._entries[h]
                del nodes[node]
                n += 1
                if not nodes:
                    del self._entries[h]
            self._per_node[node] = 0
            return n

    def prefix_lengths(self, chain: Sequence[ExternalBlockHash], nodes: Sequence[str]) -> dict[str, int]:
        """For each of ``nodes``: how many leading hashes of ``chain`` it holds (0 if none).

        Walks the chain once, keeping the nodes still matching; stops when none is left.
        """
        out = dict.fromkeys(nodes, 0)
        alive = set(nodes)
        oldest = self._clock() - self.ttl_s
        with self._lock:
            for depth, h in enumerate(chain):
                holders = self._entries.get(h)
                if not holders:
                    break
                # membership first: a default stamp compared with ``oldest`` would count a node that
                # holds nothing as alive while the clock is younger than the TTL (a host just booted)
                alive = {n for n in alive if n in holders and holders[n] >= oldest}
                if not alive:
                    break
                for n in alive:
                    out[n] = depth + 1
        return out

    def _uncount(self, nodes: dict[str, float]) -> None:
        for n in nodes:
            self._per_node[n] -= 1
