"""How the router picks one node of a pool: the policies, each a pure function of the candidates.

    prefix_hash   rendezvous hashing on the prompt's leading block hash, leaving the affinity
                  node once it has more than load_factor x (least + 1) in flight (stateless)
    kv_aware      the node the fleet index says holds the longest prefix of the request's block
                  chain, among the nodes within the load bound; else the least-loaded one
    least_loaded  the fewest requests in flight (ties rotate: a baseline that knows no prefix)
    round_robin   the next node, whatever it holds or carries

Load bound (consistent hashing with bounded loads): with ``m`` requests in flight on ``n`` nodes,
a node may take the next one while ``inflight + 1 <= ceil((1 + epsilon) * (m + 1) / n)``, so no
node carries more than about ``(1 + epsilon)`` x the mean, and at least one node always qualifies.
Ties (equal prefix, equal load) go by rendezvous order on the request's key, so a cold prefix
still lands on one node instead of spreading over all of them.

``benchmarks/fleet_sim.py`` compares them at 4-256 replicas; ``benchmarks/fleet_loopback.py`` on
real nodes (docs/fleet.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol, TypeVar

from engine.block_hashing import BlockHash, prefix_block_hashes
from engine.kv_events import ExternalBlockHash
from gateway.fleet_index import FleetIndex


class RoutingPolicy(StrEnum):
    PREFIX_HASH = "prefix_hash"
    KV_AWARE = "kv_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class NodeLoad(Protocol):
    """What a policy reads of a candidate (``gateway.routing.Backend`` has these)."""

    @property
    def label(self) -> str: ...

    @property
    def inflight(self) -> int: ...


N = TypeVar("N", bound=NodeLoad)


def token_route_key(namespace: bytes, token_ids: Sequence[int], block_size: int, prefix_blocks: int,
                    max_blocks: int) -> tuple[bytes, tuple[BlockHash, ...]]:
    """A token-id prompt's rendezvous key and block chain: the chain is the engine's own block hashes
    (up to ``max_blocks``), the key its hash at ``prefix_blocks`` (the shared-prefix span), or, for a
    prompt shorter than one block, a hash of the whole prompt. Pure, and free of the gateway's web
    packages, so that a benchmark driving engine nodes directly routes as the gateway does."""
    chain = tuple(prefix_block_hashes(namespace, token_ids, block_size, max_blocks))
    if not chain:
        return hashlib.sha256(namespace + json.dumps(list(token_ids)).encode()).digest(), ()
    return chain[min(len(chain), prefix_blocks) - 1], chain


def rendezvous_order(key: bytes, nodes: Sequence[N]) -> list[N]:
    """``nodes`` by descending rendezvous weight for ``key`` (the same order in every gateway)."""
    return sorted(nodes, key=lambda b: hashlib.sha256(key + b.label.encode()).digest(), reverse=True)


def prefix_hash_choice(key: bytes, nodes: Sequence[N], load_factor: float) -> N:
    order = rendezvous_order(key, nodes)
    best = order[0]
    least = min(b.inflight for b in order)
    if best.inflight > load_factor * (least + 1):
        return next(b for b in order if b.inflight == least)
    return best


def within_load_bound(nodes: Sequence[N], epsilon: float) -> list[N]:
    """The nodes that may take one more request under the bound of the module docstring."""
    total = sum(b.inflight for b in nodes)
    cap = math.ceil((1.0 + epsilon) * (total + 1) / len(nodes))
    return [b for b in nodes if b.inflight + 1 <= cap]


def least_loaded_choice(key: bytes, nodes: Sequence[N]) -> N:
    """The least-loaded node, ties by rendezvous order on ``key`` (a cold prefix stays together)."""
    least = min(b.inflight for b in nodes)
    return next(b for b in rendezvous_order(key, nodes) if b.inflight == least)


def least_loaded_rotating(turn: int, nodes: Sequence[N]) -> N:
    """The least-loaded node, ties in turn (policy ``least_loaded``: blind to prefixes, as a
    baseline must be; idle nodes tie all the time at low load)."""
    least = min(b.inflight for b in nodes)
    tied = [b for b in nodes if b.inflight == least]
    return tied[turn % len(tied)]


def kv_aware_choice(key: bytes, chain: Sequence[ExternalBlockHash], nodes: Sequence[N], index: FleetIndex,
                    epsilon: float) -> tuple[N, int]:
    """The chosen node and the prefix blocks the index says it holds (0 = chosen by load alone)."""
    allowed = within_load_bound(nodes, epsilon)
    held = index.prefix_lengths(chain, [b.label for b in allowed]) if chain else {}
    best = max(held.values(), default=0)
    if best == 0:
        return least_loaded_choice(key, allowed), 0
    return least_loaded_choice(key, [b for b in allowed if held[b.label] == best]), best


def round_robin_choice(turn: int, nodes: Sequence[N]) -> N:
    return nodes[turn % len(nodes)]
