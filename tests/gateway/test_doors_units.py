"""The doors' translations to chat and the Anthropic usage arithmetic (no server, no engine)."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.protocol import RequestOutput
from gateway.anthropic_api import CacheUsage, MessagesFormat, MessagesRequest, chat_body, error_body
from gateway.door import chat_request
from gateway.errors import OpenAIError
from gateway.formats import ChoiceText
from gateway.pipeline import Prepared
from gateway.responses_api import (
    ResponsesFormat,
    ResponsesRequest,
    conversation_after,
    input_messages,
    resumed,
)
from gateway.responses_api import chat_body as responses_chat_body
from gateway.routing import Backend, BackendKind


def test_responses_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo and Rome?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": {"sky": "sun"}},
    ]})
    turns = input_messages(req)
    msgs = turns.messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert [s.path for s in turns.sources] == ["input[0]", "input[1]", "input[3]", "input[4]"]
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


CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[1].call_id"),
    ({"type": "function_call", "call_id": "c1", "arguments": "{}"}, "input[1].name"),
    ({**CALL, "arguments": {"a": 1}}, "input[1].arguments"),
    ({"type": "function_call_output", "output": "x"}, "input[1].call_id"),
    ({"type": "function_call_output", "call_id": "c2", "output": "x"}, "input[1].call_id"),
])
def test_responses_call_items_must_pair_up_as_chat_requires(item, param):
    """function_call items carry OpenAI's required strings, and an output answers a call made before
    (in this input or the stored conversation): the chat request they become is then valid."""
    with pytest.raises(OpenAIError) as exc:
        input_messages(ResponsesRequest.model_validate({"model": "m", "input": [{"role": "user", "content": "x"},
                                                                                 item, CALL]}))
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def test_responses_output_may_answer_a_call_of_the_stored_conversation():
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    req = ResponsesRequest.model_validate({"model": "m", "input": [
        {"type": "function_call_output", "call_id": "c9", "output": "42"}]})
    assert input_messages(req, history).messages == [{"role": "tool", "tool_call_id": "c9", "content": "42"}]


def test_an_empty_output_is_continued_as_empty_text():
    """A response of no text and no calls is stored as an assistant turn of "" (chat refuses a turn of
    neither content nor tool calls); a row stored with None before that reads as "" too."""
    stored = conversation_after([{"role": "user", "content": "x"}], [
        {"type": "message", "content": [{"type": "output_text", "text": ""}]}])
    assert stored[-1] == {"role": "assistant", "content": ""}
    old = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]
    follow = [*resumed(old), {"role": "user", "content": "again?"}]
    assert chat_request({"model": "m", "messages": follow}).messages[1].content == ""
    called = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert resumed(called) == called


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
    # the gateway's param is OpenAI's (brackets); Anthropic's messages name the field dotted
    named = error_body(OpenAIError(400, "bad part", param="messages[1].content[0].type"))
    assert named["error"]["message"] == "messages.1.content.0.type: bad part"


def _tool_prep() -> Prepared:
    """A local-engine request whose tools are parsed out of the model's text (gateway.tool_calls)."""
    return Prepared(kind="chat", request_id="resp_x", created=0, model="tiny",
                    backend=Backend("local", BackendKind.LOCAL, None, "tiny"),  # type: ignore[arg-type]
                    requests=[], n=1, stream=True, include_usage=False, canon_applied=(), tenant=None,
                    tool_parsing=True)


_CALL_TEXT = ['Let me check. <tool_', 'call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']


def _outputs() -> list[RequestOutput]:
    return [RequestOutput("r", (1,), _CALL_TEXT[0], False, 10, 0, 1),
            RequestOutput("r", (2,), _CALL_TEXT[1], True, 10, 0, 2, finish_reason="stop")]


def test_responses_stream_parses_local_tool_calls_out_of_the_text():
    stored: list[dict] = []

    async def keep(response: dict) -> None:
        stored.append(response)

    fmt = ResponsesFormat(_tool_prep(), ResponsesRequest(model="tiny", input="weather?"), keep)
    events = [e for out in _outputs() for e in fmt.chunks(0, out)]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert "<tool" not in text and text.strip() == "Let me check."
    fmt.tail({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
              "prompt_tokens_details": {"cached_tokens": 0}})
    assert not stored  # kept in finalize, which the responder awaits before sending the tail
    asyncio.run(fmt.finalize())
    calls = [item for item in stored[0]["output"] if item["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_messages_whole_and_stream_turn_local_tool_calls_into_tool_use_blocks():
    usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 0}}
    acc = ChoiceText(_tool_prep())
    for out in _outputs():
        acc.add(0, out)
    whole = MessagesFormat(_tool_prep(), written_upto=0, long_upto=0).whole(acc, usage)
    assert whole["stop_reason"] == "tool_use"
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][1]["name"] == "get_weather" and whole["content"][1]["input"] == {"city": "Paris"}
    fmt = MessagesFormat(_tool_prep(), written_upto=0, long_upto=0)
    events = [e for out in _outputs() for e in fmt.chunks(0, out)]
    streamed = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert "<tool" not in streamed
    tail = b"".join(fmt.tail(usage)).decode()
    assert '"tool_use"' in tail and "get_weather" in tail
    # the stream kept its tool calls for the tail, not its text or logprobs (sent as they came)
    assert fmt.acc.tool_deltas[0] and not fmt.acc.text[0] and not fmt.acc.logprobs[0]


def test_an_unstored_chat_stream_keeps_nothing_that_grows_and_a_stored_one_keeps_its_completion():
    from gateway.formats import ChatFormat, StoredChatFormat

    fmt = ChatFormat(_tool_prep())
    chunks = [c for out in _outputs() for c in fmt.chunks(0, out)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me check."
    names = [call["function"]["name"] for d in deltas for call in d.get("tool_calls", []) if "name" in call["function"]]
    assert names == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not fmt.acc.text[0] and not fmt.acc.tool_deltas[0] and not fmt.acc.logprobs[0]  # parsed, not kept

    async def keep(completion: dict) -> None:
        raise AssertionError("not reached: the stream has no tail here")

    kept = StoredChatFormat(_tool_prep(), keep)
    for out in _outputs():
        kept.chunks(0, out)
    assert "".join(kept.acc.text[0]).strip() == "Let me check."  # what the stored completion is built from
    assert [c["function"]["name"] for c in kept.acc.tool_calls(0)] == ["get_weather"]


def test_a_providers_streamed_tool_call_deltas_pass_through_and_an_engines_plain_text_has_none():
    from gateway.upstream import ProviderOutput

    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city"'}}
    more = {"index": 0, "function": {"arguments": ': "Oslo"}'}}
    acc = ChoiceText()  # no tool parsing: a provider parses its own calls
    first = acc.add(0, ProviderOutput("r", (), "", False, 10, 0, 1, tool_call_deltas=(call,)))
    acc.add(0, ProviderOutput("r", (), "", True, 10, 0, 2, finish_reason="tool_calls", tool_call_deltas=(more,)))
    assert first.tool_calls == [call]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in acc.tool_calls(0)] == [
        ("get_weather", '{"city": "Oslo"}')]
    plain = ChoiceText().add(0, RequestOutput("r", (1,), "<tool_call>", True, 10, 0, 1, finish_reason="stop"))
    assert plain.tool_calls == [] and plain.content == "<tool_call>"
