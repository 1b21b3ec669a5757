"""The app factory: ``create_app(settings) -> FastAPI``. No import-time globals.

Everything a request needs hangs off ``app.state`` (settings, engine, tenancy, router, metrics
registry) and is reached through ``gateway.deps``. The lifespan builds what was not injected —
the local engine from ``settings.model_dir``, tenancy from ``settings.home``, clients for the
configured routes — and closes all of it on shutdown (flushing the usage ledger), after the
requests in flight have ended and written their ledger rows (gateway/shutdown.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.protocol import EngineClient, OwnedEngine
from gateway.anthropic_api import error_body as anthropic_error_body
from gateway.deps import bearer_key
from gateway.disagg_client import DisaggEngineClient, DisaggMetrics, SplitPolicy
from gateway.errors import OpenAIError, install_error_handlers, render
from gateway.fleet_index import FleetIndex
from gateway.kv_event_subscriber import EventSource, KVEventSubscriber
from gateway.metrics import GatewayMetrics, LiveStats
from gateway.miss_tracker import MissTracker
from gateway.node_health import NodeCollector, probe_forever, probe_once
from gateway.ports import AsyncCloseable, LedgerFlush, TenancyError, TenancyPort, open_tenancy, tenancy_error
from gateway.query_credentials import QueryCredentialRefusal
from gateway.remote import NodeTimeouts, RemoteEngineClient
from gateway.routes import (
    cache,
    chat_store,
    completions,
    dashboard,
    disagg,
    messages,
    models,
    ops,
    responses,
    tokenize,
    usage,
)
from gateway.routes.completions_asgi import CompletionRoutes, replaying
from gateway.routes.internal import NodeApiMiddleware, NodeDrain, install_drain_signal
from gateway.routes.ops import FleetCollector, LedgerCollector
from gateway.routing import Backend, BackendKind, OutlierPolicy, Route, Router
from gateway.routing_policy import RoutingPolicy
from gateway.settings import GatewaySettings
from gateway.shutdown import STOP_WINDOW_S, InFlight, InFlightMiddleware
from gateway.startup_heap import freeze_startup_heap, thaw_startup_heap
from gateway.tenant_threads import TenantThreads
from gateway.timeseries import TimeSeries
from gateway.upstream import DirectOpenAIClient, ProviderClient

log = logging.getLogger("prefixgate.gateway")

# Routes whose refused bodies count against the rate limit (the ones that do the costly work).
# Bodies refused by the schema here still take a rate-limit place (the doors run as chat requests).
_CHARGED_PATHS = frozenset(completions.KIND_OF_PATH)


class BodySizeLimit:
    """Refuse request bodies over ``limit`` bytes with a 413, before the app buffers them.

    Checks Content-Length up front; a body without one (chunked) is read here up to ``limit``
    and then replayed to the app. Raising from inside the app's ``receive`` instead would be
    caught by FastAPI's body parser and reported as a 400 "error parsing the body"
    (tests/security/test_bad_input.py::test_huge_body_is_a_413_declared_and_streamed).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"Request body too large: the limit is {self.limit} bytes.",
                           code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.limit:
                await self._too_large().response()(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server stops at Content-Length bytes
            return
        # no (valid) Content-Length: buffer at most `limit` bytes, then replay them as one message
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                await self._too_large().response()(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self.app(scope, replaying(b"".join(chunks), receive), send)


def build_router(settings: GatewaySettings, registry: CollectorRegistry | None = None) -> Router:
    routes = []
    sources: list[EventSource] = []  # the nodes' KV event streams (routing_policy = kv_aware)
    pd_metrics = None  # one set for every split route (docs/disaggregation.md)
    for rc in settings.routes:
        if rc.provider:
            client_cls = DirectOpenAIClient if rc.transport == "direct" else ProviderClient
            client = client_cls(
                rc.provider, api_base=rc.api_base, api_key=rc.api_key, cache_salt=rc.sends_cache_salt,
                tenant_prefix=rc.tenant_prefix, prompt_cache_key=rc.sends_prompt_cache_key,
                tenant_api_keys=rc.tenant_api_keys, shared_api_key=rc.shared_api_key,
                extra_body=rc.extra_body, max_model_len=rc.max_model_len, model_id=rc.model,
                keyless=rc.transport == "litellm" and rc.self_hosted and not rc.api_key,
            )
            backends = [Backend(f"{rc.transport}:{rc.provider}", BackendKind.PROVIDER, client, rc.provider)]
        elif rc.prefill_nodes:
            pd_metrics = pd_metrics or DisaggMetrics(registry if registry is not None else CollectorRegistry())
            policy = SplitPolicy(min_split_tokens=rc.split_min_tokens, max_prefill_queue=rc.max_prefill_queue,
                                 split_when_decode_idle=rc.split_when_decode_idle)
            backends = [Backend(f"node:{name}", BackendKind.NODE, DisaggEngineClient(url, rc.prefill_nodes, rc.node_token,
                                                                           policy=policy, metrics=pd_metrics), "")
                        for name, url in zip(rc.names_of_nodes, rc.nodes, strict=True)]
        else:
            tokenizer = None
            if rc.tokenizer:  # one per pool, shared by its clients (RouteConfig checked the directory)
                from engine.prompt_tokenizer import PromptTokenizer

                tokenizer = PromptTokenizer.from_dir(rc.tokenizer)
            timeouts = NodeTimeouts(connect=settings.node_connect_timeout_s, read=settings.node_read_timeout_s)
            backends = [Backend(f"node:{name}", BackendKind.NODE,
                                RemoteEngineClient(url, rc.node_token, timeouts=timeouts, tokenizer=tokenizer),
                                "", tokenizer_here=tokenizer is not None)
                        for name, url in zip(rc.names_of_nodes, rc.nodes, strict=True)]
        routes.append(Route(rc.model, backends, max_model_len=rc.max_model_len, extra={"price": rc.price}))
        if rc.kv_events:  # RouteConfig checked: one endpoint per node
            sources += [EventSource(b.label, ep) for b, ep in zip(backends, rc.kv_events, strict=True)]
    index = FleetIndex(settings.fleet_index_max_blocks, settings.fleet_index_ttl_s)
    return Router(routes, policy=RoutingPolicy(settings.routing_policy), load_factor=settings.load_factor,
                  epsilon=settings.route_epsilon, prefix_bytes=settings.route_prefix_bytes,
                  prefix_tokens=settings.route_prefix_tokens, block_size=settings.route_block_size,
                  index=index, events=KVEventSubscriber(index, sources) if sources else None,
                  outliers=OutlierPolicy(settings.node_cooldown_failures, settings.node_cooldown_s))


def _build_local_engine(settings: GatewaySettings, registry: CollectorRegistry) -> OwnedEngine | None:
    if settings.model_dir is None:
        return None
    from engine.launch import build_engine

    config = settings.engine_config()
    disagg = None
    if settings.role != "both":  # prefill/decode split (docs/disaggregation.md)
        from engine.disagg.api import DisaggConfig, Role

        disagg = DisaggConfig(Role(settings.role), settings.node_token or "", kv_host=settings.host,
                              kv_port=settings.kv_port, kv_advertise_host=settings.kv_advertise_host or "")
    return build_engine(config, registry=registry, disagg=disagg)


async def _sample_forever(series: TimeSeries) -> None:
    """Feed the dashboard's time series from the /metrics registry every step, in a worker thread.

    One sample collects the registry without formatting it: 0.38x the cost of one /metrics scrape
    (median 11 vs 29 ms with 20 tenants on the loaded 2-core build machine;
    ``benchmarks/dashboard_sampler.py``)."""
    while True:
        try:
            await anyio.to_thread.run_sync(series.sample)
        except Exception:  # noqa: BLE001 - a chart must never take the gateway down
            log.exception("dashboard sampler failed")
        await asyncio.sleep(series.step_s)


async def _finish_requests(inflight: InFlight) -> None:
    """Stop what is still in flight and wait (bounded) for those requests' ledger rows."""
    inflight.begin_draining()
    stopped = inflight.stop_all()
    if stopped:
        log.warning("shutdown: stopping %d request(s) still in flight", stopped)
    if not await inflight.wait_idle(STOP_WINDOW_S):
        log.error("shutdown: %d request(s) did not end within %.0f s; their ledger rows may be missing",
                  len(inflight), STOP_WINDOW_S)


def create_app(
    settings: GatewaySettings,
    *,
    engine: EngineClient | None = None,
    tenancy: TenancyPort | None = None,
) -> FastAPI:
    """Build the gateway. ``engine``/``tenancy`` may be injected (tests, embedding); otherwise the
    lifespan builds them from ``settings`` and owns their shutdown."""
    registry = CollectorRegistry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned_engine = owned_tenancy = None
        app.state.inflight.reopen()
        if app.state.engine is None:
            owned_engine = app.state.engine = _build_local_engine(settings, registry)  # running once built
        if app.state.tenancy is None and settings.home is not None:
            owned_tenancy = app.state.tenancy = open_tenancy(
                settings.home, auth_cache_ttl_s=settings.auth_cache_ttl_s,
                database_url=settings.database_url, redis_url=settings.redis_url,
                store_retention_days=settings.store_retention_days)
        # The first probe round: model lists, and one log line per node that is not fit yet (down,
        # or refusing the node token); a node may start later, routing still works.
        await probe_once(app.state.router, settings.node_probe_interval_s)
        app.state.router.start_events()
        sampler = asyncio.create_task(_sample_forever(app.state.timeseries))
        prober = asyncio.create_task(probe_forever(app.state.router, settings.node_probe_interval_s))
        install_drain_signal(app.state)
        if owned_engine is not None:  # a serving process with its own engine (not an injected one: tests)
            freeze_startup_heap()
        try:
            yield
        finally:
            # Requests still in flight (a server that did not drain, or uvicorn's last-resort cancel)
            # must write their ledger rows before the engine and the ledger close below.
            await _finish_requests(app.state.inflight)
            if owned_engine is not None:
                thaw_startup_heap()
            sampler.cancel()
            prober.cancel()
            app.state.router.stop_events()
            for client in app.state.router.all_clients():  # nodes' and direct upstreams' HTTP pools
                if isinstance(client, AsyncCloseable):
                    await client.aclose()
            if owned_engine is not None:
                owned_engine.shutdown()
            tenancy_now = app.state.tenancy
            if isinstance(tenancy_now, LedgerFlush):
                tenancy_now.flush()
            if owned_tenancy is not None:
                owned_tenancy.close()

    app = FastAPI(title="PrefixGate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.started_at = int(time.time())  # /v1/models "created"
    app.state.engine = engine
    app.state.tenancy = tenancy
    app.state.registry = registry
    app.state.metrics = GatewayMetrics(registry)
    registry.register(FleetCollector(lambda: app.state.tenancy))  # prefixgate_redis_up and friends
    registry.register(LedgerCollector(lambda: app.state.tenancy))  # rows committed / quarantined / lost
    app.state.live_stats = LiveStats()
    app.state.timeseries = TimeSeries(registry, app.state.live_stats)  # the dashboard's charts
    # Cache-miss explanations (bounded memory, per tenant), on the local engine's block grid.
    app.state.miss_tracker = MissTracker(block_size=settings.block_size)
    app.state.router = build_router(settings, registry)
    registry.register(NodeCollector(app.state.router))  # node up/down, failovers, cool-downs, kv_aware picks
    app.state.tenant_threads = TenantThreads(
        workers=settings.worker_threads, per_tenant=min(settings.worker_threads_per_tenant, settings.worker_threads),
        queued_per_tenant=settings.worker_queue_per_tenant)

    def _on_invalid_body(request: Request, error: OpenAIError) -> None:
        """A body the schema refuses still takes a place in its tenant's rate limit (issue 16.9),
        and gets its ledger row and outcome count like any refused request (issue 21)."""
        tenancy_now = app.state.tenancy
        key = bearer_key(request.headers.get("authorization"))
        if request.url.path.startswith("/v1/messages"):  # Anthropic's SDK sends x-api-key
            key = (request.headers.get("x-api-key") or "").strip() or key
        if tenancy_now is not None and key is not None and request.url.path in _CHARGED_PATHS:
            with contextlib.suppress(TenancyError):  # unknown key, or already over its limit
                tenancy_now.admit(tenancy_now.authenticate(key), estimated_tokens=0)
        completions.record_invalid_body(request, error)

    install_error_handlers(app, on_invalid_body=_on_invalid_body)
    app.state.error_shapes = {"/v1/messages": anthropic_error_body}  # Anthropic's SDK reads its own shape

    @app.exception_handler(TenancyError)
    async def _tenancy(request: Request, exc: TenancyError) -> JSONResponse:
        return render(request, tenancy_error(exc))

    for module in (completions, chat_store, responses, messages, cache, models, usage, ops, dashboard, disagg,
                   tokenize):
        app.include_router(module.router)
    app.state.node_drain = NodeDrain()
    # The completion routes' fast path, inside the node API and the body limit (docs/gateway.md).
    app.add_middleware(CompletionRoutes, state=app.state, overrides=app.dependency_overrides)
    app.add_middleware(NodeApiMiddleware, state=app.state)  # node calls: the OpenAI API, node token (docs/nodes.md)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    app.add_middleware(QueryCredentialRefusal)  # a key in the URL: 401 before anything reads the request
    # Outermost: every request counts as in flight until its handler (and its ledger row) is done.
    app.state.inflight = InFlight()
    app.add_middleware(InFlightMiddleware, inflight=app.state.inflight)
    return app
