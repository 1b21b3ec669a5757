"""A stored response's input items: ``GET /v1/responses/{id}/input_items``.

OpenAI lists the items a response was given as ``input`` (not the ``instructions``, not the turns
of ``previous_response_id``, which their own response lists), each with an id, newest first unless
``order=asc``, 20 a page (``limit`` 1-100), paged by ``after`` (an item id). A response keeps its
items as the client sent them, in the Responses shape the SDK reads back: a message's string content
becomes one text part (``input_text``; ``output_text`` for an assistant turn, as OpenAI returns
earlier assistant messages), and an item without an id gets one.

The items are stored beside the response, not rebuilt from the chat conversation it ran as: that
conversation is normalised (parts renamed, parallel calls merged into one assistant turn), and an
item id the client chose must come back as it was.
"""

from __future__ import annotations

import uuid
from typing import Any

from gateway.errors import OpenAIError
from gateway.paging import Order
from gateway.paging import page as paged
from gateway.responses_api import ResponsesRequest

__all__ = ["Order", "input_items", "not_kept", "page"]
# The id prefix OpenAI gives each kind of item.
_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``req.input`` as the items its response lists. Called once ``responses_api.input_messages``
    accepted the input, so each item has the fields its type needs."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [_message({"role": "user", "content": req.input})]
    return [_item(item) for item in req.input]


def _item(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "message":
        return _message(item)
    out = {**item, "type": kind, "id": _id_of(item, kind)}
    out.setdefault("status", "completed")
    return out


def _message(item: dict[str, Any]) -> dict[str, Any]:
    content = item["content"]
    if isinstance(content, str):
        text_type = "output_text" if item["role"] == "assistant" else "input_text"
        part: dict[str, Any] = {"type": text_type, "text": content}
        if text_type == "output_text":
            part["annotations"] = []
        content = [part]
    return {**item, "type": "message", "id": _id_of(item, "message"), "content": content,
            "status": item.get("status", "completed")}


def _id_of(item: dict[str, Any], kind: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else _ID_PREFIX[kind] + uuid.uuid4().hex


def page(items: list[dict[str, Any]], *, after: str | None, limit: int, order: Order) -> dict[str, Any]:
    """One page of ``items`` (stored oldest first) as OpenAI's list object."""
    return paged(items, after=after, limit=limit, order=order,
                 unknown_after=f"No input item with id '{after}' in this response.")


def not_kept(response_id: str) -> OpenAIError:
    """A response stored before its input items were kept (the record has none to list)."""
    return OpenAIError(404, f"Input items of response '{response_id}' were not stored: it was created by an "
                            "earlier version of this server.", param="response_id", code="input_items_not_found")
