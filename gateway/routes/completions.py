"""``POST /v1/chat/completions`` and ``POST /v1/completions``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from gateway.deps import EngineDep, LiveStatsDep, MetricsDep, RouterDep, SettingsDep, TenancyDep, TenantDep
from gateway.pipeline import Accounting, prepare
from gateway.ports import UsageRecord
from gateway.responder import respond
from gateway.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter(prefix="/v1", tags=["completions"])


def _record_rejected(tenancy: Any, ctx: Any, model: str, kind: str) -> None:
    """A request refused after authentication still gets its one ledger row (status error)."""
    tenancy.record_usage(UsageRecord(
        request_id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex, tenant_id=ctx.tenant_id,
        key_id=ctx.key_id, model=model, backend="none", prompt_tokens=0, cached_tokens=0, completion_tokens=0,
        ttft_s=None, latency_s=0.0, status="error", created_at=time.time(),
    ))


async def _handle(kind: str, body: Any, request: Request, ctx: Any, tenancy: Any, router_: Any, engine: Any,
                  settings: Any, metrics: Any, live: Any) -> Any:
    try:
        prep = await prepare(kind, body, ctx, tenancy=tenancy, router=router_, engine=engine, settings=settings,
                             threads=request.app.state.tenant_threads,
                             tracker=getattr(request.app.state, "miss_tracker", None))
    except Exception:  # a refusal (OpenAIError) or a bug: either way the request gets its one row
        _record_rejected(tenancy, ctx, body.model, kind)
        raise
    return await respond(prep, router_, Accounting(prep, tenancy, metrics, live), request)


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, ctx: TenantDep, tenancy: TenancyDep, router_: RouterDep,
    engine: EngineDep, settings: SettingsDep, metrics: MetricsDep, live: LiveStatsDep,
) -> Any:
    return await _handle("chat", body, request, ctx, tenancy, router_, engine, settings, metrics, live)


@router.post("/completions")
async def completions(
    body: CompletionRequest, request: Request, ctx: TenantDep, tenancy: TenancyDep, router_: RouterDep,
    engine: EngineDep, settings: SettingsDep, metrics: MetricsDep, live: LiveStatsDep,
) -> Any:
    return await _handle("completion", body, request, ctx, tenancy, router_, engine, settings, metrics, live)
