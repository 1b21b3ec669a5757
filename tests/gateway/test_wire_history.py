"""Conversation histories on the wire (the openai-SDK audit's finding 4): what OpenAI refuses in
``messages`` is a 400 naming the field, never a 200 that rendered something the client did not send
or a chat template's "Object of type Undefined" wording; the Responses and Messages doors translate
their items into histories that hold under the same rules, and name their own fields.

Against a real ``prefixgate serve --model tiny`` through the openai and anthropic SDKs and raw HTTP.
A forced tool call (``tool_choice: required``) gives a real call id to answer, whatever the model."""

from __future__ import annotations

import anthropic
import openai
import pytest
from wire_server import error_of

USER = {"role": "user", "content": "What time is it?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
PREFIX_RULE = "must be a response to a preceeding message with 'tool_calls'"  # OpenAI's words


def _chat(post, messages):
    return post("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": messages})


# -- chat: what OpenAI refuses in a history -----------------------------------------------------------------


@pytest.mark.parametrize(("messages", "param", "code"), [
    ([USER, ASKED, {"role": "tool", "content": "12:00"}], "messages[2].tool_call_id", "missing_required_parameter"),
    ([{"role": "user", "content": None}], "messages[0].content", "missing_required_parameter"),
    ([{"role": "system", "content": None}, USER], "messages[0].content", "missing_required_parameter"),
    ([USER, {"role": "assistant"}, USER], "messages[1].content", "missing_required_parameter"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": []}, USER], "messages[1].content",
     "missing_required_parameter"),
    ([USER, ASKED, {"role": "tool", "tool_call_id": "call_1"}], "messages[2].content", "missing_required_parameter"),
    ([USER, {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], "messages[1].tool_call_id",
     "invalid_value"),
    ([USER, ASKED, {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}], "messages[2].tool_call_id",
     "invalid_value"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "12:00"}, ASKED], "messages[0].tool_call_id",
     "invalid_value"),  # an answer before its call
])
def test_a_history_openai_refuses_is_a_400_naming_the_field(post, messages, param, code):
    err = error_of(_chat(post, messages), param)
    assert err["code"] == code, err
    if param.endswith("tool_call_id") and code == "invalid_value":
        assert PREFIX_RULE in err["message"]


@pytest.mark.parametrize(("call", "param"), [
    ({"foo": 1}, "messages[1].tool_calls[0].id"),
    ({**CALL, "type": "custom"}, "messages[1].tool_calls[0].type"),
    ({"id": "call_1", "type": "function"}, "messages[1].tool_calls[0].function"),
    ({**CALL, "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
    ({**CALL, "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}, "messages[1].tool_calls[0].function.arguments"),
    ({**CALL, "id": 7}, "messages[1].tool_calls[0].id"),
])
def test_a_malformed_tool_call_names_its_field(post, call, param):
    err = error_of(_chat(post, [USER, {"role": "assistant", "tool_calls": [call]}, USER]), param)
    assert "Undefined" not in err["message"] and "template" not in err["message"]


def test_the_sdk_reads_a_history_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", max_tokens=2, messages=[
            USER, {"role": "tool", "tool_call_id": "nope", "content": "12:00"}])
    assert err.value.param == "messages[1].tool_call_id" and PREFIX_RULE in err.value.message


def test_a_well_formed_tool_conversation_is_served(oai):
    r = oai.chat.completions.create(model="tiny", max_tokens=2, tools=[CLOCK], messages=[
        USER, ASKED, {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "And in CET?"}])
    assert r.usage.prompt_tokens > 0
    forced = oai.chat.completions.create(model="tiny", max_tokens=40, temperature=0, tools=[CLOCK],
                                         tool_choice="required", messages=[USER])
    made = forced.choices[0].message
    answered = oai.chat.completions.create(model="tiny", max_tokens=2, tools=[CLOCK], messages=[
        USER, made.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "12:00"} for c in made.tool_calls)])
    assert answered.usage.prompt_tokens > forced.usage.prompt_tokens


# -- the Responses door: its items, its names -------------------------------------------------------------


def _respond(post, items, **extra):
    return post("/v1/responses", {"model": "tiny", "max_output_tokens": 2, "input": items, **extra})


def test_responses_name_their_own_items_not_chat_messages(post):
    image = {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}
    err = error_of(_respond(post, [{"role": "user", "content": "Hi"}, image], instructions="Be brief."),
                   "input[1].content[1].type")
    assert "'input_image'" in err["message"] and "image_url" not in err["message"]
    orphan = {"type": "function_call_output", "call_id": "call_9", "output": "12:00"}
    err = error_of(_respond(post, [{"role": "user", "content": "Hi"}, orphan]), "input[1].call_id")
    assert "call_9" in err["message"]
    err = error_of(_respond(post, [{"type": "function_call", "name": "get_time", "arguments": "{}"}]),
                   "input[0].call_id")
    assert err["code"] == "missing_required_parameter"


def test_a_responses_output_answers_the_call_of_the_previous_response(oai):
    tool = {"type": "function", "name": "get_time", "parameters": CLOCK["function"]["parameters"]}
    first = oai.responses.create(model="tiny", input="What time is it?", tools=[tool], tool_choice="required",
                                 max_output_tokens=40, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    follow = oai.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=2, tools=[tool],
                                  input=[{"type": "function_call_output", "call_id": c.call_id, "output": "12:00"}
                                         for c in calls])
    assert follow.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=2, tools=[tool],
                             input=[{"type": "function_call_output", "call_id": "call_other", "output": "12:00"}])
    assert err.value.param == "input[0].call_id"


# -- the Messages door ------------------------------------------------------------------------------------


def test_messages_tool_results_answer_a_tool_use_and_an_empty_turn_is_text(server):
    url, key = server
    claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"tz": "UTC"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}
    r = claude.messages.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": "Time?"}, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]}, {"role": "assistant", "content": []},
        {"role": "user", "content": "Thanks"}])
    assert r.usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{**result, "tool_use_id": "toolu_9"}]}])
    assert err.value.body["error"]["message"].startswith("messages.0.content.0.tool_use_id: unexpected `tool_use_id`")
