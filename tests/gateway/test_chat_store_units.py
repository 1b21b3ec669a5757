"""``gateway.chat_store`` and its routes' parsing: an input message in OpenAI's stored-message shape,
and the list's ``metadata[key]=value`` filter read from the query string."""

from __future__ import annotations

import pytest
from starlette.datastructures import QueryParams

from gateway.chat_store import stored_message
from gateway.errors import OpenAIError
from gateway.routes.chat_store import metadata_filter
from gateway.schemas import ChatCompletionRequest


def _messages(*messages: dict) -> list:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": list(messages)}).messages


def test_tool_calls_and_their_answers_keep_their_fields() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    asked, answered = _messages({"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "42"})
    assert stored_message("chatcmpl-9", 1, asked) == {
        "id": "chatcmpl-9-1", "role": "assistant", "content": None, "name": None, "content_parts": None,
        "tool_calls": [call]}
    assert stored_message("chatcmpl-9", 2, answered) == {
        "id": "chatcmpl-9-2", "role": "tool", "content": "42", "name": None, "content_parts": None,
        "tool_call_id": "call_1"}


def test_a_list_content_is_its_parts_and_their_text() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    [only_image] = _messages({"role": "user", "content": [image]})
    assert stored_message("c", 0, only_image)["content"] is None  # no text part: no text
    [mixed] = _messages({"role": "user", "content": [{"type": "text", "text": "a"}, image, {"type": "text", "text": "b"}]})
    kept = stored_message("c", 0, mixed)
    assert kept["content"] == "ab" and kept["content_parts"][1] == image


def test_the_metadata_filter_is_every_bracketed_pair() -> None:
    params = QueryParams("limit=2&metadata[team]=red&metadata[env]=prod%20eu&model=tiny")
    assert metadata_filter(params) == {"team": "red", "env": "prod eu"}
    assert metadata_filter(QueryParams("order=asc&metadatax=1")) == {}


@pytest.mark.parametrize("query", ["metadata=red", "metadata[]=x", "metadata[a][b]=x",
                                   "&".join(f"metadata[k{i}]=v" for i in range(17))])
def test_a_malformed_or_oversized_metadata_filter_is_a_400_naming_metadata(query: str) -> None:
    with pytest.raises(OpenAIError) as err:
        metadata_filter(QueryParams(query))
    assert err.value.status == 400 and err.value.param == "metadata"
