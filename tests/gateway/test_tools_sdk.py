"""Tools, structured output, logprobs and logit_bias through the real openai SDK.

Against a real ``prefixgate serve --model tiny`` (real engine, llguidance grammars, real tenancy):
the random-weight model cannot answer anything, so every check here is one that must hold for
any model: forced tool calls and JSON output parse and validate, logprobs have OpenAI's shape,
+100 logit_bias makes greedy emit the token, bad input is a 400.

In process, a scripted engine (text chosen by the test) shows the SDK assembling ``tool_calls``
from the gateway's streamed deltas exactly as from the whole response, for ``tool_choice=auto``.
All greedy or seeded: deterministic.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator

import jsonschema
import openai
import pytest

pytest.importorskip("torch", reason="pip install 'prefixgate[engine]' (torch)")  # `serve --model tiny` runs the real engine

from gateway_fakes import FakeEngine, FakeTenancy, LoopbackServer  # noqa: E402

from engine.protocol import GenerateRequest, RequestOutput  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from gateway.tool_calls import MAX_PARALLEL_CALLS  # noqa: E402
from tests.serverutil import serve_tiny, stop, tenant_key  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 16}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["answer", "confidence", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    home = tmp_path_factory.mktemp("pg-tools")
    key = tenant_key(home, "tools")
    url, proc = serve_tiny(home, "--kv-blocks", "256", timeout=300)
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    finally:
        stop(proc)


def _params(schema: dict) -> dict:
    return schema["function"]["parameters"]


def test_tool_choice_required_gives_a_valid_call_stream_and_whole(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required",
              parallel_tool_calls=False, temperature=0, max_tokens=96)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), _params(tool))
    assert call.id.startswith("call_") and call.type == "function"

    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) >= 2, "the name and the arguments arrive as separate deltas"
    assert deltas[0].function.name == call.function.name and deltas[0].id
    streamed = "".join(d.function.arguments or "" for d in deltas)
    assert streamed == call.function.arguments  # greedy: the same call, streamed in increments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_named_tool_choice_forces_that_function(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), _params(CLOCK))


def test_tool_choice_none_hides_the_tools(client):
    with_tools = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=1)
    hidden = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                            max_tokens=1)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # the template renders tools
    assert hidden.choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, stream):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=128, seed=3,
              temperature=0.8, response_format={"type": "json_schema", "json_schema": {
                  "name": "answer", "strict": True, "schema": SCHEMA}})
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_parses(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # any JSON object is allowed, so a random model may run out of tokens inside one
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_chat_logprobs_shape_stream_and_whole(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert len(e.top_logprobs) == 3 and math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-4)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in content]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_legacy_shape(client):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                            logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_logit_bias_plus_100_makes_greedy_emit_the_token(client):
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    # the token id of some other text: ask for it by biasing a token we read back via logprobs
    biased = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logprobs=0,
                                       logit_bias={"15339": 100})
    tokens = biased.choices[0].logprobs.tokens
    assert len(set(tokens)) == 1 and tokens[0] != first
    again = client.completions.create(model="tiny", prompt="Other words", max_tokens=2, temperature=0, logprobs=0,
                                      logit_bias={"15339": 100})
    assert again.choices[0].logprobs.tokens == tokens[:2]


@pytest.mark.parametrize(("kw", "param"), [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}]),
     "tools[0].function.parameters"),
    (dict(logit_bias={"1": 250}), "logit_bias"),
    (dict(logit_bias={"token": 1}), "logit_bias"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(stream=True, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
])
def test_bad_input_is_a_400_naming_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **kw)
        if kw.get("stream"):
            list(r)
    assert err.value.param == param


def test_logit_bias_token_outside_the_vocabulary_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logit_bias={"999999999": 5})


# ------------------------------------------------------------------ tool_choice=auto, scripted output

SCRIPT = ('I will look it up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "celsius"}}\n</tool_call>')


class ScriptedEngine(FakeEngine):
    """Yields ``SCRIPT`` a few characters at a time, then stops: what a model that follows the
    template's tool-call instructions produces."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        pieces = [SCRIPT[i : i + 5] for i in range(0, len(SCRIPT), 5)]
        for n, piece in enumerate(pieces, 1):
            last = n == len(pieces)
            yield RequestOutput(request.request_id, (n,), piece, last, 10, 0, n,
                                finish_reason="stop" if last else None)


@pytest.fixture(scope="module")
def scripted():
    engine, tenancy = ScriptedEngine(), FakeTenancy()
    key = tenancy.add("acme")
    with LoopbackServer(create_app(GatewaySettings(), engine=engine, tenancy=tenancy)) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0), engine


def test_auto_tool_calls_parsed_whole_and_streamed(scripted):
    client, engine = scripted
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=50)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "I will look it up. "
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    # the tools reached the chat template (the gateway tokenizes once; the engine gets the ids)
    assert engine.tokenized[-1].tools == [WEATHER] and engine.requests[-1].sampling.guided is None

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=50,
                                                 stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == msg.content
    assert "".join(d.function.arguments or "" for d in deltas) == msg.tool_calls[0].function.arguments
    assert len([d for d in deltas if d.function.arguments]) > 1, "arguments arrive in increments"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_same_text_is_plain_content(scripted):
    client, _ = scripted
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=50)
    assert r.choices[0].message.content == SCRIPT and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


NOT_ENFORCEABLE = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_schema_the_grammar_engine_refuses_is_a_400_before_the_stream_starts(client, stream, where):
    """Valid JSON Schema that llguidance cannot enforce (``not``): refused when the grammar is
    compiled at admission, so a stream gets the 400 as its status line, never an error event
    after a 200 (the SDK raises from ``create`` itself, before any chunk is read)."""
    kw: dict = (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": NOT_ENFORCEABLE}})
                if where == "response_format" else
                dict(tools=[{"type": "function", "function": {"name": "f", "parameters": NOT_ENFORCEABLE}}],
                     tool_choice="required"))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=stream, **kw)
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert body["param"] == where and body["code"] == "unenforceable_schema"  # the field the schema came from
    assert "cannot be enforced" in body["message"] and '"not"' in body["message"]
    assert "\n" not in body["message"] and "x-guidance" not in body["message"]  # one line, no grammar dump
    # the same schema again: refused again (from the cached refusal), and the server keeps serving
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=stream, **kw)
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


# ------------------------------------------------------------------ forced calls end; grammar dead ends

def test_required_with_parallel_calls_ends_within_the_bound(client):
    """Parallel calls allowed (the SDK's default): whatever this random model does, the turn is one
    to MAX_PARALLEL_CALLS valid calls ending with "tool_calls", never a run to max_tokens (the
    grammar was ``item+``: unbounded, so a model that never chose EOS ran to "length")."""
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                       tool_choice="required", temperature=0, max_tokens=512)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), _params(tool))


RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}


def _json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_schema_without_a_finite_value_is_a_400_naming_its_field(client, stream, where):
    """Audit finding 8: this schema compiles, but every value is ``{"c":{"c":...`` without end; it
    was answered 200 with ``{"`` and finish_reason "stop". The grammar's forced start now fails at
    admission: a 400 before the stream starts, naming the field the schema came from."""
    kw = (_json_schema(RECURSIVE) if where == "response_format" else
          dict(tools=[{"type": "function", "function": {"name": "f", "parameters": RECURSIVE}}], tool_choice="required"))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, stream=stream, **kw)
    assert err.value.param == where and err.value.code == "unenforceable_schema"
    assert "refers back to its own object" in err.value.message


def test_a_grammar_dead_end_mid_output_is_an_error_not_a_stop(client, tiny_model_dir):
    """An integer, or the endless object: the schema compiles and its start is free; +100 on ``{``
    makes the model take the object, where the grammar dead-ends (its mask allows only EOS). A
    whole response is a 400 naming response_format; a stream, already 200, ends with the in-band
    error event; never finish_reason "stop" with invalid JSON."""
    from transformers import AutoTokenizer

    brace = AutoTokenizer.from_pretrained(tiny_model_dir).encode("{", add_special_tokens=False)[0]
    schema = {"$defs": RECURSIVE["$defs"], "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/n"}]}
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0, logit_bias={str(brace): 100},
              **_json_schema(schema))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kw)
    assert err.value.param == "response_format" and err.value.code == "unenforceable_schema"
    assert "cannot continue" in err.value.message

    text = ""
    with pytest.raises(openai.APIError) as err:
        for chunk in client.chat.completions.create(**kw, stream=True):
            assert not chunk.choices or chunk.choices[0].finish_reason is None
            text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text.startswith("{") and err.value.code == "unenforceable_schema"
    assert err.value.body["param"] == "response_format"
