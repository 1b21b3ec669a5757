"""The doors' translations to chat and the Anthropic usage arithmetic (no server, no engine)."""

from __future__ import annotations

import pytest

from gateway.anthropic_api import CacheUsage, MessagesRequest, chat_body, error_body
from gateway.errors import OpenAIError
from gateway.responses_api import ResponsesRequest, input_messages
from gateway.responses_api import chat_body as responses_chat_body


def test_responses_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo and Rome?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": {"sky": "sun"}},
    ]})
    msgs = input_messages(req)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one assistant turn
    assert msgs[3]["content"] == '{"sky": "sun"}'
    body = responses_chat_body(req, [], msgs)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("item, param", [
    ({"type": "reasoning", "summary": []}, "input[0].type"),
    ({"role": "robot", "content": "x"}, "input[0].role"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0].type"),
])
def test_responses_bad_items_name_the_field(item, param):
    with pytest.raises(OpenAIError) as exc:
        input_messages(ResponsesRequest.model_validate({"model": "m", "input": [item]}))
    assert exc.value.status == 400 and exc.value.param == param


def test_messages_blocks_become_chat_messages_tool_results_first():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "system": "S", "messages": [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "rain"}]}, {"type": "text", "text": "And now?"}]},
    ], "tool_choice": {"type": "any"}, "stop_sequences": ["END"], "metadata": {"user_id": "u1"}})
    body = chat_body(req)
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert body["messages"][2]["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"c": "Oslo"}'}
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "rain"}
    assert (body["tool_choice"], body["stop"], body["user"]) == ("required", ["END"], "u1")


def test_anthropic_usage_adds_up_to_the_prompt():
    first = CacheUsage.of(prompt=150, cached=0, written_upto=128, long_upto=64)
    assert (first.cache_read, first.cache_creation, first.creation_1h, first.input_tokens) == (0, 128, 64, 22)
    second = CacheUsage.of(prompt=150, cached=128, written_upto=128, long_upto=64)
    assert (second.cache_read, second.cache_creation, second.input_tokens) == (128, 0, 22)
    no_marks = CacheUsage.of(prompt=150, cached=96, written_upto=0, long_upto=0)
    assert (no_marks.cache_read, no_marks.cache_creation, no_marks.input_tokens) == (96, 0, 54)
    provider = CacheUsage.of(prompt=145, cached=100, written_upto=0, long_upto=0, reported=40)
    assert (provider.cache_creation, provider.input_tokens) == (40, 5)
    d = first.as_dict(3)
    assert d["cache_creation"] == {"ephemeral_5m_input_tokens": 64, "ephemeral_1h_input_tokens": 64}


def test_anthropic_error_shape():
    body = error_body(OpenAIError(429, "slow down", code="rate_limit_exceeded"))
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert error_body(OpenAIError(503, "busy"))["error"]["type"] == "overloaded_error"
