"""Chat and completions on the wire: what a 400 names (the gateway audit's finding 10). The engine's
refusals name the field at fault with a code of their own; logit_bias keys are canonical token ids;
``param`` is the path the client wrote, without pydantic's union members; an assistant's earlier
``refusal`` part is history, not an error; a response format says its type and a JSON schema's name
follows OpenAI's rule; booleans are JSON booleans.

Against a real ``prefixgate serve --model tiny`` through the openai SDK and raw HTTP. The
random-weight model cannot answer anything, so each check holds for any model: greedy decoding
reruns identically."""

from __future__ import annotations

import openai
import pytest
from wire_server import FORCED, error_of

from engine.models.tiny import TINY_DIMS

VOCAB = TINY_DIMS["vocab_size"]  # the first token id outside the vocabulary
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Write something"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "Write something", "max_tokens": 2}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


# -- the engine's refusals name their field ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_logit_bias_id_outside_the_vocabulary_is_a_400_naming_logit_bias(post, path, stream):
    err = error_of(post(path, {**BODIES[path], "stream": stream, "logit_bias": {str(VOCAB): 5}}), "logit_bias")
    assert err["code"] == "invalid_value" and f"token id {VOCAB} is outside the vocabulary" in err["message"]


def test_the_sdk_reads_the_engine_refusals_field_and_code(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(**CHAT, logit_bias={str(VOCAB + 7): -100})
    assert err.value.param == "logit_bias" and err.value.code == "invalid_value"


@pytest.mark.parametrize(("prompt", "code"), [([1, VOCAB], "invalid_value"), ([[5], [VOCAB + 1]], "invalid_value"),
                                              ("", "empty_prompt"), ([], "empty_prompt")])
def test_a_prompt_the_engine_cannot_run_is_a_400_naming_prompt(post, prompt, code):
    err = error_of(post("/v1/completions", {**COMPLETION, "prompt": prompt}), "prompt")
    assert err["code"] == code, err


# -- logit_bias keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [" 12 ", "1_0", "+5", "012", "-1", "1e3", "12.0", "", "\u0661\u0662", "0x1f"])
def test_a_logit_bias_key_that_is_not_a_canonical_token_id_is_refused(post, key):
    err = error_of(post("/v1/completions", {**COMPLETION, "logit_bias": {key: 1}}), "logit_bias")
    assert err["code"] == "invalid_value" and repr(key) in err["message"]


def test_canonical_logit_bias_keys_are_honoured(oai):
    r = oai.completions.create(**COMPLETION, temperature=0, logit_bias={str(FORCED): 100, "0": -100})
    forced = oai.completions.create(**COMPLETION, temperature=0, logit_bias={str(FORCED): 100})
    assert r.choices[0].text == forced.choices[0].text and r.usage.completion_tokens == 2


# -- param is the path the client wrote ---------------------------------------------------------------------


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"stop": 5}, "stop"),
    ("/v1/chat/completions", {"tool_choice": 5}, "tool_choice"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
])
def test_param_has_no_union_member_in_it(post, path, extra, param):
    err = error_of(post(path, {**BODIES[path], **extra}), param)
    assert f"'{param}'" in err["message"] and "str" not in err["message"].split(":")[0]


# -- an assistant's refusal part ------------------------------------------------------------------------------


REFUSED = "I cannot help with that."


def _history(assistant_content: object) -> list[dict[str, object]]:
    return [{"role": "user", "content": "Pick a lock for me"}, {"role": "assistant", "content": assistant_content},
            {"role": "user", "content": "Why not?"}]


def test_an_assistant_refusal_part_is_rendered_as_its_text(oai):
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    as_part = oai.chat.completions.create(**kw, messages=_history([{"type": "refusal", "refusal": REFUSED}]))
    as_text = oai.chat.completions.create(**kw, messages=_history(REFUSED))
    assert as_part.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_part.choices[0].message.content == as_text.choices[0].message.content
    mixed = oai.chat.completions.create(**kw, messages=_history([{"type": "text", "text": "I cannot "},
                                                                 {"type": "refusal", "refusal": "help with that."}]))
    assert mixed.usage.prompt_tokens == as_text.usage.prompt_tokens


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": [{"type": "refusal", "refusal": REFUSED}]}], "messages[0].content[0].type"),
    (_history([{"type": "refusal", "refusal": 5}]), "messages[1].content"),
    (_history([{"type": "refusal"}]), "messages[1].content"),
    (_history([{"type": "input_audio", "input_audio": {}}]), "messages[1].content[0].type"),
])
def test_refusal_parts_outside_an_assistants_history_are_refused(post, messages, param):
    error_of(post("/v1/chat/completions", {**CHAT, "messages": messages}), param)


# -- response_format ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "param"), [
    ({}, "response_format.type"),
    ({"type": None}, "response_format.type"),
    ({"json_schema": {"name": "x", "schema": {"type": "object"}}}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "my schema", "schema": {"type": "object"}}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {"type": "object"}}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "", "schema": {"type": "object"}}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name"),
])
def test_a_response_format_without_type_or_with_a_bad_name_is_refused(post, fmt, param):
    err = error_of(post("/v1/chat/completions", {**CHAT, "response_format": fmt}), param)
    assert err["code"] == "invalid_value"


def test_a_schema_name_of_openais_characters_is_accepted(oai):
    r = oai.chat.completions.create(**{**CHAT, "max_tokens": 40}, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "Answer_2-b" + "x" * 54, "schema": {"type": "object"}}})
    assert r.choices[0].message.content.startswith("{")


# -- booleans are JSON booleans ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"stream": "true"}, "stream"),
    ("/v1/chat/completions", {"stream": 1}, "stream"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "on"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {"parallel_tool_calls": 0}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"ignore_eos": "false"}, "ignore_eos"),
    ("/v1/completions", {"echo": "false"}, "echo"),
    ("/v1/completions", {"stream": "no"}, "stream"),
])
def test_a_boolean_field_takes_only_true_false_or_null(post, path, extra, param):
    err = error_of(post(path, {**BODIES[path], **extra}), param)
    assert err["code"] == "invalid_value" and "boolean" in err["message"]


def test_real_booleans_are_accepted(post):
    r = post("/v1/chat/completions", {**CHAT, "stream": False, "logprobs": False, "parallel_tool_calls": True,
                                      "ignore_eos": False, "echo": False})
    assert r.status_code == 200, r.text
    r = post("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    r = post("/v1/completions", {**COMPLETION, "echo": False, "stream": False})
    assert r.status_code == 200, r.text


# -- a refused parameter carries OpenAI's code ---------------------------------------------------------------

RESPONSES = {"model": "tiny", "input": "Write something", "max_output_tokens": 2}


@pytest.mark.parametrize(("path", "extra", "param", "code"), [
    ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search", "unsupported_parameter"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort", "unsupported_parameter"),
    ("/v1/chat/completions", {"truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "unsupported_parameter"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities", "unsupported_value"),
    ("/v1/chat/completions", {"echo": True}, "echo", "unsupported_parameter"),
    ("/v1/completions", {"suffix": "end"}, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"best_of": 3}, "best_of", "unsupported_value"),
    ("/v1/responses", {"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
    ("/v1/responses", {"background": True}, "background", "unsupported_parameter"),
    ("/v1/responses", {"truncation": "auto"}, "truncation", "unsupported_value"),
    ("/v1/responses", {"text": {"verbosity": "low"}}, "text.verbosity", "unsupported_value"),
    ("/v1/responses", {"guided_regex": "a+"}, "guided_regex", "unsupported_parameter"),
])
def test_a_refused_parameter_carries_openais_code(post, path, extra, param, code):
    body = {**BODIES, "/v1/responses": RESPONSES}[path]
    assert error_of(post(path, {**body, **extra}), param)["code"] == code


def test_the_sdk_reads_unsupported_parameter(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(**CHAT, reasoning_effort="high")
    assert err.value.code == "unsupported_parameter" and err.value.param == "reasoning_effort"


def test_penalties_are_served_in_openais_range(oai):
    """presence / frequency penalties are honoured (tests/engine_core/test_penalties.py checks the tokens);
    outside OpenAI's [-2, 2] they are a 400 naming the field."""
    out = oai.chat.completions.create(**CHAT, presence_penalty=0.5, frequency_penalty=-0.5)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert oai.completions.create(**COMPLETION, presence_penalty=2, frequency_penalty=2).choices
    for field in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(**CHAT, **{field: 2.5})
        assert err.value.param == field
