"""``GET /v1/cache`` (what this tenant holds, in tokens per tier) and ``POST /v1/cache/warm``.

Warming runs a prompt through the normal pipeline with one output token and an explicit
retention, so the prefix is computed ahead of traffic, kept for the TTL (within the tenant's
retention bound) and billed like any request (one ledger row)::

    POST /v1/cache/warm {"model": "tiny", "messages": [...], "ttl": "1h"}
    -> {"object": "cache.warm", "prompt_tokens": 412, "cached_tokens": 0, "written_tokens": 400,
        "ttl": "1h", "retained_until": 1764600000}
"""

from __future__ import annotations

import time
from contextlib import aclosing
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from engine.protocol import CacheInspector, EngineClient
from gateway.deps import EngineDep, TenancyDep, TenantDep
from gateway.door import chat_request, prepare_door, refusals_counted, translated, whole_prompt_for
from gateway.errors import OpenAIError, invalid_request
from gateway.ingress import ScannedBody
from gateway.pipeline import Accounting, engine_failure, run_choices
from gateway.routes.completions import PartsDep, record_rejected
from gateway.schemas import MAX_NAME_CHARS, ChatCompletionRequest
from promptlint.cache_control import RETENTION_SECONDS, TTL_SECONDS

router = APIRouter(prefix="/v1", tags=["cache"])

WARM_TTLS: dict[str, float] = {**TTL_SECONDS, "24h": float(RETENTION_SECONDS["24h"] or 86400.0)}


class WarmRequest(ScannedBody):  # scanned (depth, text, size) like every door's body
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    ttl: Literal["5m", "1h", "24h"] = "1h"
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)


def _inspector(engine: EngineClient | None) -> CacheInspector:
    if not isinstance(engine, CacheInspector):
        raise OpenAIError(501, "this server has no local engine whose cache can be inspected or warmed",
                          code="not_implemented")
    return engine


@router.get("/cache")
async def cache_usage(request: Request, ctx: TenantDep, tenancy: TenancyDep, engine: EngineDep,
                      user: str | None = None) -> Any:
    inspector = _inspector(engine)
    scoped = tenancy.scope_for(ctx, user)
    tokens = inspector.cache_usage(scoped)
    retained = tokens.pop("retained", 0)
    return {"object": "cache", "tenant": ctx.name, "tokens": tokens, "retained_tokens": retained,
            "total_tokens": sum(tokens.values())}


def _as_chat(body: WarmRequest) -> ChatCompletionRequest:
    """The chat request that warms ``body``'s prompt: one greedy output token."""
    chat_body: dict[str, Any] = {"model": body.model, "messages": body.messages, "max_tokens": 1, "temperature": 0}
    if body.tools:
        chat_body["tools"] = body.tools
    if body.user:
        chat_body["user"] = body.user
    return chat_request(chat_body)


@router.post("/cache/warm")
async def warm(body: WarmRequest, ctx: TenantDep, parts: PartsDep) -> Any:
    tenancy, router_, engine, metrics, live = parts.tenancy, parts.router, parts.engine, parts.metrics, parts.live
    # Refusals are counted and charged like every door's (issue 16.9): its ledger row, its rpm slot.
    with refusals_counted(tenancy, ctx, body.model, metrics, live):
        _inspector(engine)
        chat = await translated(body, ctx, parts, partial(_as_chat, body))
    seconds = WARM_TTLS[body.ttl]
    prep = await prepare_door(chat, ctx, parts, retention=whole_prompt_for(seconds))
    if prep.backend.kind != "local":
        err = invalid_request(f"model {body.model!r} is not served by the local engine; only its cache can be "
                              "warmed", param="model")
        record_rejected(tenancy, ctx, body.model, "chat", err, metrics, live)  # admitted: its rpm slot is taken
        raise err
    block = int((await engine.stats()).get("block_size") or 16) if engine is not None else 16
    acct = Accounting(prep, tenancy, metrics, live)
    # the full blocks of the prompt this run wrote: the ledger's cache_creation_tokens too
    acct.cache_writes = lambda prompt, cached: max(0, prompt // block * block - cached)
    try:
        async with aclosing(run_choices(prep, router_, on_abort=acct.aborted)) as outputs:
            async for i, out in outputs:
                acct.observe(i, out)
    except Exception as exc:  # noqa: BLE001 - reported as the error the client sees
        acct.record("error")
        raise engine_failure(exc) from None
    acct.record("ok")
    prompt, cached, _ = acct.usage()
    return {"object": "cache.warm", "model": body.model, "prompt_tokens": prompt, "cached_tokens": cached,
            "written_tokens": acct.cache_writes(prompt, cached), "ttl": body.ttl,
            "retained_until": int(time.time() + seconds)}
