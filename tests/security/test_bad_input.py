"""Hostile and broken input: every one gets a clear 4xx in the OpenAI shape, never a 5xx or a hang.

Bodies are sent as raw bytes so that the JSON parser, the size limit and the UTF-8 decoder of the
real app are what is tested (no client library cleans the input first).
"""

from __future__ import annotations

import json

import pytest
from security_helpers import assert_openai_error, auth

CHAT = "/v1/chat/completions"


def _post_raw(client, key: str | None, data: bytes, path: str = CHAT, content_type: str = "application/json"):
    headers = {"Content-Type": content_type}
    if key is not None:
        headers.update(auth(key))
    return client.post(path, content=data, headers=headers)


def _chat(**over) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    body.update(over)
    return body


def _expect(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = assert_openai_error(r.json(), status)
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("raw", [
    b"{", b"{\"model\": \"tiny\",}", b"null", b"[]", b"\"a string\"", b"42", b"", b"{\"model\": tiny}",
    b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"model\": \"tiny\"",  # truncated
    b"\xef\xbb\xbf{}",  # BOM
    b"{\"a\":" * 5000 + b"1" + b"}" * 5000,  # deep nesting
])
def test_malformed_json_is_a_400(gateway, raw: bytes) -> None:
    client, keys, _ = gateway
    _expect(_post_raw(client, keys["acme"], raw), 400)


@pytest.mark.parametrize("raw", [
    b"\xff\xfe\x00{",
    b"{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"\xc3\x28\"}]}",
    b"{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"\xed\xa0\x80\"}]}",  # surrogate
])
def test_invalid_utf8_is_a_400(gateway, raw: bytes) -> None:
    client, keys, _ = gateway
    _expect(_post_raw(client, keys["acme"], raw), 400)


def test_lone_surrogate_escape_is_not_a_500(gateway) -> None:
    """'\\ud800' is valid JSON but not encodable text: the tokenizer must not crash the request."""
    client, keys, _ = gateway
    raw = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    r = _post_raw(client, keys["acme"], raw)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_openai_error(r.json(), 400)


def test_wrong_content_type_is_a_400(gateway) -> None:
    client, keys, _ = gateway
    r = _post_raw(client, keys["acme"], json.dumps(_chat()).encode(), content_type="text/plain")
    assert r.status_code in (400, 415), r.text
    assert_openai_error(r.json(), r.status_code)


def test_huge_body_is_a_413_declared_and_streamed(gateway) -> None:
    client, keys, app = gateway
    limit = app.state.settings.max_body_bytes
    huge = json.dumps(_chat(messages=[{"role": "user", "content": "x" * (limit + 10)}])).encode()
    _expect(_post_raw(client, keys["acme"], huge), 413, "request_too_large")

    def chunks():  # no Content-Length: chunked transfer, counted as it arrives
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    r = client.post(CHAT, content=chunks(), headers={"Content-Type": "application/json", **auth(keys["acme"])})
    _expect(r, 413)


def test_huge_body_without_a_key_is_refused_too(gateway) -> None:
    client, _, app = gateway
    limit = app.state.settings.max_body_bytes
    r = _post_raw(client, None, b"{" + b" " * (limit + 1) + b"}")
    assert r.status_code in (401, 413)
    assert_openai_error(r.json(), r.status_code)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 10**12), ("max_tokens", 2**63), ("max_tokens", "ten"),
    ("max_tokens", 1.5), ("max_completion_tokens", -5), ("temperature", -1), ("temperature", 1e308),
    ("top_p", 0), ("top_p", 2), ("n", 0), ("n", 10**6), ("stop", ["a", "b", "c", "d", "e"]),
    ("messages", []), ("messages", "hello"), ("messages", [{"role": "wizard", "content": "hi"}]),
    ("messages", [{"content": "no role"}]), ("stream_options", 5), ("seed", "x"),
    ("tools", "nope"),
])
def test_bad_parameters_are_a_400(gateway, field: str, value) -> None:
    client, keys, _ = gateway
    r = client.post(CHAT, json=_chat(**{field: value}), headers=auth(keys["acme"]))
    _expect(r, 400)


def test_unknown_model_is_a_404_model_not_found(gateway) -> None:
    client, keys, _ = gateway
    r = client.post(CHAT, json=_chat(model="gpt-9-ultra"), headers=auth(keys["acme"]))
    _expect(r, 404, "model_not_found")


def test_prompt_longer_than_the_context_is_a_400(gateway) -> None:
    client, keys, app = gateway
    max_len = app.state.engine.models()[0].max_model_len
    long_text = "word " * (max_len + 100)
    r = client.post(CHAT, json=_chat(messages=[{"role": "user", "content": long_text}]), headers=auth(keys["acme"]))
    err = _expect(r, 400, "context_length_exceeded")
    assert str(max_len) in err["message"]
    # the same via /v1/completions and with token ids
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1] * (max_len + 1), "max_tokens": 1},
                    headers=auth(keys["acme"]))
    _expect(r, 400, "context_length_exceeded")


def test_token_ids_outside_the_vocabulary_are_a_400(gateway) -> None:
    client, keys, _ = gateway
    for ids in ([-1], [10**9], [2**63]):
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1},
                        headers=auth(keys["acme"]))
        _expect(r, 400)


@pytest.mark.parametrize("header", [
    None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Bearer pg-00000000_" + "A" * 43, "Bearer " + "x" * 10000,
    "bearer\tkey", "Bearer pg-\u00e9\u00e9".encode("latin-1"), b"Bearer \xff\xfe",
])
def test_bad_keys_are_a_401(gateway, header) -> None:
    client, _, _ = gateway
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Authorization"] = header
    r = client.post(CHAT, content=json.dumps(_chat()).encode("utf-8"), headers=headers)
    _expect(r, 401, "invalid_api_key")


def test_streaming_request_with_bad_input_fails_before_the_stream(gateway) -> None:
    client, keys, _ = gateway
    r = client.post(CHAT, json=_chat(stream=True, max_tokens=-3), headers=auth(keys["acme"]))
    _expect(r, 400)


def test_usage_since_garbage_is_a_400(gateway) -> None:
    client, keys, _ = gateway
    for since in ("yesterday", "7x", "-1d", "9999999999999999999d"):
        r = client.get("/v1/usage", params={"since": since}, headers=auth(keys["acme"]))
        _expect(r, 400)
