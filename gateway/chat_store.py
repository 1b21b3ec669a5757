"""Stored chat completions (``store: true`` on ``/v1/chat/completions``): what is kept and how.

What a stored completion holds (tenancy keeps it sealed, keyed on (id, tenant); ``tenancy.chat_completions``)::

    completion  the chat.completion object the client got (a stream's, built from what it sent),
                with the request's metadata ({} when none): what GET /v1/chat/completions/{id} returns
    messages    the request's messages as the client sent them (before canonicalization), in
                OpenAI's stored-message shape: id "<completion id>-<i>", role, content, name,
                content_parts (the parts of a list content; content is then their text), and
                tool_calls / tool_call_id / function_call where the message had them

The completion is kept after it is built and before it is sent (``formats.StoredChatFormat``), in
the tenant's worker thread: a long conversation is dumped, serialized and sealed off the event loop.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from gateway.errors import OpenAIError
from gateway.formats import StoredChatFormat
from gateway.pipeline import Prepared
from gateway.ports import TenancyError, TenancyPort, TenantCtx, tenancy_error
from gateway.schemas import ChatCompletionRequest, ChatMessage
from gateway.tenant_threads import TenantThreads
from tenancy.types import ChatCompletionPage, ChatCompletionQuery, StoredChatCompletion


@runtime_checkable
class ChatCompletionStore(Protocol):
    """Stored chat completions, per tenant (``tenancy.service.TenancyService`` implements it).
    Every call sees only ``ctx``'s tenant: another tenant's id is as unknown as any (None / False)."""

    def save_chat_completion(self, ctx: TenantCtx, stored: StoredChatCompletion) -> None: ...

    def load_chat_completion(self, ctx: TenantCtx, completion_id: str) -> dict[str, Any] | None: ...

    def chat_completion_messages(self, ctx: TenantCtx, completion_id: str) -> list[dict[str, Any]] | None: ...

    def list_chat_completions(self, ctx: TenantCtx, query: ChatCompletionQuery) -> ChatCompletionPage | None:
        """None when ``query.after`` names no completion of the tenant."""
        ...

    def update_chat_completion_metadata(self, ctx: TenantCtx, completion_id: str,
                                        metadata: dict[str, str]) -> dict[str, Any] | None: ...

    def delete_chat_completion(self, ctx: TenantCtx, completion_id: str) -> bool: ...


def chat_store(tenancy: TenancyPort) -> ChatCompletionStore:
    if not isinstance(tenancy, ChatCompletionStore):
        raise OpenAIError(501, "this server's tenancy backend cannot store chat completions", code="not_implemented")
    return tenancy


def not_found(completion_id: str) -> OpenAIError:
    """An unknown id, an unstored completion's and another tenant's alike."""
    return OpenAIError(404, f"Chat completion with id '{completion_id}' not found.", param="completion_id",
                       code="chat_completion_not_found")


def stored_message(completion_id: str, index: int, message: ChatMessage) -> dict[str, Any]:
    """One input message as ``GET /v1/chat/completions/{id}/messages`` lists it."""
    content = message.content
    parts = None
    if isinstance(content, list):
        parts = content
        texts = [part["text"] for part in content if part.get("type") == "text"]
        content = "".join(texts) if texts else None
    out: dict[str, Any] = {"id": f"{completion_id}-{index}", "role": message.role, "content": content,
                           "name": message.name, "content_parts": parts}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.function_call is not None:
        out["function_call"] = message.function_call
    return out


def _save(store: ChatCompletionStore, ctx: TenantCtx, prep: Prepared, body: ChatCompletionRequest,
          completion: dict[str, Any]) -> None:
    messages = [stored_message(prep.request_id, i, m) for i, m in enumerate(body.messages)]
    kept = {**completion, "metadata": body.metadata or {}}
    store.save_chat_completion(ctx, StoredChatCompletion(prep.request_id, prep.model, kept, messages))


def storing_format(prep: Prepared, body: ChatCompletionRequest, ctx: TenantCtx, store: ChatCompletionStore,
                   threads: TenantThreads) -> StoredChatFormat:
    """The chat format that keeps the finished completion of ``body`` (which asked ``store: true``)."""

    async def keep(completion: dict[str, Any]) -> None:
        # Never refused by the tenant's queue bound: the answer exists (as a stored response).
        try:
            await threads.run(ctx.tenant_id, _save, store, ctx, prep, body, completion, refusable=False)
        except TenancyError as exc:  # the tenant was deleted while its key was cached: a 401, not a 500
            raise tenancy_error(exc) from None

    return StoredChatFormat(prep, keep)
