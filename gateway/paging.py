"""OpenAI's cursor-paged list object (``object: "list"``, ``data``, ``first_id``, ``last_id``,
``has_more``), which the stored Responses' input items and the stored chat completions and their
messages are answered as: paged by ``after`` (the id of the last item of the page before), 1-100
items a page, ``asc`` or ``desc``."""

from __future__ import annotations

from typing import Any, Literal

from gateway.errors import invalid_request

Order = Literal["asc", "desc"]


def list_object(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def page(items: list[dict[str, Any]], *, after: str | None, limit: int, order: Order,
         unknown_after: str) -> dict[str, Any]:
    """One page of ``items`` (held oldest first, each with an ``id``) as the list object. An
    ``after`` that is no item's id is a 400 naming ``after``, with the message ``unknown_after``."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid_request(unknown_after, param="after")
        ordered = ordered[ids.index(after) + 1:]
    return list_object(ordered[:limit], has_more=len(ordered) > limit)
