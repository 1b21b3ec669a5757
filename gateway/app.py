"""The app factory: ``create_app(settings) -> FastAPI``. No import-time globals.

Everything a request needs hangs off ``app.state`` (settings, engine, tenancy, router, metrics
registry) and is reached through ``gateway.deps``. The lifespan builds what was not injected —
the local engine from ``settings.model_dir``, tenancy from ``settings.home``, clients for the
configured routes — and closes all of it on shutdown (flushing the usage ledger).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.protocol import EngineClient
from gateway.anthropic_api import error_body as anthropic_error_body
from gateway.errors import OpenAIError, install_error_handlers, render
from gateway.metrics import GatewayMetrics, LiveStats
from gateway.miss_tracker import MissTracker
from gateway.ports import TenancyError, TenancyPort, open_tenancy, tenancy_error
from gateway.remote import RemoteEngineClient
from gateway.routes import cache, completions, dashboard, internal, messages, models, ops, responses, usage
from gateway.routing import Backend, Route, Router
from gateway.settings import GatewaySettings
from gateway.tenant_threads import TenantThreads
from gateway.timeseries import TimeSeries
from gateway.upstream import DirectOpenAIClient, ProviderClient

log = logging.getLogger("prefixgate.gateway")


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
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_router(settings: GatewaySettings) -> Router:
    routes = []
    for rc in settings.routes:
        if rc.provider:
            client_cls = DirectOpenAIClient if rc.transport == "direct" else ProviderClient
            client = client_cls(
                rc.provider, api_base=rc.api_base, api_key=rc.api_key, cache_salt=rc.sends_cache_salt,
                tenant_prefix=rc.tenant_prefix, prompt_cache_key=rc.sends_prompt_cache_key,
                extra_body=rc.extra_body, max_model_len=rc.max_model_len, model_id=rc.model,
            )
            backends = [Backend(f"{rc.transport}:{rc.provider}", "provider", client, rc.provider)]
        else:
            backends = [Backend(f"node:{url}", "node", RemoteEngineClient(url, rc.node_token), "")
                        for url in rc.nodes]
        routes.append(Route(rc.model, backends, max_model_len=rc.max_model_len))
    return Router(routes, load_factor=settings.load_factor, prefix_bytes=settings.route_prefix_bytes)


def _build_local_engine(settings: GatewaySettings, registry: CollectorRegistry) -> EngineClient | None:
    if settings.model_dir is None:
        return None
    from engine.config import EngineConfig
    from engine.launch import build_engine

    config = EngineConfig(
        model_dir=settings.model_dir, device=settings.device, num_kv_blocks=settings.kv_blocks,
        dram_bytes=settings.dram_bytes, nvme_dir=settings.nvme_dir, nvme_bytes=settings.nvme_bytes,
        enable_prefix_caching=settings.prefix_caching,
        model_id=settings.model if settings.model and settings.model != str(settings.model_dir) else None,
    )
    return build_engine(config, registry=registry)


async def _call_optional(obj: Any, *names: str) -> None:
    """Call the first lifecycle method ``obj`` has (engines differ: start/stop/aclose/shutdown)."""
    for name in names:
        fn = getattr(obj, name, None)
        if callable(fn):
            result = fn()
            if inspect.isawaitable(result):
                await result
            return


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
        if app.state.engine is None:
            owned_engine = app.state.engine = _build_local_engine(settings, registry)
            if owned_engine is not None:
                await _call_optional(owned_engine, "start")
        if app.state.tenancy is None and settings.home is not None:
            owned_tenancy = app.state.tenancy = open_tenancy(settings.home, auth_cache_ttl_s=settings.auth_cache_ttl_s)
        for client in app.state.router.all_clients():
            if isinstance(client, RemoteEngineClient):
                try:
                    await client.refresh_models()
                except Exception as exc:  # noqa: BLE001 - a node may start later; routing still works
                    log.warning("engine node %s: cannot list models yet: %r", client.base_url, exc)
        sampler = asyncio.create_task(_sample_forever(app.state.timeseries))
        try:
            yield
        finally:
            sampler.cancel()
            for client in app.state.router.all_clients():  # nodes' and direct upstreams' HTTP pools
                await _call_optional(client, "aclose")
            if owned_engine is not None:
                await _call_optional(owned_engine, "aclose", "shutdown", "stop", "close")
            tenancy_now = app.state.tenancy
            if tenancy_now is not None:
                await _call_optional(tenancy_now, "flush")
            if owned_tenancy is not None:
                await _call_optional(owned_tenancy, "close")

    app = FastAPI(title="PrefixGate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.engine = engine
    app.state.tenancy = tenancy
    app.state.registry = registry
    app.state.metrics = GatewayMetrics(registry)
    app.state.live_stats = LiveStats()
    app.state.timeseries = TimeSeries(registry, app.state.live_stats)  # the dashboard's charts
    app.state.miss_tracker = MissTracker()  # cache-miss explanations (bounded memory, per tenant)
    app.state.router = build_router(settings)
    app.state.tenant_threads = TenantThreads(
        workers=settings.worker_threads, per_tenant=min(settings.worker_threads_per_tenant, settings.worker_threads))
    install_error_handlers(app, on_invalid_body=completions.record_invalid_body)

    app.state.error_shapes = {"/v1/messages": anthropic_error_body}  # Anthropic's SDK reads its own shape

    @app.exception_handler(TenancyError)
    async def _tenancy(request: Any, exc: TenancyError) -> Any:
        return render(request, tenancy_error(exc))

    for module in (completions, responses, messages, cache, models, usage, ops, dashboard, internal):
        app.include_router(module.router)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    return app
