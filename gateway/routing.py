"""Which backend serves a request: the local engine, a remote engine node, or an upstream provider.

Every backend is an ``EngineClient``; the router only chooses one. For a pool of engine nodes the
choice is cache-aware: requests that share a tenant namespace and a prompt prefix should land on
the node that already holds that prefix's KV blocks::

    token ids known (a token-id prompt, or ``token_ids=`` from a gateway that tokenized):
        chain = the engine's own block hashes (engine.block_hashing): h_0 = SHA-256(namespace ||
                tokens 0..15), h_i = SHA-256(h_{i-1} || block i), full blocks only
        key   = the chain's hash at route_prefix_tokens (the shared-prefix span), for rendezvous
    else (text the gateway does not tokenize for this pool):
        key   = chain(namespace; first full 256-byte blocks of the canonical prompt, up to prefix_bytes)
        chain = () (the fleet index cannot be asked)
    node  = the route's policy (gateway.routing_policy): prefix_hash (default, stateless),
            kv_aware (the fleet index fed by the nodes' KV events, within a load bound),
            least_loaded or round_robin
    down:  a node that refused a connection, is draining or refused the node token is skipped for
           DOWN_S seconds and its index entries are dropped (all down: try them all)
    cool-down (passive health, as Envoy's outlier detection and LiteLLM's router do it): a node
           whose requests fail ``OutlierPolicy.failures`` times in a row (HTTP 5xx, errors in the
           stream, no answer within the read timeout) is skipped for ``cooldown_s``, then tried
           again; one more failure then sends it back at once, one success resets the count
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine.block_hashing import DEFAULT_BLOCK_SIZE, BlockHash
from engine.protocol import EngineClient, ModelCard
from gateway.errors import OpenAIError
from gateway.fleet_index import FleetIndex
from gateway.kv_event_subscriber import KVEventSubscriber
from gateway.remote import NodeFault
from gateway.routing_policy import (
    RoutingPolicy,
    kv_aware_choice,
    least_loaded_rotating,
    prefix_hash_choice,
    rendezvous_order,  # noqa: F401 - re-exported: callers and tests name it from gateway.routing
    round_robin_choice,
    token_route_key,
)

ROUTE_BLOCK_BYTES = 256
DOWN_S = 10.0
# Faults that take a node out at once: it will fail the next request the same way.
IMMEDIATE_FAULTS = frozenset({NodeFault.UNREACHABLE, NodeFault.DRAINING, NodeFault.AUTH})

log = logging.getLogger("prefixgate.gateway")


@dataclass(frozen=True)
class OutlierPolicy:
    """Passive health: ``failures`` consecutive failed requests put a node in a ``cooldown_s`` cool-down."""

    failures: int = 3
    cooldown_s: float = 30.0


@dataclass
class PassiveHealth:
    """What a node's own requests said of it (``Router.record_failure`` / ``record_success``)."""

    consecutive_failures: int = 0
    cooldown_until: float = 0.0  # time.monotonic() before which the node is skipped
    last_failure: str | None = None  # the last failure's fault and detail (for /health)


class BackendKind(StrEnum):
    LOCAL = "local"  # the in-process engine
    NODE = "node"  # another `prefixgate serve` over the node API
    PROVIDER = "provider"  # an upstream API (litellm or direct HTTP)


@dataclass
class Backend:
    """One concrete place to send a request; every kind is driven through ``client.generate``.

    label: bounded-cardinality name for metrics, the ledger and the ``x-prefixgate-backend`` header
        ("local", "node:<name>" with the node's configured name, never its URL, "litellm:<provider>").
    target_model: the model name the backend itself expects.
    The properties say what differs between kinds, so callers ask for a behaviour, not a kind.
    """

    label: str
    kind: BackendKind
    client: EngineClient
    target_model: str
    inflight: int = 0
    down_until: float = 0.0  # time.monotonic() before which the node is skipped (probe, refused connection)
    tokenizer_here: bool = False  # a node pool whose tokenizer the gateway loaded (RouteConfig.tokenizer)
    passive: PassiveHealth = field(default_factory=PassiveHealth)
    announced_up: bool = True  # what the log last said (node_health.probe_once logs each change once)

    @property
    def name(self) -> str:
        """The operator's name for it: the label after its kind ("gpu-a" of "node:gpu-a")."""
        return self.label.partition(":")[2] or self.label

    @property
    def tokenizes_here(self) -> bool:
        """The model's tokenizer is in this process: the gateway tokenizes once and checks the context
        (the local engine; a node pool with ``tokenizer``, whose nodes then get token ids)."""
        return self.kind is BackendKind.LOCAL or self.tokenizer_here

    @property
    def honours_retention(self) -> bool:
        """Explicit cache control (``GenerateRequest.retention``) reaches the cache: the local engine;
        the node API has no field for it."""
        return self.kind is BackendKind.LOCAL

    @property
    def takes_openai_fields(self) -> bool:
        """The backend reads OpenAI fields the engine cannot honour (tool_choice, content parts...) and
        is billed under its own model name (priced from litellm's map), not the client's alias."""
        return self.kind is BackendKind.PROVIDER

    @property
    def up(self) -> bool:
        now = time.monotonic()
        return now >= self.down_until and now >= self.passive.cooldown_until

    @property
    def cooldown_left_s(self) -> float:
        return max(0.0, self.passive.cooldown_until - time.monotonic())


@dataclass
class Route:
    """A client-visible model name and its backends (one, or a node pool)."""

    model: str
    backends: list[Backend]
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def prompt_route_bytes(body: dict[str, Any]) -> bytes:
    """The bytes whose prefix identifies a prompt for routing: tools, then messages (or the prompt)."""
    if "messages" in body:
        head = {"tools": body.get("tools") or [], "messages": body["messages"]}
    else:
        head = {"prompt": body.get("prompt")}
    return json.dumps(head, sort_keys=True, separators=(",", ":"), default=str).encode()


def routing_key(namespace: bytes, prompt: bytes, prefix_bytes: int) -> bytes:
    """Chain hash of the namespace and the first full blocks of ``prompt`` (at most ``prefix_bytes``)."""
    h = hashlib.sha256(namespace).digest()
    usable = prompt[:prefix_bytes]
    full = len(usable) // ROUTE_BLOCK_BYTES
    if full == 0:  # shorter than a block: the whole prompt is the key
        return hashlib.sha256(h + usable).digest()
    for i in range(full):
        h = hashlib.sha256(h + usable[i * ROUTE_BLOCK_BYTES : (i + 1) * ROUTE_BLOCK_BYTES]).digest()
    return h


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """A token-id prompt's ids (the first prompt of a batch), else None (text, or chat)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return prompt if all(isinstance(t, int) for t in prompt) else None
        if isinstance(first, list) and first and all(isinstance(t, int) for t in first):
            return first
    return None


@dataclass(frozen=True)
class RouteKey:
    """What a policy routes on: a rendezvous key and, when the tokens are known, the block chain."""

    key: bytes
    chain: tuple[BlockHash, ...] = ()


def choose(key: bytes, backends: Sequence[Backend], load_factor: float) -> Backend:
    """Rendezvous choice among nodes that are up, with the in-flight guard (policy ``prefix_hash``)."""
    return prefix_hash_choice(key, [b for b in backends if b.up] or backends, load_factor)


class Router:
    """Resolves a client's ``model`` to a backend. The local engine is passed per call (injectable).

    Args:
        policy: how a node pool is chosen from (``gateway.routing_policy``).
        load_factor: ``prefix_hash``'s in-flight guard; epsilon: ``kv_aware``'s load bound.
        prefix_bytes / prefix_tokens: the shared-prefix span the rendezvous key covers (text / tokens).
        block_size: the nodes' KV block size (the chain must be cut where theirs is).
        index: the fleet index ``kv_aware`` asks; events: the subscriber that feeds it (its
            thread runs between ``start_events`` and ``stop_events``).
    """

    def __init__(self, routes: Sequence[Route], *, policy: RoutingPolicy = RoutingPolicy.PREFIX_HASH,
                 load_factor: float = 2.0, epsilon: float = 0.25, prefix_bytes: int = 1024,
                 prefix_tokens: int = 256, block_size: int = DEFAULT_BLOCK_SIZE, max_route_blocks: int = 512,
                 index: FleetIndex | None = None, events: KVEventSubscriber | None = None,
                 outliers: OutlierPolicy | None = None) -> None:
        self.routes = {r.model: r for r in routes}
        self.policy = policy
        self.load_factor = load_factor
        self.epsilon = epsilon
        self.prefix_bytes = prefix_bytes
        self.prefix_blocks = max(1, prefix_tokens // block_size)
        self.block_size = block_size
        self.max_route_blocks = max_route_blocks
        self.index = index if index is not None else FleetIndex()
        self.events = events
        self._turn: dict[str, int] = {}
        self._local_backend: Backend | None = None
        self.outliers = outliers or OutlierPolicy()
        # Read by /metrics (node_health.NodeCollector): pool picks, and kv_aware's index-predicted
        # prefix blocks on the chosen nodes (per pick: how much of the prompt the index expects cached).
        self.routed_prefix_blocks = 0
        self.routed_requests = 0
        # (route, node label, fault) -> count: every failure a request saw, and those moved elsewhere.
        self.failures: Counter[tuple[str, str, str]] = Counter()
        self.failovers: Counter[tuple[str, str, str]] = Counter()
        self.cooldowns: Counter[tuple[str, str]] = Counter()

    def start_events(self) -> None:
        if self.events is not None:
            self.events.start()

    def stop_events(self) -> None:
        if self.events is not None:
            self.events.stop()

    def local_backend(self, local: EngineClient) -> Backend:
        if self._local_backend is None or self._local_backend.client is not local:
            self._local_backend = Backend("local", BackendKind.LOCAL, local, "")
        return self._local_backend

    def route_key(self, namespace: bytes, body: dict[str, Any], token_ids: Sequence[int] | None = None) -> RouteKey:
        """The request's rendezvous key and block chain (module docstring)."""
        ids = token_ids if token_ids is not None else prompt_token_ids(body)
        if ids is None:
            return RouteKey(routing_key(namespace, prompt_route_bytes(body), self.prefix_bytes))
        key, chain = token_route_key(namespace, ids, self.block_size, self.prefix_blocks, self.max_route_blocks)
        return RouteKey(key, chain)

    def pick(self, model: str, backends: Sequence[Backend], rk: RouteKey) -> Backend:
        """One node of a pool by the router's policy (nodes that are down are skipped)."""
        nodes = [b for b in backends if b.up] or list(backends)
        self.routed_requests += 1
        if self.policy is RoutingPolicy.KV_AWARE:
            node, held = kv_aware_choice(rk.key, rk.chain, nodes, self.index, self.epsilon)
            self.routed_prefix_blocks += held
            return node
        if self.policy in (RoutingPolicy.LEAST_LOADED, RoutingPolicy.ROUND_ROBIN):
            turn = self._turn.get(model, 0)
            self._turn[model] = turn + 1
            if self.policy is RoutingPolicy.LEAST_LOADED:
                return least_loaded_rotating(turn, nodes)
            return round_robin_choice(turn, nodes)
        return prefix_hash_choice(rk.key, nodes, self.load_factor)

    def resolve(self, model: str, local: EngineClient | None, namespace: bytes, body: dict[str, Any],
                token_ids: Sequence[int] | None = None) -> Backend:
        """Pick the backend for ``model``. Raises a 404 ``model_not_found`` for unknown models.

        Configured routes win over the local engine, so a config file can move a local model name
        onto a node pool. ``token_ids``: the prompt's ids where the gateway tokenized it (a
        token-id prompt in ``body`` is read without them).
        """
        route = self.routes.get(model)
        if route is not None:
            if len(route.backends) == 1:
                return route.backends[0]
            if token_ids is None and route.backends[0].tokenizer_here and prompt_token_ids(body) is None:
                # A pool whose prompts the gateway tokenizes: this is only the pool's representative
                # (kind, tokenizer, context); the caller tokenizes with it and resolves again with
                # ``token_ids``, so the pick sees the block chain the nodes will cache.
                return route.backends[0]
            return self.pick(model, route.backends, self.route_key(namespace, body, token_ids))
        if local is not None:
            for card in local.models():
                if card.id == model:
                    backend = self.local_backend(local)
                    backend.target_model = card.id
                    return backend
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )

    def model_cards(self, local: EngineClient | None) -> list[ModelCard]:
        cards: dict[str, ModelCard] = {}
        if local is not None:
            for card in local.models():
                cards[card.id] = card
        for route in self.routes.values():
            max_len = route.max_model_len
            if max_len is None:
                lens = [c.max_model_len for b in route.backends for c in b.client.models()]
                max_len = max(lens) if lens else 0
            cards[route.model] = ModelCard(id=route.model, max_model_len=max_len)
        return list(cards.values())

    def failover(self, model: str, failed: Backend, fault: NodeFault = NodeFault.UNREACHABLE) -> Backend | None:
        """The least-loaded other node of ``model``'s pool that is up, if any, for a request ``failed``
        could not serve (``record_failure`` has taken ``failed`` out, or counted the failure)."""
        route = self.routes.get(model)
        others = [b for b in (route.backends if route else []) if b is not failed and b.up]
        if not others:
            return None
        self.failovers[(model, failed.label, fault.value)] += 1
        return min(others, key=lambda b: b.inflight)

    def record_failure(self, model: str, backend: Backend, fault: NodeFault, detail: str) -> None:
        """A request of ``backend`` failed with ``fault``. Unreachable, draining, refused token: out
        for DOWN_S at once (its fleet-index entries dropped: it may come back empty). HTTP 5xx and
        timeouts: counted; ``outliers.failures`` in a row start a cool-down."""
        self.failures[(model, backend.label, fault.value)] += 1
        passive = backend.passive
        passive.consecutive_failures += 1
        passive.last_failure = f"{fault.value}: {detail}"
        if fault in IMMEDIATE_FAULTS:
            self.mark_down(backend, DOWN_S)
            return
        log.warning("engine node %s of route %s: request failed (%s, %d in a row): %s", backend.name, model,
                    fault.value, passive.consecutive_failures, detail)
        if passive.consecutive_failures >= self.outliers.failures:
            passive.cooldown_until = time.monotonic() + self.outliers.cooldown_s
            self.cooldowns[(model, backend.label)] += 1

    def record_success(self, backend: Backend) -> None:
        """A request of ``backend`` finished: its run of failures is over."""
        backend.passive.consecutive_failures = 0

    def mark_down(self, backend: Backend, seconds: float) -> None:
        """Skip ``backend`` for ``seconds`` and forget what the fleet index says it holds: a node
        that failed or went unhealthy may come back with an empty cache."""
        backend.down_until = time.monotonic() + seconds
        self.index.drop_node(backend.label)

    def max_model_len(self, backend: Backend) -> int | None:
        for card in backend.client.models():
            if card.id == backend.target_model:
                return card.max_model_len
        return None

    @contextmanager
    def track(self, backend: Backend) -> Iterator[None]:
        """Count a request in flight on ``backend`` for the load guard."""
        backend.inflight += 1
        try:
            yield
        finally:
            backend.inflight -= 1

    def all_clients(self) -> list[EngineClient]:
        return [b.client for r in self.routes.values() for b in r.backends]
