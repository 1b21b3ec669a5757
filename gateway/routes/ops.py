"""``GET /health`` (liveness of the app and its engine) and ``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.deps import EngineDep

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health(engine: EngineDep) -> Any:
    ok = True if engine is None else await engine.health()
    return JSONResponse({"status": "ok" if ok else "unhealthy", "engine": engine is not None},
                        status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # One registry holds the engine's collectors and the gateway's (create_app hands it to the engine).
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
