"""``GET /health`` (liveness of the app and its engine) and ``GET /metrics`` (Prometheus text).

``/health`` also says which store the tenancy state is in and, with ``--redis-url``, whether Redis
answers: ``{"status": "degraded", "limits": "local", ...}`` (still HTTP 200: the gateway serves, with
per-process limits) while it does not, ``"limits": "redis"`` again once it does. With engine nodes it
lists them, and says ``"degraded"`` (HTTP 200: the gateway's other routes serve) with the routes in
``"routes_down"`` while every node of a route is out of rotation.

``/metrics`` carries every tenant's requests, tokens, cost and latency, so it is not public by
default: a scrape authenticates with ``Authorization: Bearer <metrics token>`` (the token is read
from the environment variable ``--metrics-token-env`` names) or with an admin tenant's API key. A
tenant key gets a 403, no key a 401. ``metrics_public = true`` in ``[server]`` (or
``--metrics-public``) opens it, for a listener only Prometheus can reach.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.deps import EngineDep, SettingsDep, TenancyDep, bearer_key
from gateway.errors import OpenAIError
from gateway.metrics import GatewayMetrics
from gateway.node_health import node_status, routes_without_nodes
from gateway.ports import AuthenticationError, FleetStatusSource, LedgerStatsSource, TenancyPort

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health(request: Request, engine: EngineDep) -> Any:
    ok = True if engine is None else await engine.health()
    body: dict[str, Any] = {"status": "ok" if ok else "unhealthy", "engine": engine is not None}
    tenancy = request.app.state.tenancy
    if isinstance(tenancy, FleetStatusSource):
        fleet = tenancy.fleet_status()
        body["database"] = fleet.database
        shared = fleet.shared_limits
        body["limits"] = "local" if shared is None or not shared.connected else "redis"
        if shared is not None:
            body["redis"] = {"connected": shared.connected, "fallback_admissions": shared.fallbacks,
                             "last_error": shared.last_error}
            if ok and fleet.degraded:
                body["status"] = "degraded"
    nodes = node_status(request.app.state.router)
    if nodes:  # engine nodes behind this gateway: in rotation or not, and whether they report cache hits
        body["nodes"] = nodes
        down = routes_without_nodes(request.app.state.router)
        if down:
            body["routes_down"] = down
            if ok:
                body["status"] = "degraded"
    return JSONResponse(body, status_code=200 if ok else 503)


class FleetCollector:
    """Prometheus view of ``fleet_status``: ``prefixgate_redis_up`` (1/0) and the admissions decided by
    local limits while Redis was away. Nothing is exported without ``--redis-url``."""

    def __init__(self, tenancy: Callable[[], object]) -> None:
        self._tenancy = tenancy  # read at scrape time: the app's tenancy is opened in its lifespan

    def collect(self) -> Iterator[Metric]:
        tenancy = self._tenancy()
        if not isinstance(tenancy, FleetStatusSource):
            return
        shared = tenancy.fleet_status().shared_limits
        if shared is None:
            return
        yield GaugeMetricFamily("prefixgate_redis_up", "1 while Redis (fleet-wide limits) answers, else 0",
                                value=1.0 if shared.connected else 0.0)
        yield CounterMetricFamily("prefixgate_redis_fallback_admissions",
                                  "Admissions decided by this gateway's local limits because Redis did not answer",
                                  value=float(shared.fallbacks))


class LedgerCollector:
    """Prometheus view of the usage ledger's writer (issue 16.1: a row the database refuses is
    quarantined and counted, never a stop for the rows behind it): rows by outcome, retries of
    transient errors, rows still queued. An alert on ``quarantined``/``lost`` rising is the operator's
    signal that client data or the database needs a look."""

    def __init__(self, tenancy: Callable[[], object]) -> None:
        self._tenancy = tenancy  # read at scrape time: the app's tenancy is opened in its lifespan

    def collect(self) -> Iterator[Metric]:
        tenancy = self._tenancy()
        if not isinstance(tenancy, LedgerStatsSource):
            return
        stats = tenancy.ledger_stats()
        rows = CounterMetricFamily(
            "prefixgate_ledger_rows",
            "Usage rows by what became of them: committed; quarantined (refused by the database, kept in "
            "usage_quarantine); spilled (to the quarantine file while the database was unavailable); "
            "replayed (from that file); lost (kept nowhere, logged)",
            labels=["outcome"])
        for outcome, value in (("committed", stats.committed), ("quarantined", stats.quarantined),
                               ("spilled", stats.spilled), ("replayed", stats.replayed), ("lost", stats.lost)):
            rows.add_metric([outcome], float(value))
        yield rows
        yield CounterMetricFamily("prefixgate_ledger_retries", "Transient database errors the ledger retried",
                                  value=float(stats.retries))
        yield GaugeMetricFamily("prefixgate_ledger_queued_rows", "Usage rows waiting for the ledger writer",
                                value=float(stats.queued))


def _authorize_scrape(tenancy: TenancyPort, token: str | None, key: str | None, metrics: GatewayMetrics) -> None:
    """A metrics token or an admin key; anything else is refused in the OpenAI error shape. A 401
    is counted in ``prefixgate_gateway_unauthenticated_requests_total`` as on every route: a
    Prometheus whose token is wrong shows on the panel's 401 series."""
    if key is None:
        metrics.unauthenticated.inc()
        raise OpenAIError(401, "/metrics needs Authorization: Bearer <metrics token or admin API key>.",
                          code="invalid_api_key", type="authentication_error")
    if token and hmac.compare_digest(key.encode(), token.encode()):
        return
    try:
        ctx = tenancy.authenticate(key)
    except AuthenticationError:
        metrics.unauthenticated.inc()
        raise OpenAIError(401, "Incorrect metrics token or API key.", code="invalid_api_key",
                          type="authentication_error") from None
    if not ctx.is_admin:
        raise OpenAIError(403, "/metrics shows every tenant's numbers: use the metrics token or an admin key.",
                          code="permission_denied")


@router.get("/metrics")
async def metrics(request: Request, settings: SettingsDep, tenancy: TenancyDep,
                  authorization: Annotated[str | None, Header()] = None) -> Response:
    if not settings.metrics_public:
        _authorize_scrape(tenancy, settings.metrics_token, bearer_key(authorization), request.app.state.metrics)
    # One registry holds the engine's collectors and the gateway's (create_app hands it to the engine).
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
