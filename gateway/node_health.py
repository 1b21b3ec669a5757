"""Health probes of engine nodes: which nodes get new requests, and what ``/health`` says of them.

Every ``interval_s`` each node's ``GET /health`` is asked (in parallel, 2 s timeout). A node that
does not answer 200 — down, unhealthy, or draining — is skipped by the router until a probe says
it is back; its requests in flight are not touched (a draining node finishes them). Between
probes, a node that refuses a connection is skipped at once (``Router.failover``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.disagg_client import DisaggEngineClient
from gateway.remote import RemoteEngineClient
from gateway.routing import Backend, Router

log = logging.getLogger("prefixgate.gateway")


def node_backends(router: Router) -> list[tuple[str, Backend, RemoteEngineClient]]:
    """(route model, backend, client) of every engine-node backend."""
    return [(route.model, b, b.client) for route in router.routes.values() for b in route.backends
            if isinstance(b.client, RemoteEngineClient)]


async def probe_once(router: Router, interval_s: float) -> None:
    nodes = node_backends(router)
    results = await asyncio.gather(*(client.probe() for _, _, client in nodes), return_exceptions=True)
    for (_, backend, client), ok in zip(nodes, results, strict=True):
        if ok is True:
            backend.down_until = 0.0
        else:
            # Out of rotation until the probe after next says otherwise.
            router.mark_down(backend, 2 * interval_s)  # its fleet-index entries go too
            if isinstance(ok, BaseException):
                log.warning("engine node %s: probe failed: %r", client.base_url, ok)


async def probe_forever(router: Router, interval_s: float) -> None:
    while True:
        try:
            await probe_once(router, interval_s)
        except Exception:  # noqa: BLE001 - a probe must never take the gateway down
            log.exception("engine node probe failed")
        await asyncio.sleep(interval_s)


def node_status(router: Router) -> list[dict[str, Any]]:
    """One entry per node for ``/health``: where it is, whether it gets work, and whether its usage
    reports cached tokens (``"unreported"``: vLLM without ``--enable-prompt-tokens-details``)."""
    out = []
    for model, backend, client in node_backends(router):
        s = client.state
        cached = {None: "unknown", True: "reported", False: "unreported"}[s.cached_tokens_reported]
        entry = {"route": model, "url": client.base_url, "healthy": s.healthy and backend.up,
                 "draining": s.draining, "cached_tokens": cached, "last_error": s.last_error}
        if isinstance(client, DisaggEngineClient):  # a decode node: the prefill nodes that feed it
            entry["prefill_nodes"] = client.prefill_status()
        out.append(entry)
    return out
