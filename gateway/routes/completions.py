"""``POST /v1/chat/completions`` and ``POST /v1/completions``; a chat request with ``store: true``
is kept for its tenant (``gateway.chat_store``; read back through ``gateway.routes.chat_store``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from starlette.datastructures import State
from starlette.types import Receive

from engine.protocol import EngineClient
from gateway.chat_store import chat_store, storing_format
from gateway.deps import EngineDep, TenancyDep, TenantDep
from gateway.errors import OpenAIError
from gateway.metrics import GatewayMetrics, LiveStats, RequestSample, outcome_of_error
from gateway.miss_tracker import MissTracker
from gateway.pipeline import Accounting, new_request_id, prepare
from gateway.ports import TenancyPort, TenantCtx, UsageRecord
from gateway.responder import respond
from gateway.routing import Router
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.tenant_threads import TenantThreads

router = APIRouter(prefix="/v1", tags=["completions"])


def record_rejected(tenancy: TenancyPort, ctx: TenantCtx, model: str, kind: str, err: OpenAIError, metrics: GatewayMetrics,
                     live: LiveStats) -> None:
    """A request refused after authentication still gets its one ledger row (status error), and is
    counted by outcome (4xx, 429 by kind) in ``/metrics`` and on the dashboard like any other."""
    outcome = outcome_of_error(err.status, err.code)
    metrics.count(ctx.metrics_label, "none", "error", outcome)
    live.add(RequestSample(tenant_id=ctx.tenant_id, tenant=ctx.name, outcome=outcome,
                           spill_encrypted=ctx.cipher is not None))
    tenancy.record_usage(UsageRecord(
        request_id=new_request_id(kind), tenant_id=ctx.tenant_id,
        key_id=ctx.key_id, model=model, backend="none", prompt_tokens=0, cached_tokens=0, completion_tokens=0,
        ttft_s=None, latency_s=0.0, status="error", created_at=time.time(),
    ))


# The paths whose refused requests (an invalid body included) are counted in the ledger and take a
# place in the rate limit (issue 16.9), with the kind of request each runs as: the Responses and
# Messages doors and cache warming run as chat requests (gateway.door).
KIND_OF_PATH = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "chat",
                "/v1/messages": "chat", "/v1/cache/warm": "chat"}


def record_invalid_body(request: Request, err: OpenAIError) -> None:
    """A completion body that failed validation after its key was authenticated: one ledger row and
    the same counts as any refused request (the model is unknown: the body did not parse)."""
    kind = KIND_OF_PATH.get(request.url.path)
    ctx = getattr(request.state, "tenant", None)
    if kind is None or ctx is None:
        return
    state = request.app.state
    tenancy = state.tenancy
    if tenancy is None:
        return
    record_rejected(tenancy, ctx, "unknown", kind, err, state.metrics, state.live_stats)


@dataclass(slots=True)
class Parts:
    """The app's parts a completion request needs, resolved as one dependency: FastAPI solves each
    dependency of a route on every request (~40 Python calls apiece), and these are plain reads of
    ``app.state`` except the two that tests override (``get_tenancy``, ``get_engine``).

    Not frozen: one is made per request and nothing hashes or keeps it, and a frozen dataclass sets
    each field through ``object.__setattr__`` (~1 us here against ~0.4 us)."""

    tenancy: TenancyPort
    engine: EngineClient | None
    router: Router
    settings: GatewaySettings
    metrics: GatewayMetrics
    live: LiveStats
    threads: TenantThreads
    tracker: MissTracker | None

    @classmethod
    def of(cls, state: State, tenancy: TenancyPort, engine: EngineClient | None) -> Parts:
        return cls(tenancy, engine, state.router, state.settings, state.metrics, state.live_stats,
                   state.tenant_threads, state.miss_tracker)


async def get_parts(request: Request, tenancy: TenancyDep, engine: EngineDep) -> Parts:
    return Parts.of(request.app.state, tenancy, engine)


PartsDep = Annotated[Parts, Depends(get_parts)]


async def handle(kind: str, body: ChatCompletionRequest | CompletionRequest, ctx: TenantCtx, parts: Parts,
                 receive: Receive) -> Response:
    """One completion request, authenticated and validated: prepared, run and answered. ``receive``
    is the request's ASGI receive (its body read), watched for a disconnect."""
    tenancy, metrics, live = parts.tenancy, parts.metrics, parts.live
    storing = isinstance(body, ChatCompletionRequest) and body.store
    try:
        store = chat_store(tenancy) if storing else None  # before any work: a store that cannot keep it refuses
        prep = await prepare(kind, body, ctx, tenancy=tenancy, router=parts.router, engine=parts.engine,
                             settings=parts.settings, threads=parts.threads, tracker=parts.tracker)
    except OpenAIError as err:  # a refusal: its one row, and counted by outcome
        record_rejected(tenancy, ctx, body.model, kind, err, metrics, live)
        raise
    except Exception:  # a bug: the request still gets its one row (a 500)
        record_rejected(tenancy, ctx, body.model, kind, OpenAIError(500, "internal error"), metrics, live)
        raise
    fmt = None  # the chat or completions format of the kind
    if store is not None and isinstance(body, ChatCompletionRequest):
        fmt = storing_format(prep, body, ctx, store, parts.threads)
    return await respond(prep, parts.router, Accounting(prep, tenancy, metrics, live), receive, fmt)


# These two routes are also served by ``gateway.routes.completions_asgi`` in front of FastAPI (the
# same ``handle``); FastAPI's routes answer what that fast path hands on: bodies it does not parse
# or validate (their errors and refused-request accounting stay FastAPI's), and apps whose tests
# override dependencies.
@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: TenantDep, parts: PartsDep) -> Response:
    return await handle("chat", body, ctx, parts, request.receive)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, ctx: TenantDep, parts: PartsDep) -> Response:
    return await handle("completion", body, ctx, parts, request.receive)
