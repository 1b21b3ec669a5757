"""Which backend serves a request: the local engine, a remote engine node, or an upstream provider.

Every backend is an ``EngineClient``; the router only chooses one. For a pool of engine nodes the
choice is cache-aware: requests that share a tenant namespace and a prompt prefix should land on
the node that already holds that prefix's KV blocks. Rendezvous (highest-random-weight) hashing
gives that with no shared state, and adding or removing a node only moves the keys it owned::

    key   = chain(namespace; first full 256-byte blocks of the canonical prompt, up to prefix_bytes)
            h_0 = SHA-256(namespace), h_i = SHA-256(h_{i-1} || block_i)      (like the engine's index)
    node  = argmax_n SHA-256(key || n.url)
    guard: if inflight(node) > load_factor * (min_inflight + 1): take the least-loaded node instead
    down:  a node that refused a connection is skipped for DOWN_S seconds (all down: try them all)

The guard trades a cache miss for not piling work on one hot node.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine.protocol import EngineClient, ModelCard
from gateway.errors import OpenAIError

ROUTE_BLOCK_BYTES = 256
DOWN_S = 10.0


class BackendKind(StrEnum):
    LOCAL = "local"  # the in-process engine
    NODE = "node"  # another `prefixgate serve` over the node API
    PROVIDER = "provider"  # an upstream API (litellm or direct HTTP)


@dataclass
class Backend:
    """One concrete place to send a request; every kind is driven through ``client.generate``.

    label: bounded-cardinality name for metrics and the ledger ("local", "node:<url>", "litellm:<provider>").
    target_model: the model name the backend itself expects.
    The properties say what differs between kinds, so callers ask for a behaviour, not a kind.
    """

    label: str
    kind: BackendKind
    client: EngineClient
    target_model: str
    inflight: int = 0
    down_until: float = 0.0  # time.monotonic() before which the node is skipped

    @property
    def tokenizes_here(self) -> bool:
        """The model's tokenizer is in this process: the gateway tokenizes once and checks the context."""
        return self.kind is BackendKind.LOCAL

    @property
    def takes_openai_fields(self) -> bool:
        """The backend reads OpenAI fields the engine cannot honour (tool_choice, content parts...) and
        is billed under its own model name (priced from litellm's map), not the client's alias."""
        return self.kind is BackendKind.PROVIDER

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until


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


def rendezvous_order(key: bytes, backends: Sequence[Backend]) -> list[Backend]:
    """Backends by descending rendezvous weight for ``key`` (stable across processes)."""
    return sorted(backends, key=lambda b: hashlib.sha256(key + b.label.encode()).digest(), reverse=True)


def choose(key: bytes, backends: Sequence[Backend], load_factor: float) -> Backend:
    """Rendezvous choice among nodes that are up, with the load guard of the module docstring."""
    order = rendezvous_order(key, [b for b in backends if b.up] or backends)
    best = order[0]
    least = min(b.inflight for b in order)
    if best.inflight > load_factor * (least + 1):
        return next(b for b in order if b.inflight == least)
    return best


class Router:
    """Resolves a client's ``model`` to a backend. The local engine is passed per call (injectable)."""

    def __init__(self, routes: Sequence[Route], *, load_factor: float = 2.0, prefix_bytes: int = 1024) -> None:
        self.routes = {r.model: r for r in routes}
        self.load_factor = load_factor
        self.prefix_bytes = prefix_bytes
        self._local_backend: Backend | None = None

    def local_backend(self, local: EngineClient | None) -> Backend | None:
        if local is None:
            return None
        if self._local_backend is None or self._local_backend.client is not local:
            self._local_backend = Backend("local", BackendKind.LOCAL, local, "")
        return self._local_backend

    def resolve(self, model: str, local: EngineClient | None, namespace: bytes, body: dict[str, Any]) -> Backend:
        """Pick the backend for ``model``. Raises a 404 ``model_not_found`` for unknown models.

        Configured routes win over the local engine, so a config file can move a local model name
        onto a node pool.
        """
        route = self.routes.get(model)
        if route is not None:
            if len(route.backends) == 1:
                return route.backends[0]
            key = routing_key(namespace, prompt_route_bytes(body), self.prefix_bytes)
            return choose(key, route.backends, self.load_factor)
        backend = self.local_backend(local)
        if backend is not None:
            for card in local.models():
                if card.id == model:
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

    def failover(self, model: str, failed: Backend) -> Backend | None:
        """Mark ``failed`` down and return the least-loaded other node of ``model``'s pool, if any."""
        failed.down_until = time.monotonic() + DOWN_S
        route = self.routes.get(model)
        others = [b for b in (route.backends if route else []) if b is not failed and b.up]
        return min(others, key=lambda b: b.inflight) if others else None

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
