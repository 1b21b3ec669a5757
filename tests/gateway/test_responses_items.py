"""``gateway.responses_items``: a Responses input as its listed items, and the paging of them."""

from __future__ import annotations

import pytest

from gateway.errors import OpenAIError
from gateway.responses_api import ResponsesRequest
from gateway.responses_items import input_items, page


def _items(input_: object) -> list[dict]:
    return input_items(ResponsesRequest.model_validate({"model": "m", "input": input_}))


def test_a_string_input_is_one_user_message_with_one_text_part() -> None:
    [item] = _items("hi")
    assert item["id"].startswith("msg_")
    assert {k: v for k, v in item.items() if k != "id"} == {
        "type": "message", "role": "user", "status": "completed", "content": [{"type": "input_text", "text": "hi"}]}


def test_items_keep_what_the_client_sent_and_its_ids() -> None:
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "data:image/png;base64,AA"}]
    items = _items([
        {"role": "system", "content": "rules", "id": "msg_client"},
        {"role": "assistant", "content": "earlier answer"},
        {"type": "message", "role": "user", "content": parts},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ])
    assert items[0]["id"] == "msg_client" and items[0]["content"] == [{"type": "input_text", "text": "rules"}]
    # an earlier assistant turn reads back as OpenAI returns one: output text with its annotations
    assert items[1]["content"] == [{"type": "output_text", "text": "earlier answer", "annotations": []}]
    assert items[2]["content"] == parts
    assert items[3]["id"].startswith("fc_") and items[3]["status"] == "completed" and items[3]["name"] == "f"
    assert items[4]["id"].startswith("fco_") and items[4]["output"] == "ok"
    assert len({i["id"] for i in items}) == 5
    assert _items(None) == []


def _stored(n: int) -> list[dict]:
    return [{"id": f"i{k}"} for k in range(n)]


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_pages_walk_every_item_once_in_order(order: str) -> None:
    items = _stored(7)
    seen: list[str] = []
    after = None
    while True:
        got = page(items, after=after, limit=3, order=order)
        seen += [i["id"] for i in got["data"]]
        assert got["first_id"] == got["data"][0]["id"] and got["last_id"] == got["data"][-1]["id"]
        if not got["has_more"]:
            break
        after = got["last_id"]
    expected = [f"i{k}" for k in range(7)]
    assert seen == (expected if order == "asc" else expected[::-1])


def test_an_empty_page_and_an_unknown_after() -> None:
    assert page([], after=None, limit=20, order="desc") == {
        "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    assert page(_stored(2), after="i0", limit=20, order="desc")["data"] == []
    with pytest.raises(OpenAIError) as exc:
        page(_stored(2), after="nope", limit=20, order="asc")
    assert exc.value.status == 400 and exc.value.param == "after"
