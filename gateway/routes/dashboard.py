"""``GET /dashboard`` (a self-contained page, no CDN) and ``GET /dashboard/data`` (the JSON it polls).

The page reads an API key from its URL fragment (``/dashboard#key=sk-...``; a fragment never
leaves the browser) and sends it as a Bearer key; an admin key sees every tenant, any other key
only its own tenant. Numbers are since this process started (the ledger has the history).
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from gateway.deps import LiveStatsDep, TenantDep

router = APIRouter(tags=["dashboard"])
_STARTED = "started_at"


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    page = resources.files("gateway").joinpath("static/dashboard.html").read_text()
    return HTMLResponse(page, headers={"cache-control": "no-store"})


@router.get("/dashboard/data")
async def dashboard_data(ctx: TenantDep, live: LiveStatsDep) -> dict[str, Any]:
    only = None if getattr(ctx, "is_admin", False) else ctx.metrics_label
    tenants = live.snapshot(only=only)
    total_prompt = sum(t["prompt_tokens"] for t in tenants)
    total_cached = sum(t["cached_tokens"] for t in tenants)
    return {
        "generated_at": time.time(),
        "scope": "all" if only is None else "own",
        "totals": {
            "requests": sum(t["requests"] for t in tenants),
            "prompt_tokens": total_prompt,
            "cached_tokens": total_cached,
            "hit_rate": total_cached / total_prompt if total_prompt else 0.0,
            "saved_usd": sum(t["saved_usd"] for t in tenants),
            "cost_usd": sum(t["cost_usd"] for t in tenants),
        },
        "tenants": tenants,
    }
