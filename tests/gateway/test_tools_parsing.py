"""Tool-call parsing, tool_choice planning and response_format checks (pure gateway units)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.errors import OpenAIError
from gateway.pipeline import local_features
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.structured_output import guided_for_response_format
from gateway.tool_calls import (
    MAX_PARALLEL_CALLS,
    TOOL_END,
    TOOL_START,
    ToolCallParser,
    merge_tool_deltas,
    plan_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

OUTPUT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", "days": [1,2]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def parse(text: str, step: int) -> tuple[str, list[dict], list[dict]]:
    p = ToolCallParser()
    content, deltas = "", []
    for i in range(0, len(text), step):
        d = p.feed(text[i : i + step])
        content += d.content
        deltas += d.tool_calls
    d = p.finish()
    return content + d.content, deltas, merge_tool_deltas(deltas)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 64, 10_000])
def test_streamed_pieces_give_the_same_calls_as_the_whole_text(step):
    content, deltas, calls = parse(OUTPUT, step)
    assert content == "Let me check. "  # the newline between the calls is layout, not content
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Pa}r"is', "days": [1, 2]}
    # the arguments are the model's own text, byte for byte, whatever the split
    assert calls[0]["function"]["arguments"] == '{"city": "Pa}r\\"is", "days": [1,2]}'
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    # the first delta of each call carries id and name; later ones only argument text
    headers = [d for d in deltas if "id" in d]
    assert [h["index"] for h in headers] == [0, 1] and all(h["function"]["arguments"] == "" for h in headers)


def test_arguments_stream_before_the_closing_tag():
    p = ToolCallParser()
    first = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert first.tool_calls[0]["function"]["name"] == "get_weather"
    assert first.tool_calls[1]["function"]["arguments"] == '{"city": "Par'
    more = p.feed('is"}}')
    assert more.tool_calls == [{"index": 0, "function": {"arguments": 'is"}'}}]
    assert p.feed("\n" + TOOL_END).tool_calls == [] and p.called


def test_text_that_only_looks_like_a_tag_stays_content():
    content, _, calls = parse("a <tool and <tool_cal then 5 < 6", 1)
    assert content == "a <tool and <tool_cal then 5 < 6" and calls == []
    content, _, calls = parse(TOOL_START + "not json" + TOOL_END + " after", 3)
    assert calls == [] and content == TOOL_START + "not json" + TOOL_END + " after"


def test_unclosed_call_at_the_end_still_counts_when_it_parses():
    content, _, calls = parse(TOOL_START + '\n{"name": "get_time", "arguments": {}}', 4)
    assert content == "" and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_other_layouts_are_parsed_when_the_call_closes():
    text = TOOL_START + '{"arguments": {"city": "Oslo"}, "name": "get_weather"}' + TOOL_END
    _, _, calls = parse(text, 2)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    text = TOOL_START + '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}' + TOOL_END
    _, _, calls = parse(text, 3)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("step", [1, 2, 3, 5, 64, 10_000])
def test_a_closing_tag_inside_an_argument_string_is_text(step):
    """Only a tag outside a JSON string ends a call: an argument may mention ``</tool_call>``."""
    args = '{"html": "a </tool_call> b \\" </tool_call", "n": 1}'
    text = f'{TOOL_START}\n{{"name": "get_time", "arguments": {args}}}\n{TOOL_END}\n{TOOL_START}\n' \
           f'{{"name": "get_time", "arguments": {{}}}}\n{TOOL_END}'
    content, _, calls = parse(text, step)
    assert content == ""
    assert [c["function"]["arguments"] for c in calls] == [args, "{}"]
    assert json.loads(calls[0]["function"]["arguments"])["html"] == 'a </tool_call> b " </tool_call'


def test_a_closing_tag_after_invalid_json_still_ends_the_call():
    """Unbalanced JSON (or an unclosed string, which a raw newline ends) does not swallow the tag
    and the text after it: the call ends there (its name was out already, so it counts, with the
    arguments as written), and what follows is content as before."""
    for body in ('{"name": "f", "arguments": {"a": 1}', '{"name": "f", "arguments": {"a": "x}}'):
        content, _, calls = parse(f"{TOOL_START}\n{body}\n{TOOL_END} done", 3)
        assert content == " done" and [c["function"]["name"] for c in calls] == ["f"]
    content, _, calls = parse(f'{TOOL_START}\n{{"oops": "x}}\n{TOOL_END} done', 3)  # not a call at all
    assert calls == [] and content == f'{TOOL_START}\n{{"oops": "x}}\n{TOOL_END} done'


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_whitespace_between_and_around_calls_is_not_content(step):
    call = f'{TOOL_START}\n{{"name": "get_time", "arguments": {{}}}}\n{TOOL_END}'
    content, _, calls = parse(f"\n{call}\n\n{call}\n", step)
    assert content == "" and len(calls) == 2
    content, _, calls = parse(f"{call}\nDone.", step)  # text after a call keeps its leading newline
    assert content == "\nDone." and len(calls) == 1
    assert parse(" \n ", step)[0] == " \n "  # no call: the output is unchanged


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_an_output_cut_inside_a_tag_leaves_no_content(step):
    """A length cut while the model writes a tag, or a call before its name is complete: that text
    is the start of a call, not an answer (it was flushed as content: audit finding 2)."""
    call = f'{TOOL_START}\n{{"name": "get_time", "arguments": {{}}}}\n{TOOL_END}'
    for cut in (f"{call}\n<tool_c", f"{call}\n{TOOL_START}\n{{\"na", f"{call}\n{TOOL_START}"):
        content, _, calls = parse(cut, step)
        assert content == "" and len(calls) == 1, cut
    content, _, calls = parse("Let me look. <tool_ca", step)  # tool_choice auto: the same
    assert content == "Let me look. " and calls == []
    content, _, calls = parse(call[:-3], step)  # cut inside the closing tag: the call still counts
    assert content == "" and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_tool_choice_plans():
    assert plan_tools(None, None, None).tools is None
    none = plan_tools([WEATHER], "none", None)
    assert none.tools is None and not none.parse and none.guided is None
    auto = plan_tools([WEATHER], None, None)
    assert auto.tools == [WEATHER] and auto.parse and auto.guided is None
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.parse and named.guided is not None and named.guided.max_items == 1
    schema = json.loads(named.guided.json_schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, schema)
    required = plan_tools([WEATHER, TIME], "required", None)
    assert required.guided.prefix == TOOL_START + "\n" and required.guided.suffix == "\n" + TOOL_END
    # several calls, bounded, one newline between two (none after the last: the turn may end there)
    assert required.guided.max_items == MAX_PARALLEL_CALLS and required.guided.separator == "\n"
    assert plan_tools([WEATHER, TIME], "required", False).guided.max_items == 1


def test_tool_refs_are_renamed_under_one_root():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}
    schema = json.loads(plan_tools([tool], "required", False).guided.json_schema)
    jsonschema.validate({"name": "f", "arguments": {"p": 3}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {"p": "x"}}, schema)


@pytest.mark.parametrize(("tools", "choice", "param", "match"), [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not in tools"),
    (None, "required", "tool_choice", "only allowed when tools"),
    ([WEATHER], "sometimes", "tool_choice", "must be"),
    ([{"type": "retrieval"}], "auto", "tools", "type 'function'"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools", "1-64 characters"),
    ([WEATHER, WEATHER], "auto", "tools", "unique"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}], "auto",
     "tools[0].function.parameters", "not a valid JSON Schema"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, param, match):
    with pytest.raises(OpenAIError) as err:
        plan_tools(tools, choice, None)
    assert err.value.status == 400 and err.value.param == param and match in str(err.value)


def test_response_format():
    assert guided_for_response_format(None) is None
    assert guided_for_response_format({"type": "text"}) is None
    assert json.loads(guided_for_response_format({"type": "json_object"}).json_schema) == {"type": "object"}
    spec = guided_for_response_format({"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
    assert json.loads(spec.json_schema)["properties"] == {"a": {"type": "integer"}}
    for bad, match in [({"type": "yaml"}, "not supported"), ({"type": "json_schema"}, "must be an object"),
                       ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "not a valid"),
                       ({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 70_000]}}}, "larger")]:
        with pytest.raises(OpenAIError, match=match) as err:
            guided_for_response_format(bad)
        assert err.value.status == 400


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_local_features_logprobs_and_logit_bias():
    assert local_features(chat()).logprobs is None
    assert local_features(chat(logprobs=True)).logprobs == 0
    assert local_features(chat(logprobs=True, top_logprobs=4)).logprobs == 4
    assert local_features(chat(logit_bias={"7": 5, "3": -100})).logit_bias == ((3, -100.0), (7, 5.0))
    comp = CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "logprobs": 2})
    assert local_features(comp).logprobs == 2
    for kw, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                      ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
                      ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"},
                       "response_format")]:
        with pytest.raises(OpenAIError) as err:
            local_features(chat(**kw))
        assert err.value.status == 400 and err.value.param == param


def test_split_request_wire_carries_grammar_bias_and_logprobs():
    """The split topology's prefill node gets the same sampling (grammar, bias, logprobs)."""
    import json as _json

    from engine.disagg.request_wire import request_from_wire, request_to_wire
    from engine.protocol import GenerateRequest, GuidedSpec, SamplingParams, StaticTenantScope

    sampling = SamplingParams(logit_bias=((3, -100.0), (7, 5.0)), logprobs=2,
                              guided=GuidedSpec(json_schema='{"type": "object"}', prefix="<a>", suffix="</a>",
                                                max_items=3, separator="\n"))
    req = GenerateRequest(request_id="r", tenant=StaticTenantScope(namespace=b"ns"), sampling=sampling, prompt="x")
    back = request_from_wire(_json.loads(_json.dumps(request_to_wire(req))))
    assert back.sampling == sampling


@pytest.mark.parametrize("field", ["functions", "function_call", "audio", "prediction", "reasoning_effort",
                                   "web_search_options", "logits_processors", "allowed_token_ids"])
def test_openai_fields_the_local_engine_cannot_honour_are_400s(field):
    from gateway.pipeline import _reject_unsupported_local

    with pytest.raises(OpenAIError) as err:
        _reject_unsupported_local(chat(**{field: {"x": 1}}))
    assert err.value.status == 400 and err.value.param == field
    with pytest.raises(OpenAIError):
        _reject_unsupported_local(chat(modalities=["text", "audio"]))
    _reject_unsupported_local(chat(modalities=["text"], metadata={"a": "b"}, store=False, service_tier="auto"))


def test_schema_checks_are_bounded_and_never_fetch():
    from gateway.tool_calls import KNOWN_DRAFTS, check_schema

    for bad, match in [({"$schema": "http://127.0.0.1:9/evil", "type": "object"}, "declares \\$schema"),
                       ({"type": "object", "properties": {"a": {"$schema": "file:///etc/passwd"}}}, "declares"),
                       ({"type": "array", "items": _nested(80)}, "nested deeper than 64"),
                       ({"type": "string", "minLength": -1}, "not a valid JSON Schema")]:
        with pytest.raises(OpenAIError, match=match):
            check_schema(bad, "response_format.json_schema.schema")
    for draft in KNOWN_DRAFTS:
        check_schema({"$schema": draft, "type": "object"}, "x")
    # (its speed on a schema of thousands of alternatives: tests/slow/test_guided_isolation.py)


def _nested(depth: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "array", "items": node}
    return node
