"""``GET /dashboard`` (a self-contained page, no CDN), its vendored assets, and ``GET /dashboard/data``.

The page reads an API key from its URL fragment (``/dashboard#key=sk-...``; a fragment never
leaves the browser) and sends it as a Bearer key. An admin key sees every tenant and the
engine-wide charts; any other key sees only its own tenant's rows (filtered by tenant id, never by
the display label, which two tenants may share) and no engine-wide series.

``/dashboard/data?window=5m|1h|24h``::

    {"generated_at", "scope": "all"|"own", "window",
     "totals": {...}, "tenants": [LiveStats row],          # since this process started (= /metrics)
     "series": TimeSeries.series(window) | null,           # admin only
     "ledger": {"since", "totals", "models": [...], "breaks": [...]},   # the ledger, for the window
     "cache": {"most_computed": [...], "computed_prefixes": [{"tenant", "hash", "count", "error"}],
               "cache_seconds", "prefill_seconds_saved", "pays"},
     "isolation": [{"tenant", "share_scope", "spill_encrypted", "quotas", "kv_blocks_used",
                    "last_key_created_at"}]}

``kv_blocks_used`` = ``{"hbm", "dram", "nvme"}``: the blocks the tenant holds in each tier now. A
tenant key's own row asks the local engine for the blocks charged to its tenant key (the identity its
block quotas count), so another tenant whose name shares its first 32 characters never shows in it.
The admin view reads every tenant's from the engine's ``prefixgate_kv_tenant_blocks`` gauge by
metrics label: there two tenants sharing a label show the same, summed, figure.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CollectorRegistry

from engine.protocol import CacheInspector, EngineClient
from gateway.deps import EngineDep, LiveStatsDep, TenancyDep, TenantDep
from gateway.errors import OpenAIError, invalid_request
from gateway.metrics import LiveStats
from gateway.ports import Quotas, TenancyPort, TenantCtx, TenantDirectory, tenant_metrics_label
from gateway.timeseries import WINDOWS, TimeSeries, read_registry, tenant_blocks

router = APIRouter(tags=["dashboard"])

# The vendored charting library (uPlot 1.6.32, MIT, 51 KB minified; see static/vendor/uPlot.LICENSE).
_ASSETS = {
    "uPlot.iife.min.js": "application/javascript",
    "uPlot.min.css": "text/css",
    "dashboard.js": "application/javascript",
}


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    page = resources.files("gateway").joinpath("static/dashboard.html").read_text()
    return HTMLResponse(page, headers={"cache-control": "no-store"})


@router.get("/dashboard/assets/{name}")
async def dashboard_asset(name: str) -> Response:
    if name not in _ASSETS:
        raise OpenAIError(404, "Unknown URL.", code="not_found")
    folder = "static" if name == "dashboard.js" else "static/vendor"
    body = resources.files("gateway").joinpath(f"{folder}/{name}").read_bytes()
    return Response(body, media_type=_ASSETS[name], headers={"cache-control": "no-cache"})


def _per_million(usd: float | None, tokens: int) -> float | None:
    # usd None: an unpriced route's rows (tokens, no money)
    return usd * 1e6 / tokens if tokens and usd is not None else None


def _ledger_view(report: dict[str, Any]) -> dict[str, Any]:
    """What the panel shows of the ledger report: unit cost per model and the top break reasons."""
    models = []
    for r in report.get("rows", []):
        tokens = r["prompt_tokens"] + r["completion_tokens"]
        models.append({
            "tenant_id": r["tenant_id"], "tenant": r["tenant"], "model": r["model"], "requests": r["requests"],
            "errors": r["errors"], "tokens": tokens, "cost_usd": r["cost_usd"], "saved_usd": r["saved_usd"],
            "cost_per_1m_usd": _per_million(r["cost_usd"], tokens),
            "saved_per_1m_usd": _per_million(r["saved_usd"], tokens),
            "hit_rate": r["hit_rate"], "ttft_p95_s": r["ttft_p95_s"],
        })
    return {"totals": report.get("totals"), "models": models, "breaks": report.get("breaks", [])[:10]}


def _cache_pays(request: Request) -> dict[str, Any]:
    """The local engine's cache cost against the prefill its hits saved, from the /metrics registry.

    Saved prefill time = the local engine's hit tokens (``prefixgate_prompt_tokens_hit_total``) x
    its prefill seconds per computed token. Cached tokens a remote backend reported (a provider,
    an engine node) are not counted: they were not priced at this engine's prefill speed and this
    engine's cache did not pay for them. Grafana's "prefill saved" is the same formula per engine.
    """
    samples = read_registry(request.app.state.registry)

    def total(name: str) -> float:
        return sum(value for _, value in samples.get(name, ()))

    hit, cache_seconds = total("prefixgate_prompt_tokens_hit_total"), total("prefixgate_cache_manage_seconds_total")
    prefill_tokens, prefill_seconds = total("prefixgate_prefill_tokens_total"), total("prefixgate_prefill_seconds_total")
    per_token = prefill_seconds / prefill_tokens if prefill_tokens else None
    saved = hit * per_token if per_token is not None else None
    return {"cache_seconds": cache_seconds, "prefill_seconds_saved": saved,
            "pays": None if saved is None else saved > cache_seconds}


def _computed_prefixes(engine_stats: dict[str, Any], only_tenant: str | None, top: int = 10) -> list[dict[str, Any]]:
    """The engine's most recomputed prefixes (``stats()["computed_prefixes"]``: per tenant key, the
    tenant key in hex, its label and block-hash prefixes with their counts), most first; only the
    tenant whose key is ``only_tenant`` when given (never by label: two tenants may share one).

    Named by hash alone: the gateway knows a request's template family but the engine's hashes are
    of token blocks it never sees, so the two cannot be joined here (the family list is separate).
    """
    rows = [{"tenant": entry["tenant"], "hash": e["hash"], "count": e["count"], "error": e["error"]}
            for key, entry in (engine_stats.get("computed_prefixes") or {}).items()
            if only_tenant is None or key == only_tenant
            for e in entry["prefixes"]]
    rows.sort(key=lambda r: (-r["count"], r["tenant"], r["hash"]))
    return rows[:top]


def _isolation_row(name: str, share_scope: str, encrypted: bool | None, quotas: Quotas,
                   last_key: float | None, used: dict[str, int]) -> dict[str, Any]:
    return {
        "tenant": name, "share_scope": share_scope, "spill_encrypted": encrypted,
        "quotas": {"rpm": quotas.rpm, "tpm": quotas.tpm, "budget_usd": quotas.budget_usd,
                   "kv_blocks_hbm": quotas.kv_blocks_hbm, "kv_blocks_dram": quotas.kv_blocks_dram,
                   "kv_blocks_nvme": quotas.kv_blocks_nvme},
        "kv_blocks_used": {tier: used.get(tier, 0) for tier in ("hbm", "dram", "nvme")},
        "last_key_created_at": last_key,
    }


def _own_blocks(ctx: TenantCtx, engine: EngineClient | None) -> dict[str, int]:
    """The caller's blocks per tier, by its tenant key (never by its label, which another tenant
    may share); none without a local engine (a remote node's blocks are not this process's)."""
    return engine.tenant_blocks(ctx) if isinstance(engine, CacheInspector) else {}


def _isolation(ctx: TenantCtx, tenancy: TenancyPort, live: LiveStats, registry: CollectorRegistry,
               engine: EngineClient | None) -> list[dict[str, Any]]:
    """Share scope, spill encryption, quotas and the newest API key of each visible tenant.

    Encryption is a property of an authenticated context (its cipher): known for the caller and
    for every tenant that sent a request to this process; None (shown as "–") otherwise.
    """
    if not isinstance(tenancy, TenantDirectory):
        return []
    keys: dict[str, float] = {}
    for k in tenancy.list_keys(None if ctx.is_admin else ctx.name):
        if k.revoked_at is None:
            keys[k.tenant_id] = max(keys.get(k.tenant_id, 0.0), k.created_at)
    if not ctx.is_admin:
        return [_isolation_row(ctx.name, ctx.share_scope, ctx.cipher is not None, ctx.quotas, keys.get(ctx.tenant_id),
                               _own_blocks(ctx, engine))]
    used = tenant_blocks(registry)
    seen = {**live.spill_encrypted(), ctx.tenant_id: ctx.cipher is not None}
    return [_isolation_row(t.name, t.share_scope, seen.get(t.tenant_id), t.quotas, keys.get(t.tenant_id),
                           used.get(tenant_metrics_label(t.name), {}))
            for t in tenancy.list_tenants()]


@router.get("/dashboard/data")
async def dashboard_data(request: Request, ctx: TenantDep, live: LiveStatsDep, tenancy: TenancyDep,
                         engine: EngineDep, window: str = "5m") -> dict[str, Any]:
    if window not in WINDOWS:
        raise invalid_request(f"window must be one of {', '.join(WINDOWS)}, got {window!r}", param="window")
    admin = bool(ctx.is_admin)
    only = None if admin else ctx.tenant_id
    tenants = live.snapshot(only=only)
    total_prompt = sum(t["prompt_tokens"] for t in tenants)
    total_cached = sum(t["cached_tokens"] for t in tenants)
    since = datetime.fromtimestamp(time.time() - WINDOWS[window].span_s, UTC)
    # The report flushes the ledger and reads SQLite: off the event loop.
    report = await anyio.to_thread.run_sync(lambda: tenancy.usage(ctx, since=since))
    series: TimeSeries = request.app.state.timeseries
    engine_stats = await engine.stats() if engine is not None else {}
    return {
        "generated_at": time.time(),
        "scope": "all" if admin else "own",
        "window": window,
        "totals": {
            "requests": sum(t["requests"] for t in tenants),
            "errors": sum(t["errors"] for t in tenants),
            "prompt_tokens": total_prompt,
            "cached_tokens": total_cached,
            "hit_rate": total_cached / total_prompt if total_prompt else 0.0,
            "saved_usd": sum(t["saved_usd"] for t in tenants),
            "cost_usd": sum(t["cost_usd"] for t in tenants),
        },
        "tenants": tenants,
        "series": series.series(window) if admin else None,
        "ledger": {"since": since.isoformat(), **_ledger_view(report)},
        "cache": {"most_computed": live.most_computed(only),
                  "computed_prefixes": _computed_prefixes(engine_stats, None if admin else ctx.tenant_key.hex()),
                  **(_cache_pays(request) if admin else {})},
        "isolation": await anyio.to_thread.run_sync(lambda: _isolation(ctx, tenancy, live, request.app.state.registry, engine)),
    }
