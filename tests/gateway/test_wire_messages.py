"""Anthropic's Messages API on the wire: ``stop_reason: "stop_sequence"`` with the sequence that matched,
``disable_parallel_tool_use``, ``top_k``, an explicit ``stream: null`` (the gateway audit's findings 4-6),
``stream`` a JSON boolean and no blank text block next to tool calls (finding 10).

Against a real ``prefixgate serve --model tiny`` through the anthropic SDK. The random-weight model
cannot answer anything: the stop sequence is cut from its own greedy answer, which reruns identically."""

from __future__ import annotations

import anthropic
import pytest
from wire_server import poster

from gateway.anthropic_api import MessagesRequest, chat_body

CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                                              "required": ["tz"], "additionalProperties": False}}
GREEDY = {"temperature": 0}  # sent as extra_body: this SDK's create() takes no temperature argument


@pytest.fixture(scope="module")
def claude(server):
    url, key = server
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def test_messages_report_the_stop_sequence_that_ended_the_answer(claude):
    kw = dict(model="tiny", max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": "Capital of France?"}])
    full = claude.messages.create(**kw).content[0].text
    stop_at = full[8:12]
    cut = full[:full.index(stop_at)]
    r = claude.messages.create(**kw, stop_sequences=["never-in-the-output", stop_at])
    assert r.content[0].text == cut and r.stop_reason == "stop_sequence" and r.stop_sequence == stop_at
    with claude.messages.stream(**kw, stop_sequences=["never-in-the-output", stop_at]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == cut and final.stop_reason == "stop_sequence" and final.stop_sequence == stop_at
    plain = claude.messages.create(**{**kw, "max_tokens": 3})
    assert plain.stop_reason == "max_tokens" and plain.stop_sequence is None


@pytest.mark.parametrize("kind", ["any", "auto", "tool"])
def test_disable_parallel_tool_use_is_parallel_tool_calls_false(kind):
    choice = {"type": kind, "disable_parallel_tool_use": True} | ({"name": "get_time"} if kind == "tool" else {})
    req = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, "tools": [CLOCK], "tool_choice": choice,
                                          "messages": [{"role": "user", "content": "Time?"}]})
    assert chat_body(req)["parallel_tool_calls"] is False
    allowed = req.model_copy(update={"tool_choice": {"type": kind, "disable_parallel_tool_use": False}})
    assert chat_body(allowed)["parallel_tool_calls"] is True


@pytest.mark.parametrize("kind", [["any"], {"type": "any"}, 3, None])
def test_a_tool_choice_type_that_is_not_a_string_is_a_400_not_a_500(server, kind):
    r = poster(*server)("/v1/messages", {"model": "tiny", "max_tokens": 2, "tools": [CLOCK], "tool_choice": {"type": kind},
                                         "messages": [{"role": "user", "content": "Time?"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "tool_choice" in r.json()["error"]["message"]


def test_disable_parallel_tool_use_gives_one_call(claude):
    r = claude.messages.create(model="tiny", max_tokens=200, extra_body=GREEDY, tools=[CLOCK],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": "What time is it in UTC?"}])
    calls = [b for b in r.content if b.type == "tool_use"]
    assert len(calls) == 1 and r.stop_reason == "tool_use"


def test_messages_top_k_is_honoured(claude):
    kw = dict(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Write something"}])
    greedy = claude.messages.create(**kw, extra_body=GREEDY).content[0].text
    assert claude.messages.create(**kw, extra_body={"temperature": 1.0, "top_k": 1}).content[0].text == greedy


def test_an_explicit_stream_null_means_not_streamed(server):
    r = poster(*server)("/v1/messages", {"model": "tiny", "max_tokens": 2, "stream": None,
                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json") and r.json()["type"] == "message"


def test_a_stream_that_is_not_a_boolean_is_refused(server):
    r = poster(*server)("/v1/messages", {"model": "tiny", "max_tokens": 2, "stream": "yes",
                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"].startswith("stream")


@pytest.mark.parametrize("stream", [False, True])
def test_no_blank_text_block_next_to_tool_calls(claude, stream):
    kw = dict(model="tiny", max_tokens=256, extra_body=GREEDY, tools=[CLOCK], tool_choice={"type": "any"},
              messages=[{"role": "user", "content": "What time is it in UTC and in CET?"}])
    if stream:
        with claude.messages.stream(**kw) as events:
            r = events.get_final_message()
    else:
        r = claude.messages.create(**kw)
    assert r.stop_reason == "tool_use" and [b for b in r.content if b.type == "tool_use"]
    assert not [b for b in r.content if b.type == "text" and not b.text.strip()], r.content
