"""Health of engine nodes: which nodes get new requests, what ``/health`` and ``/metrics`` say of them.

Active: every ``interval_s`` each node's ``GET /health`` and its authenticated ``GET /v1/models``
are asked (in parallel, 2 s timeout). A node that does not answer 200 (down, unhealthy, draining,
or refusing the gateway's node token) is skipped by the router until a probe says it is back; its
requests in flight are not touched (a draining node finishes them). Between probes, a node that
refuses a connection is skipped at once (``Router.record_failure``).

Passive: the router counts each node's failed requests (``Router.record_failure``): enough in a
row put it in a cool-down that a healthy probe does not end (its ``/health`` may say 200 while its
completions fail).

Each change of a node between serving and not serving is logged once, by the probe round that sees
it (so at most ``interval_s`` late), with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.disagg_client import DisaggEngineClient
from gateway.remote import RemoteEngineClient
from gateway.routing import Backend, Router

log = logging.getLogger("prefixgate.gateway")


def node_backends(router: Router) -> list[tuple[str, Backend, RemoteEngineClient]]:
    """(route model, backend, client) of every engine-node backend."""
    return [(route.model, b, b.client) for route in router.routes.values() for b in route.backends
            if isinstance(b.client, RemoteEngineClient)]


def serving(backend: Backend, client: RemoteEngineClient) -> bool:
    """Whether the router sends the node new requests: its last probe was fit, and it is neither
    marked down nor cooling down."""
    return client.state.healthy and backend.up


def _why_not_serving(backend: Backend, client: RemoteEngineClient) -> str:
    if backend.cooldown_left_s > 0:
        return (f"cooling down for {backend.cooldown_left_s:.0f} s after {backend.passive.consecutive_failures} "
                f"failed requests in a row (last: {backend.passive.last_failure})")
    return client.state.last_error or backend.passive.last_failure or "marked down"


def announce_changes(router: Router) -> None:
    """Log each node whose serving state changed since the last announcement: one line each way."""
    for model, backend, client in node_backends(router):
        now = serving(backend, client)
        if now == backend.announced_up:
            continue
        backend.announced_up = now
        if now:
            log.info("engine node %s (%s) of route %s is back in rotation", backend.name, client.base_url, model)
        else:
            log.warning("engine node %s (%s) of route %s is out of rotation: %s", backend.name, client.base_url,
                        model, _why_not_serving(backend, client))


async def probe_once(router: Router, interval_s: float) -> None:
    nodes = node_backends(router)
    results = await asyncio.gather(*(client.probe() for _, _, client in nodes), return_exceptions=True)
    for (_, backend, client), ok in zip(nodes, results, strict=True):
        if ok is True:
            backend.down_until = 0.0  # a cool-down (passive health) runs its course regardless
        else:
            # Out of rotation until the probe after next says otherwise.
            router.mark_down(backend, 2 * interval_s)  # its fleet-index entries go too
            if isinstance(ok, BaseException):
                client.state.healthy, client.state.last_error = False, f"probe failed: {ok!r}"
    announce_changes(router)


async def probe_forever(router: Router, interval_s: float) -> None:
    """Probe rounds every ``interval_s``, the first one after ``interval_s`` (the app's start-up ran one)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await probe_once(router, interval_s)
        except Exception:  # noqa: BLE001 - a probe must never take the gateway down
            log.exception("engine node probe failed")


def node_status(router: Router) -> list[dict[str, Any]]:
    """One entry per node for ``/health``: its name and where it is, whether it gets work and why not,
    and whether its usage reports cached tokens (``"unreported"``: vLLM without
    ``--enable-prompt-tokens-details``)."""
    out = []
    for model, backend, client in node_backends(router):
        s = client.state
        cached = {None: "unknown", True: "reported", False: "unreported"}[s.cached_tokens_reported]
        entry = {"route": model, "name": backend.name, "url": client.base_url,
                 "healthy": serving(backend, client), "draining": s.draining, "cached_tokens": cached,
                 "last_error": s.last_error, "last_failure": backend.passive.last_failure,
                 "consecutive_failures": backend.passive.consecutive_failures,
                 "cooldown_s": round(backend.cooldown_left_s, 1)}
        if isinstance(client, DisaggEngineClient):  # a decode node: the prefill nodes that feed it
            entry["prefill_nodes"] = client.prefill_status()
        out.append(entry)
    return out


def routes_without_nodes(router: Router) -> list[str]:
    """Node routes none of whose nodes is serving (their requests are tried anyway, and fail)."""
    up: dict[str, bool] = {}
    for model, backend, client in node_backends(router):
        up[model] = up.get(model, False) or serving(backend, client)
    return [model for model, any_up in up.items() if not any_up]


class NodeCollector:
    """Prometheus view of the engine nodes, read at scrape time: up/down per node, failed requests
    and failovers by fault, cool-downs, and the router's picks (kv_aware: the prefix blocks the
    fleet index expected on the chosen nodes)."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        nodes = node_backends(router)
        if nodes:
            up = GaugeMetricFamily("prefixgate_gateway_node_up",
                                   "1 while the engine node gets new requests (probe fit, not down, not cooling down)",
                                   labels=["route", "node"])
            for model, backend, client in nodes:
                up.add_metric([model, backend.label], 1.0 if serving(backend, client) else 0.0)
            yield up
        yield _counter("prefixgate_gateway_node_failures", "Requests an engine node failed, by fault (unreachable, "
                       "draining, auth, server_error, timeout)", ["route", "node", "fault"], router.failures)
        yield _counter("prefixgate_gateway_node_failovers", "Requests moved to another node before their first "
                       "token, by the node that failed and its fault", ["route", "node", "fault"], router.failovers)
        yield _counter("prefixgate_gateway_node_cooldowns", "Cool-downs started (consecutive failed requests)",
                       ["route", "node"], router.cooldowns)
        yield CounterMetricFamily("prefixgate_gateway_routed_requests",
                                  "Requests the router placed on a node of a pool", value=float(router.routed_requests))
        yield CounterMetricFamily("prefixgate_gateway_routed_prefix_blocks",
                                  "kv_aware: prompt-prefix KV blocks the fleet index said the chosen node held "
                                  "(over routed_requests: the expected cache hit per pick)",
                                  value=float(router.routed_prefix_blocks))


LabelValues = TypeVar("LabelValues", bound=tuple[str, ...])  # one str per label (Mapping's key is invariant)


def _counter(name: str, documentation: str, labels: list[str], counts: Mapping[LabelValues, int]) -> Metric:
    """A counter family with one sample per key of ``counts`` (the key is the label values)."""
    family = CounterMetricFamily(name, documentation, labels=labels)
    for values, n in counts.items():
        family.add_metric(list(values), float(n))
    return family
