"""``GET /health`` (liveness of the app and its engine) and ``GET /metrics`` (Prometheus text).

``/metrics`` carries every tenant's requests, tokens, cost and latency, so it is not public by
default: a scrape authenticates with ``Authorization: Bearer <metrics token>`` (the token is read
from the environment variable ``--metrics-token-env`` names) or with an admin tenant's API key. A
tenant key gets a 403, no key a 401. ``metrics_public = true`` in ``[server]`` (or
``--metrics-public``) opens it, for a listener only Prometheus can reach.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.deps import EngineDep, SettingsDep, TenancyDep, bearer_key
from gateway.errors import OpenAIError
from gateway.ports import AuthenticationError, TenancyPort

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health(engine: EngineDep) -> Any:
    ok = True if engine is None else await engine.health()
    return JSONResponse({"status": "ok" if ok else "unhealthy", "engine": engine is not None},
                        status_code=200 if ok else 503)


def _authorize_scrape(tenancy: TenancyPort, token: str | None, key: str | None) -> None:
    """A metrics token or an admin key; anything else is refused in the OpenAI error shape."""
    if key is None:
        raise OpenAIError(401, "/metrics needs Authorization: Bearer <metrics token or admin API key>.",
                          code="invalid_api_key", type="authentication_error")
    if token and hmac.compare_digest(key.encode(), token.encode()):
        return
    try:
        ctx = tenancy.authenticate(key)
    except AuthenticationError:
        raise OpenAIError(401, "Incorrect metrics token or API key.", code="invalid_api_key",
                          type="authentication_error") from None
    if not ctx.is_admin:
        raise OpenAIError(403, "/metrics shows every tenant's numbers: use the metrics token or an admin key.",
                          code="permission_denied")


@router.get("/metrics")
async def metrics(request: Request, settings: SettingsDep, tenancy: TenancyDep,
                  authorization: Annotated[str | None, Header()] = None) -> Response:
    if not settings.metrics_public:
        _authorize_scrape(tenancy, settings.metrics_token, bearer_key(authorization))
    # One registry holds the engine's collectors and the gateway's (create_app hands it to the engine).
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
