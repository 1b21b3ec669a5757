"""The stored chat completions (``store: true`` on ``POST /v1/chat/completions``), as the openai SDK
reads them: ``GET /v1/chat/completions`` (list), ``GET``, ``POST`` (metadata), ``DELETE
/v1/chat/completions/{id}`` and ``GET /v1/chat/completions/{id}/messages``.

Every call sees only the caller's tenant (tenancy keys each read on (id, tenant)): another
tenant's id is a 404 like an unknown one. The store's work (SQL, AES, JSON) runs in the tenant's
worker thread, as the stored Responses' does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import QueryParams

from gateway.chat_store import ChatCompletionStore, chat_store, not_found
from gateway.deps import TenancyDep, TenantDep
from gateway.errors import invalid_request
from gateway.paging import Order, list_object, page
from gateway.ports import TenantCtx
from gateway.schemas import MAX_METADATA_PAIRS, MAX_NAME_CHARS, Metadata
from tenancy.types import ChatCompletionQuery

router = APIRouter(prefix="/v1", tags=["chat completions store"])
T = TypeVar("T")
Limit = Annotated[int, Query(ge=1, le=100)]
# ``metadata[key]=value``: how the SDK writes the list's metadata filter into the query string.
_METADATA_PARAM = re.compile(r"metadata\[([^\[\]]+)\]")


class MetadataUpdate(BaseModel):
    """The body of ``POST /v1/chat/completions/{id}``: the new metadata (null clears it), nothing
    else: a stored completion's other fields are what the model answered, not the client's to edit."""

    model_config = ConfigDict(extra="forbid")

    metadata: Metadata


async def _run(request: Request, ctx: TenantCtx, fn: Callable[..., T], *args: object) -> T:
    return await request.app.state.tenant_threads.run(ctx.tenant_id, fn, ctx, *args)


def metadata_filter(params: QueryParams) -> dict[str, str]:
    """The ``metadata[key]=value`` pairs of the list's query string (a completion must carry each).
    Any other ``metadata`` parameter is a 400 naming ``metadata``."""
    wanted: dict[str, str] = {}
    for name, value in params.multi_items():
        if name != "metadata" and not name.startswith("metadata["):
            continue  # another parameter (FastAPI reads the known ones; unknown ones are tolerated)
        match = _METADATA_PARAM.fullmatch(name)
        if match is None:
            raise invalid_request(f"Invalid query parameter '{name}': filter on metadata as metadata[key]=value.",
                                  param="metadata")
        wanted[match.group(1)] = value
    if len(wanted) > MAX_METADATA_PAIRS:
        raise invalid_request(f"metadata filters on at most {MAX_METADATA_PAIRS} pairs, got {len(wanted)}.",
                              param="metadata")
    return wanted


@router.get("/chat/completions")
async def list_chat_completions(request: Request, ctx: TenantDep, tenancy: TenancyDep, after: str | None = None,
                                limit: Limit = 20, order: Order = "asc",
                                model: Annotated[str | None, Query(max_length=MAX_NAME_CHARS)] = None) -> Any:
    store: ChatCompletionStore = chat_store(tenancy)
    query = ChatCompletionQuery(after=after, limit=limit, order=order, model=model,
                                metadata=metadata_filter(request.query_params))
    found = await _run(request, ctx, store.list_chat_completions, query)
    if found is None:
        raise invalid_request(f"No stored chat completion with id '{after}'.", param="after")
    return list_object(found.completions, has_more=found.has_more)


@router.get("/chat/completions/{completion_id}")
async def get_chat_completion(completion_id: str, request: Request, ctx: TenantDep, tenancy: TenancyDep) -> Any:
    completion = await _run(request, ctx, chat_store(tenancy).load_chat_completion, completion_id)
    if completion is None:
        raise not_found(completion_id)
    return completion


@router.post("/chat/completions/{completion_id}")
async def update_chat_completion(completion_id: str, body: MetadataUpdate, request: Request, ctx: TenantDep,
                                 tenancy: TenancyDep) -> Any:
    completion = await _run(request, ctx, chat_store(tenancy).update_chat_completion_metadata, completion_id,
                            body.metadata or {})
    if completion is None:
        raise not_found(completion_id)
    return completion


@router.delete("/chat/completions/{completion_id}")
async def delete_chat_completion(completion_id: str, request: Request, ctx: TenantDep, tenancy: TenancyDep) -> Any:
    if not await _run(request, ctx, chat_store(tenancy).delete_chat_completion, completion_id):
        raise not_found(completion_id)
    return {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}


@router.get("/chat/completions/{completion_id}/messages")
async def list_chat_completion_messages(completion_id: str, request: Request, ctx: TenantDep, tenancy: TenancyDep,
                                        after: str | None = None, limit: Limit = 20, order: Order = "asc") -> Any:
    messages = await _run(request, ctx, chat_store(tenancy).chat_completion_messages, completion_id)
    if messages is None:
        raise not_found(completion_id)
    return page(messages, after=after, limit=limit, order=order,
                unknown_after=f"No message with id '{after}' in chat completion '{completion_id}'.")
