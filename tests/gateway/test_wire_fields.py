"""Chat and completions on the wire: fields that would change the output are honoured or refused,
never silently dropped (the openai-SDK audit's findings 2 and 3). ``echo`` is refused on chat (OpenAI
has none there) and honoured on completions (test_wire_echo.py); ``verbosity`` is refused on chat as ``text.verbosity`` is on /v1/responses;
``response_format`` is enforced on completions as on chat; ``stream_options`` needs ``stream``.

Against a real ``prefixgate serve --model tiny`` through the openai SDK and raw HTTP. The
random-weight model cannot answer anything, so each check holds for any model: a forced JSON value
parses and validates."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from wire_server import error_of

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Write something"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "Write something", "max_tokens": 2}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


# -- echo ---------------------------------------------------------------------------------------------------


def test_echo_is_refused_on_chat_and_honoured_on_completions(post):
    err = error_of(post("/v1/chat/completions", {**CHAT, "echo": True}), "echo")
    assert err["code"] == "unsupported_parameter"
    assert err["message"] == "echo is not supported on chat completions; use /v1/completions"
    r = post("/v1/completions", {**COMPLETION, "echo": True})  # the rest: test_wire_echo.py
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(COMPLETION["prompt"]), r.text


def test_echo_at_its_default_is_accepted_on_chat_and_must_be_a_boolean(post):
    for echo in (False, None):
        r = post("/v1/chat/completions", {**CHAT, "echo": echo})
        assert r.status_code == 200, r.text
    assert "boolean" in error_of(post("/v1/chat/completions", {**CHAT, "echo": "yes"}), "echo")["message"]


# -- verbosity ----------------------------------------------------------------------------------------------


def test_chat_verbosity_is_refused_as_text_verbosity_is_on_responses(oai, post):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(**CHAT, verbosity="low")
    assert err.value.code == "unsupported_value" and err.value.param == "verbosity"
    chat = error_of(post("/v1/chat/completions", {**CHAT, "verbosity": "high"}), "verbosity")
    responses = error_of(post("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2,
                                                "text": {"verbosity": "high"}}), "text.verbosity")
    assert chat["code"] == responses["code"] == "unsupported_value"
    assert chat["message"].removeprefix("verbosity") == responses["message"].removeprefix("text.verbosity")
    assert oai.chat.completions.create(**CHAT, verbosity="medium").usage.completion_tokens >= 1


# -- response_format on completions -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completions_response_format_json_schema_is_enforced(oai, stream):
    kw = dict(model="tiny", prompt="The answer as JSON:", max_tokens=60, temperature=0,
              extra_body={"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "answer", "schema": SCHEMA}}})
    if stream:
        chunks = list(oai.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        r = oai.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_response_format_json_object_is_enforced(oai):
    plain = oai.completions.create(model="tiny", prompt="Write something", max_tokens=8, temperature=0)
    r = oai.completions.create(model="tiny", prompt="Write something", max_tokens=200, temperature=0,
                               extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{") and not plain.choices[0].text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # any JSON object is allowed, so a random model may run out of tokens inside one
        assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_a_bad_completions_response_format_is_refused_as_on_chat(post, extra, param):
    for path in BODIES:
        error_of(post(path, {**BODIES[path], **extra}), param)


def test_completions_response_format_text_is_plain_text(post):
    r = post("/v1/completions", {**COMPLETION, "temperature": 0, "response_format": {"type": "text"}})
    plain = post("/v1/completions", {**COMPLETION, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


# -- stream_options needs stream --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, None, "absent"])
@pytest.mark.parametrize("path", list(BODIES))
def test_stream_options_without_stream_is_refused(post, path, stream):
    body = {**BODIES[path], "stream_options": {"include_usage": True}}
    if stream != "absent":
        body["stream"] = stream
    err = error_of(post(path, body), "stream_options")
    assert err["message"] == "The 'stream_options' parameter is only allowed when 'stream' is enabled."


def test_the_sdk_gets_the_stream_options_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(**CHAT, stream=False, stream_options={"include_usage": True})
    assert err.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(**COMPLETION, stream_options={"include_usage": True})


@pytest.mark.parametrize("path", list(BODIES))
def test_stream_options_on_a_stream_and_null_without_one_are_accepted(post, path):
    assert post(path, {**BODIES[path], "stream_options": None}).status_code == 200
    streamed = post(path, {**BODIES[path], "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert '"usage"' not in streamed.text  # include_usage: null is the default, false
