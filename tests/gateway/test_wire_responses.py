"""The Responses API on the wire: ``text.format`` enforced and echoed, logprobs, the flat named
``tool_choice``, refusals of fields that would change the output, explicit nulls, the context-length
error's fields, the message item of a cut output, what a 400 names, no blank message next to tool
calls (the gateway audit's findings 1, 3, 4, 9 and 10).

Against a real ``prefixgate serve --model tiny`` through the openai SDK and raw HTTP. The
random-weight model cannot answer anything, so each check holds for any model: a forced JSON value
parses and validates, greedy decoding reruns identically."""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest
from wire_server import error_of, max_model_len

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "population": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}
CLOCK = {"type": "function", "name": "get_time",
         "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                        "required": ["tz"], "additionalProperties": False}}


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=99)


# -- #1 text.format -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_format_is_enforced_and_echoed(oai, stream):
    fmt = {"type": "json_schema", "name": "city", "strict": True, "schema": SCHEMA}
    kw = dict(model="tiny", input="Capital of France as JSON", max_output_tokens=120, temperature=0,
              text={"format": fmt})
    if stream:
        events = list(oai.responses.create(**kw, stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        r = events[-1].response
        assert r.output_text == text
    else:
        r = oai.responses.create(**kw)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city" and r.text.format.schema_ == SCHEMA


def test_parse_with_a_pydantic_text_format(oai):
    r = oai.responses.parse(model="tiny", input="Capital of France?", max_output_tokens=120, temperature=0,
                            text_format=City)
    assert isinstance(r.output_parsed, City)


def test_json_object_format_and_the_plain_text_default(oai):
    r = oai.responses.create(model="tiny", input="JSON please", max_output_tokens=200, temperature=0,
                             text={"format": {"type": "json_object"}})
    assert r.text.format.type == "json_object" and r.output_text.startswith("{")
    if r.status == "completed":  # any object is allowed: a random model may run out of tokens inside one
        assert isinstance(json.loads(r.output_text), dict)
    plain = oai.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert plain.text.format.type == "text"


@pytest.mark.parametrize(("body", "param"), [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "my city", "schema": SCHEMA}}}, "text.format.name"),
    ({"text": {"format": {}}}, "text.format.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["message.output_text.logprobs", "telepathy"]}, "include[1]"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"use_beam_search": True}, "use_beam_search"),  # the chat path's refusals reach this door too
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
])
def test_fields_that_would_change_the_output_are_refused(post, body, param):
    err = error_of(post("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2, **body}), param)
    if param == "tool_choice":  # the message shows the Responses shape, not chat's nested one
        assert '{"type": "function", "name": ...}' in err["message"]


def test_defaults_that_change_nothing_are_accepted(post):
    r = post("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2, "truncation": "disabled",
                               "reasoning": {"effort": None, "summary": None}, "text": {"verbosity": "medium"},
                               "include": ["reasoning.encrypted_content"], "background": False})
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "disabled" and r.json()["text"]["verbosity"] == "medium"


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_with_include_and_top_logprobs(oai, stream):
    kw = dict(model="tiny", input="Say hi", max_output_tokens=4, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    if stream:
        events = list(oai.responses.create(**kw, stream=True))
        streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        r = events[-1].response
    else:
        r = oai.responses.create(**kw)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens == 4
    assert "".join(lp.token for lp in logprobs) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0.0 for lp in logprobs)
    if stream:
        assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    plain = oai.responses.create(model="tiny", input="Say hi", max_output_tokens=4, temperature=0)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text


# -- #3 the flat named tool_choice ------------------------------------------------------------------------


def test_flat_named_tool_choice_forces_that_function(oai):
    r = oai.responses.create(model="tiny", input="What time is it in Paris?", tools=[WEATHER, CLOCK],
                             tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=64,
                             temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), CLOCK["parameters"])
    assert r.tool_choice.name == "get_time"


# -- #10 the message item of an output cut at max_output_tokens -----------------------------------------


def test_a_message_cut_at_max_output_tokens_is_an_incomplete_item(oai):
    r = oai.responses.create(model="tiny", input="Tell me a long story", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.output[0].status == "incomplete"
    events = list(oai.responses.create(model="tiny", input="Tell me a long story", max_output_tokens=3,
                                       temperature=0, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.status == "incomplete" and events[-1].response.output[0].status == "incomplete"


# -- #4 explicit nulls, #9 the context-length error --------------------------------------------------------


def test_an_explicit_null_means_the_default(post):
    r = post("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "store": None, "stream": None})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json") and r.json()["store"] is True


def test_context_length_errors_name_input_and_max_output_tokens(server, post):
    max_len = max_model_len(*server)
    err = error_of(post("/v1/responses", {"model": "tiny", "input": "word " * (max_len + 50)}), "input")
    assert "your input resulted in" in err["message"] and "-" not in err["message"]
    err = error_of(post("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": max_len}),
                   "max_output_tokens")
    assert "in the input" in err["message"] and f"{max_len} in max_output_tokens" in err["message"]


# -- #10 what a 400 names; no blank message item next to tool calls -----------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"input": 5}, "input"),  # not "input.str": pydantic's union member is left out
    ({"stream": "yes"}, "stream"),
    ({"store": "no"}, "store"),
    ({"parallel_tool_calls": 1, "tools": [WEATHER]}, "parallel_tool_calls"),
])
def test_param_is_the_field_the_client_wrote(post, body, param):
    error_of(post("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2, **body}), param)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_grammar_engine_refuses_names_text_format(post, stream):
    unenforceable = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}
    err = error_of(post("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2, "stream": stream,
                                          "text": {"format": {"type": "json_schema", "name": "x",
                                                              "schema": unenforceable}}}), "text.format")
    assert err["code"] == "unenforceable_schema"


@pytest.mark.parametrize("stream", [False, True])
def test_no_blank_message_item_next_to_tool_calls(oai, stream):
    kw = dict(model="tiny", input="Weather and time in Paris?", tools=[WEATHER, CLOCK], tool_choice="required",
              max_output_tokens=256, temperature=0)
    if stream:
        events = list(oai.responses.create(**kw, stream=True))
        assert not [e for e in events if e.type == "response.output_text.delta" and not e.delta.strip()]
        r = events[-1].response
    else:
        r = oai.responses.create(**kw)
    assert [o.type for o in r.output if o.type == "function_call"]
    blank = [o for o in r.output if o.type == "message" and not "".join(c.text for c in o.content).strip()]
    assert not blank, r.output
