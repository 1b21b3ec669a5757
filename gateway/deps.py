"""FastAPI dependencies: the app's parts read from ``app.state``, as ``Annotated`` aliases.

All are ``async def``: FastAPI runs a plain ``def`` dependency in a worker thread, which cost
~1.5 ms per request here (7 dependencies) for lookups that never block. Tenancy's
``authenticate`` hits SQLite only on an auth-cache miss.

Tests replace any of them with ``app.dependency_overrides[get_engine] = lambda: fake``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from engine.protocol import EngineClient
from gateway.errors import OpenAIError
from gateway.metrics import GatewayMetrics, LiveStats
from gateway.ports import AuthenticationError, TenancyPort, TenantCtx
from gateway.routing import Router
from gateway.settings import GatewaySettings


async def get_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


async def get_engine(request: Request) -> EngineClient | None:
    """The in-process engine, or None for a gateway-only process."""
    return getattr(request.app.state, "engine", None)


async def get_tenancy(request: Request) -> TenancyPort:
    tenancy = getattr(request.app.state, "tenancy", None)
    if tenancy is None:
        raise OpenAIError(503, "tenancy is not configured on this server (start it with --home)", code="no_tenancy")
    return tenancy


async def get_router(request: Request) -> Router:
    return request.app.state.router


async def get_metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics


async def get_live_stats(request: Request) -> LiveStats:
    return request.app.state.live_stats


SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
EngineDep = Annotated[EngineClient | None, Depends(get_engine)]
TenancyDep = Annotated[TenancyPort, Depends(get_tenancy)]
RouterDep = Annotated[Router, Depends(get_router)]
MetricsDep = Annotated[GatewayMetrics, Depends(get_metrics)]
LiveStatsDep = Annotated[LiveStats, Depends(get_live_stats)]


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def authenticate_bearer(tenancy: TenancyPort, authorization: str | None, metrics: GatewayMetrics) -> TenantCtx:
    """``Authorization: Bearer <key>`` -> the tenant's context. Missing or bad key -> 401 in the OpenAI
    shape (counted in ``prefixgate_unauthenticated_total``). Shared by the FastAPI dependency below
    and the raw-ASGI completion routes (``gateway.routes.completions_asgi``)."""
    key = bearer_key(authorization)
    try:
        return tenancy.authenticate(key)
    except AuthenticationError as exc:
        metrics.unauthenticated.inc()
        if key is None:
            message = (
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        else:
            message = str(exc) or "Incorrect API key provided."
        raise OpenAIError(401, message, code="invalid_api_key", type="authentication_error") from None


async def get_tenant(request: Request, tenancy: TenancyDep,
                     authorization: Annotated[str | None, Header()] = None) -> TenantCtx:
    """Bearer key -> ``TenantContext`` (``authenticate_bearer``).

    The context is also left on ``request.state.tenant``: a body that then fails validation is
    refused after authentication, and the error handler counts it for this tenant.
    """
    ctx = authenticate_bearer(tenancy, authorization, request.app.state.metrics)
    request.state.tenant = ctx
    return ctx


TenantDep = Annotated[TenantCtx, Depends(get_tenant)]
