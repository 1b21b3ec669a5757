"""``POST /v1/messages``: Anthropic's Messages API on the same pipeline and cache as chat.

Auth takes the tenant key from ``x-api-key`` (what Anthropic's SDK sends) or ``Authorization:
Bearer``; ``anthropic-version`` is accepted and not needed. Errors on this path are rendered in
Anthropic's shape (``gateway.errors.render`` with ``app.state.error_shapes``).

Breakpoint positions: each breakpoint's prefix (the request cut after its block) is tokenized
through the engine's chat template and compared with the whole prompt's ids; the common length is
where that breakpoint falls in the prompt the engine really runs.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request

from engine.protocol import EngineClient, GenerateRequest, Retention, SamplingParams
from gateway.anthropic_api import (
    CacheUsage,
    CountTokensRequest,
    MessagesFormat,
    MessagesRequest,
    chat_body,
    chat_messages,
    chat_tools,
    prefix_body,
)
from gateway.deps import (
    TenancyDep,
    bearer_key,
)
from gateway.door import chat_request, prepare_door, refusals_counted, translated, with_retention
from gateway.errors import OpenAIError, invalid_request, render
from gateway.pipeline import Accounting, Prepared
from gateway.ports import AuthenticationError, TenantCtx
from gateway.responder import respond
from gateway.routes.completions import PartsDep
from gateway.schemas import ChatCompletionRequest
from gateway.upstream import ProviderOutput
from promptlint.cache_control import Breakpoint, CacheControlError, parse_breakpoints

router = APIRouter(prefix="/v1", tags=["messages"])

DEFAULT_BLOCK_SIZE = 16


async def anthropic_tenant(request: Request, tenancy: TenancyDep,
                           x_api_key: Annotated[str | None, Header()] = None,
                           authorization: Annotated[str | None, Header()] = None) -> TenantCtx:
    """``x-api-key`` (or a bearer key) -> the tenant; missing or wrong -> 401 ``authentication_error``."""
    key = (x_api_key or "").strip() or bearer_key(authorization)
    try:
        ctx = tenancy.authenticate(key)
    except AuthenticationError as exc:
        request.app.state.metrics.unauthenticated.inc()
        message = "x-api-key header is required" if key is None else (str(exc) or "invalid x-api-key")
        raise OpenAIError(401, message, code="invalid_api_key", type="authentication_error") from None
    request.state.tenant = ctx
    return ctx


AnthropicTenantDep = Annotated[TenantCtx, Depends(anthropic_tenant)]


def _local(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as the local engine's template gets them: text parts joined."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            m = {**m, "content": "".join(p.get("text", "") for p in m["content"] if p.get("type") == "text")}
        out.append(m)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _breakpoint_tokens(engine: EngineClient, prep: Prepared, body: MessagesRequest, bp: Breakpoint,
                       full: list[int]) -> int:
    """Where ``bp`` falls in the prompt's ``full`` token ids (blocking: runs in a tenant thread)."""
    cut = prefix_body(body, bp)
    tools = body.tools if bp.section != "tools" else (body.tools or [])[: (bp.block or 0) + 1]
    probe = GenerateRequest(request_id=prep.request_id + "-bp", tenant=prep.tenant,
                            sampling=SamplingParams(max_tokens=1),
                            messages=_local(chat_messages(cut["system"], cut["messages"])),
                            tools=chat_tools(tools), model=prep.backend.target_model or None)
    try:
        ids = engine.tokenize(probe)
    except Exception:  # noqa: BLE001 - a template that cannot render a cut prefix: nothing to retain there
        return 0
    return _common_prefix(ids, full)


def _as_chat(body: MessagesRequest) -> tuple[list[Breakpoint], ChatCompletionRequest]:
    """The body's cache breakpoints (checked: a bad one is a 400) and the chat request it becomes."""
    try:
        breakpoints = parse_breakpoints(body.model_dump())
    except CacheControlError as exc:
        raise invalid_request(str(exc), param=exc.param) from None
    return breakpoints, chat_request(chat_body(body))


@router.post("/messages/count_tokens")
async def count_tokens(
    body: CountTokensRequest, ctx: AnthropicTenantDep, parts: PartsDep) -> Any:
    """The prompt's tokens as the local engine counts them (admitted like a request, not run, no ledger row)."""
    tenancy, metrics, live = parts.tenancy, parts.metrics, parts.live
    with refusals_counted(tenancy, ctx, body.model, metrics, live):
        _, chat = await translated(body, ctx, parts, partial(_as_chat, body))
    prep = await prepare_door(chat, ctx, parts)
    if prep.backend.kind != "local":
        raise invalid_request(f"model {body.model!r} is not served by the local engine; its tokens cannot be "
                              "counted here", param="model")
    return {"input_tokens": len(prep.requests[0].prompt_token_ids or ())}


@router.post("/messages")
async def create_message(
    body: MessagesRequest, request: Request, ctx: AnthropicTenantDep, parts: PartsDep) -> Any:
    tenancy, router_, engine, metrics, live = parts.tenancy, parts.router, parts.engine, parts.metrics, parts.live
    with refusals_counted(tenancy, ctx, body.model, metrics, live):
        breakpoints, chat = await translated(body, ctx, parts, partial(_as_chat, body))
    prep = await prepare_door(chat, ctx, parts)
    written_upto = long_upto = 0
    if breakpoints and prep.backend.kind == "local" and engine is not None:
        threads = parts.threads
        full = list(prep.requests[0].prompt_token_ids or ())
        block = int((await engine.stats()).get("block_size") or DEFAULT_BLOCK_SIZE)
        spans = []
        for bp in breakpoints:
            tokens = await threads.run(prep.tenant.tenant_id, _breakpoint_tokens, engine, prep, body, bp, full)
            spans.append(Retention(tokens, bp.ttl_s))
        written_upto = spans[-1].tokens // block * block
        long_upto = max((s.tokens for s, bp in zip(spans, breakpoints) if bp.ttl == "1h"), default=0) // block * block
        prep.requests = [with_retention(r, tuple(spans)) for r in prep.requests]
    acct = Accounting(prep, tenancy, metrics, live)

    def provider_writes() -> int:  # a provider route: what Anthropic itself reported writing
        last = acct.last.get(0)
        return last.cache_creation_tokens if isinstance(last, ProviderOutput) else 0

    fmt = MessagesFormat(prep, written_upto=written_upto, long_upto=long_upto, reported_creation=provider_writes)
    # the ledger's cache_creation_tokens: the same count the client sees in its usage
    acct.cache_writes = lambda prompt, cached: CacheUsage.of(
        prompt, cached, written_upto, long_upto, provider_writes()).cache_creation
    prep.request_id = fmt.msg_id
    return await respond(prep, router_, acct, request.receive, fmt, render_error=partial(render, request))
