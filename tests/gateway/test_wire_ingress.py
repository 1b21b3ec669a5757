"""Ingress order on a real ``prefixgate serve --model tiny``: the key before the body, cheap bounds
before costly validation (the DoS audit: one client's body must not cost the event loop seconds).

Each test sends a body that the old order answered differently: a refusal that came from parsing
or validating the body now comes from the cheaper check in front of it.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from wire_server import error_of

from gateway.ingress import MAX_TOKEN_IDS
from gateway.tool_calls import MAX_CALL_SCHEMA_BYTES

BAD_JSON = b'{"model": "tiny", "messages": ['  # cut short: parsing it fails


@pytest.mark.parametrize("path, headers", [
    ("/v1/chat/completions", {"Authorization": "Bearer pg-nope"}),
    ("/v1/completions", {"Authorization": "Bearer pg-nope"}),
    ("/v1/responses", {"Authorization": "Bearer pg-nope"}),
    ("/v1/cache/warm", {}),
    ("/v1/messages", {"x-api-key": "pg-nope"}),
    ("/v1/messages/count_tokens", {"x-api-key": "pg-nope"}),
])
def test_a_bad_key_is_refused_before_the_body_is_parsed(server, path, headers):
    """An unparseable body with a wrong or missing key gets the 401: the body was never parsed (it was
    a 400 ``invalid_json`` on the routes that parsed first)."""
    url, _ = server
    r = httpx.post(f"{url}{path}", content=BAD_JSON, headers={**headers, "Content-Type": "application/json"},
                   trust_env=False, timeout=60)
    assert r.status_code == 401, r.text
    if path.startswith("/v1/messages"):  # Anthropic's error shape on its door
        assert r.json()["error"]["type"] == "authentication_error"
    else:
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_too_many_token_ids_are_refused_before_validation(post):
    r = post("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": [[1] * 1000] * (MAX_TOKEN_IDS // 1000 + 1)})
    err = error_of(r, "prompt")
    assert f"more than {MAX_TOKEN_IDS} token ids" in err["message"], err


def test_token_ids_count_against_max_prompt_chars(post):
    """200,000 ids (4 characters each: 800,000) with 300,000 characters of text exceed the 1,000,000
    characters a request may hold; the ids used to count for nothing."""
    r = post("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": [[1] * 4000] * 50,
                                 "user": "u", "stop": ["x" * 1000], "metadata": {"pad": "y" * 300_000}})
    err = error_of(r, "prompt")
    assert err["code"] == "request_too_large" and "200000 token ids" in err["message"], err


def test_token_ids_are_strict_integers(oai):
    """Numbers in strings are text prompts, not ids (lax validation made ["1", "2"] a token-id prompt)."""
    out = oai.completions.create(model="tiny", prompt=["1", "2"], max_tokens=1)
    assert len(out.choices) == 2
    r = oai.completions.with_raw_response.create(model="tiny", prompt=[5, 6, 7], max_tokens=1)
    assert r.parse().usage.prompt_tokens == 3


def _big_invalid_schema() -> dict:
    """A schema over the size bound that is also invalid: which error it gets shows which check ran first."""
    return {"type": "not-a-type", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}


def test_an_oversized_response_format_is_refused_on_its_size_first(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "big", "schema": _big_invalid_schema()}})
    err = caught.value.body
    assert err["code"] == "schema_too_large" and err["param"] == "response_format", err
    assert "larger than 65536 bytes" in err["message"], err


def test_responses_names_text_format_in_the_size_error(post):
    r = post("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 16,
                               "text": {"format": {"type": "json_schema", "name": "big",
                                                   "schema": _big_invalid_schema()}}})
    err = error_of(r, "text.format")
    assert err["code"] == "schema_too_large" and err["message"].startswith("text.format.schema is larger"), err


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_oversized_tools_are_refused_on_their_size_first(oai, tool_choice):
    """Tools whose schemas are invalid and 64 KiB+ in all: the size refusal, for ``auto`` too (which had
    no size bound: each tool was meta-validated on the event loop)."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "nope", "properties": {f"p{j}": {"type": "string"} for j in range(60)}}}} for i in range(100)]
    assert len(json.dumps(tools)) > MAX_CALL_SCHEMA_BYTES
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                    tools=tools, tool_choice=tool_choice)
    err = caught.value.body
    assert err["code"] == "schema_too_large" and err["param"] == "tools", err


def test_n_over_the_limit_has_a_code(post):
    r = post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 1000})
    assert error_of(r, "n")["code"] == "integer_above_max_value"


def test_a_large_valid_body_is_served(oai):
    """A body over the off-loop threshold (validated in the tenant's worker thread) is served as any other."""
    out = oai.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                      metadata={"pad": "y" * 500}, extra_body={"padding": "z" * 100_000})
    assert out.choices[0].finish_reason in ("length", "stop")
