"""``POST /v1/responses``, ``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``,
``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}`` (the Responses API).

The request is translated to chat (``gateway.responses_api``) and runs through the chat pipeline:
same admission, canonicalization, tenant-isolated cache and ledger row. Stored responses live in
the tenancy database keyed on (id, tenant): another tenant's id is simply not found.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Protocol, runtime_checkable

from fastapi import APIRouter, Query, Request

from gateway.deps import TenancyDep, TenantDep
from gateway.door import chat_request, prepare_door, refusals_counted, translated
from gateway.errors import OpenAIError, render
from gateway.pipeline import Accounting, RequestFields
from gateway.ports import TenancyError, TenancyPort, TenantCtx, tenancy_error
from gateway.responder import respond
from gateway.responses_api import (
    RESPONSES_FIELDS,
    ResponsesFormat,
    ResponsesRequest,
    chat_body,
    conversation_after,
    input_messages,
    new_response_id,
    not_found,
    request_fields,
    resumed,
)
from gateway.responses_items import Order, input_items, not_kept, page
from gateway.routes.completions import PartsDep
from gateway.schemas import ChatCompletionRequest

router = APIRouter(prefix="/v1", tags=["responses"])


@runtime_checkable
class ResponseStore(Protocol):
    """Stored responses, per tenant (``tenancy.service.TenancyService`` implements it)."""

    def save_response(self, ctx: TenantCtx, response_id: str, body: dict[str, Any]) -> None: ...

    def load_response(self, ctx: TenantCtx, response_id: str) -> dict[str, Any] | None: ...

    def delete_response(self, ctx: TenantCtx, response_id: str) -> bool: ...


def _store(tenancy: TenancyPort) -> ResponseStore:
    if not isinstance(tenancy, ResponseStore):
        raise OpenAIError(501, "this server's tenancy backend cannot store responses", code="not_implemented")
    return tenancy


def _as_chat(body: ResponsesRequest, history: list[dict[str, Any]]
             ) -> tuple[list[dict[str, Any]], ChatCompletionRequest, RequestFields]:
    """The conversation so far with this request's input, the chat request it becomes, and the
    Responses names of its fields (where each of its messages came from)."""
    turns = input_messages(body, history)
    conversation = history + turns.messages
    return conversation, chat_request(chat_body(body, history, conversation)), request_fields(body, len(history), turns)


@router.post("/responses")
async def create_response(
    body: ResponsesRequest, request: Request, ctx: TenantDep, parts: PartsDep) -> Any:
    tenancy, router_, metrics, live, threads = parts.tenancy, parts.router, parts.metrics, parts.live, parts.threads
    store = _store(tenancy)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = await threads.run(ctx.tenant_id, store.load_response, ctx, body.previous_response_id)
        if stored is None:
            raise OpenAIError(400, f"Previous response with id '{body.previous_response_id}' not found.",
                              param="previous_response_id", code="previous_response_not_found")
        history = resumed(stored["conversation"])
    with refusals_counted(tenancy, ctx, body.model, metrics, live):
        conversation, chat, fields = await translated(body, ctx, parts, partial(_as_chat, body, history),
                                                      RESPONSES_FIELDS)
    # prompt_cache_retention rides on the chat request: checked and honoured as on chat (pipeline)
    prep = await prepare_door(chat, ctx, parts, fields=fields)
    prep.request_id = new_response_id()

    async def keep(response: dict[str, Any]) -> None:
        # Awaited before the response is sent: a follow-up sent the moment the client has the
        # response must find it (a background write would race it). In the tenant's worker thread:
        # the conversation can be megabytes to serialize and seal, which on the event loop stalled
        # every other tenant's stream. Never refused by the tenant's queue bound: the answer exists.
        if not body.store:
            return
        record = {"response": response, "conversation": conversation_after(conversation, response["output"]),
                  "input_items": input_items(body)}
        try:
            await threads.run(ctx.tenant_id, store.save_response, ctx, response["id"], record, refusable=False)
        except TenancyError as exc:  # the tenant was deleted while its key was cached: a 401, not a 500
            raise tenancy_error(exc) from None

    fmt = ResponsesFormat(prep, body, keep)
    return await respond(prep, router_, Accounting(prep, tenancy, metrics, live), request.receive, fmt,
                         render_error=partial(render, request))


async def _stored(response_id: str, request: Request, ctx: TenantCtx, tenancy: TenancyPort) -> dict[str, Any]:
    """The caller's tenant's stored response (decrypted in its worker thread); another tenant's, an
    unknown or an unstored id is a 404."""
    stored = await request.app.state.tenant_threads.run(ctx.tenant_id, _store(tenancy).load_response, ctx,
                                                        response_id)
    if stored is None:
        raise not_found(response_id)
    return stored


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request, ctx: TenantDep, tenancy: TenancyDep) -> Any:
    stored = await _stored(response_id, request, ctx, tenancy)
    return stored["response"]


@router.get("/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, ctx: TenantDep, tenancy: TenancyDep,
                           after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           order: Order = "desc") -> Any:
    """The items the response was given as ``input`` (``include`` is accepted and adds nothing: none
    of its values names a field an input item here lacks)."""
    stored = await _stored(response_id, request, ctx, tenancy)
    if "input_items" not in stored:
        raise not_kept(response_id)
    return page(stored["input_items"], after=after, limit=limit, order=order)


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request, ctx: TenantDep, tenancy: TenancyDep) -> Any:
    """OpenAI cancels only a ``background: true`` response, which this server refuses to create: a
    stored response is finished, so cancelling it is a 400, as OpenAI answers for one not in the
    background (an unknown id a 404)."""
    await _stored(response_id, request, ctx, tenancy)  # a 404 first, as for any other id
    raise OpenAIError(400, "Only responses created with background set to true can be cancelled.",
                      param="response_id", code="invalid_value")


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request, ctx: TenantDep, tenancy: TenancyDep) -> Any:
    deleted = await request.app.state.tenant_threads.run(ctx.tenant_id, _store(tenancy).delete_response, ctx,
                                                         response_id)
    if not deleted:
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}

