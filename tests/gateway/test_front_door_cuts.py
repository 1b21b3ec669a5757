"""Issue #17, session 6: per-request work the front door no longer does, pinned to what it did before.

Each test compares the cheaper path with the formula it replaced (kept here as the oracle), so a
cut that changed a byte or a value fails here, not only in the benchmark.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.responses import JSONResponse
from gateway_fakes import FakeTenancy
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticCustomError

from gateway.app import create_app
from gateway.formats import sse
from gateway.ingress import (
    _SURROGATE,
    MAX_DEPTH,
    MAX_ITEMS,
    BodyShape,
    _surrogate_path,
    _where,
    body_limit,
    scan,
)
from gateway.pipeline import Prepared, prepare, provider_message
from gateway.ports import canonicalize
from gateway.responder import WholeResponse
from gateway.routes.completions import Parts
from gateway.schemas import ChatCompletionRequest, ChatMessage, usage_dict
from gateway.settings import GatewaySettings, RouteConfig
from gateway.upstream import scope_marker, scoped_messages, scoped_prompt
from gateway.wire_json import ascii_json, is_plain, utf8_json

# Messages with everything a provider must get exactly as before: fields and extras set to None
# (dropped), None inside nested values (kept), content parts, tool calls, trailing whitespace (which
# the "safe" canonicalization normalizes).
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant.   \n\n", "name": None, "x_extra": None},
    {"role": "user", "content": [{"type": "text", "text": "look  ", "cache_control": None},
                                 {"type": "image_url", "image_url": {"url": "data:,", "detail": None}}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "extra": None}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42", "meta": {"k": None}},
    {"role": "user", "content": "and now?"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def _prepare(body: dict[str, Any], canon_mode: str) -> Prepared:
    tenancy = FakeTenancy()
    ctx = tenancy.keys[tenancy.add("acme", canon_mode=canon_mode)]
    route = RouteConfig(model="up", provider="openai/m", api_base="http://127.0.0.1:9/v1", transport="direct")
    app = create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)
    parts = Parts.of(app.state, tenancy, None)
    req = ChatCompletionRequest.model_validate(copy.deepcopy(body))
    return asyncio.run(prepare("chat", req, ctx, tenancy=tenancy, router=parts.router, engine=None,
                               settings=parts.settings, threads=parts.threads, tracker=parts.tracker))


def _before(body: dict[str, Any], canon_mode: str) -> tuple[list[dict[str, Any]], Any]:
    """What prepare sent a provider before the cut: the canonical messages validated again into
    ``ChatMessage``s and dumped with ``exclude_none``; the tools of the canonical body."""
    req = ChatCompletionRequest.model_validate(copy.deepcopy(body))
    canon = canonicalize(req.model_dump(exclude_unset=True), canon_mode, ())
    messages = [ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in canon.body["messages"]]
    return messages, canon.body.get("tools", req.tools)


@pytest.mark.parametrize("canon_mode", ["off", "safe", "reorder"])
@pytest.mark.parametrize("with_tools", [False, True])
def test_provider_messages_are_the_validated_dump(canon_mode: str, with_tools: bool) -> None:
    body: dict[str, Any] = {"model": "up", "messages": MESSAGES, "max_tokens": 4}
    if with_tools:
        body["tools"] = TOOLS
    prep = _prepare(body, canon_mode)
    messages, tools = _before(body, canon_mode)
    sent = prep.requests[0]
    assert list(sent.messages) == messages
    assert sent.tools == tools
    if canon_mode != "off":
        assert prep.canon_applied  # the whitespace case really went through canonicalization


def test_provider_message_drops_top_level_none_only() -> None:
    message = {"role": "user", "content": "hi", "name": None, "x": {"y": None}, "parts": [None]}
    assert provider_message(message) == ChatMessage.model_validate(message).model_dump(exclude_none=True)
    assert provider_message(message) == {"role": "user", "content": "hi", "x": {"y": None}, "parts": [None]}


# -- JSON bytes: wire_json against the stdlib encoders it replaces ------------------------------------

_text = st.text(alphabet=st.one_of(st.characters(codec=None, min_codepoint=0, max_codepoint=0x2FF),
                                   st.sampled_from(["\x7f", "\u2028", "\ufeff", "\U0001F600", "\ud800", "\udfff"])))
_scalar = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**80, max_value=2**80), _text,
                    st.floats(allow_nan=True, allow_infinity=True))
_json_like = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner),
                            st.dictionaries(st.one_of(_text, st.integers(), st.booleans()), inner, max_size=4)),
    max_leaves=12)


def _outcome(encode: Callable[[object], bytes], value: object) -> bytes | type[BaseException]:
    try:
        return encode(value)
    except (ValueError, TypeError) as exc:  # UnicodeEncodeError and allow_nan's ValueError included
        return type(exc)


@settings(max_examples=400, deadline=None)
@given(_json_like)
def test_utf8_json_is_json_response_render(value: object) -> None:
    render = JSONResponse(None).render
    assert _outcome(utf8_json, value) == _outcome(render, value)


@settings(max_examples=400, deadline=None)
@given(_json_like)
def test_ascii_json_is_json_dumps(value: object) -> None:
    assert _outcome(ascii_json, value) == _outcome(lambda v: json.dumps(v, separators=(",", ":")).encode(), value)


@pytest.mark.parametrize(("value", "plain"), [
    ({"content": "caf\u00e9 \x7f \u2028 \U0001F600 \\ \" </script>", "n": 2**70, "ok": True, "none": None}, True),
    ({"lone": "\ud800"}, True),  # plain, but to_json refuses it: the stdlib answers (its error, its escape)
    ([], True), ({"logprob": 1e-05}, False), ({"nan": float("nan")}, False), ({1: "int key"}, False),
    (("a", "tuple"), False),
])
def test_plain_and_fallback_values_encode_as_before(value: object, plain: bool) -> None:
    stdlib_utf8 = _outcome(JSONResponse(None).render, value)
    assert _outcome(utf8_json, value) == stdlib_utf8
    assert _outcome(ascii_json, value) == _outcome(lambda v: json.dumps(v, separators=(",", ":")).encode(), value)
    assert is_plain(value) == plain


def test_whole_response_and_sse_frame_bytes() -> None:
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "h\u00e9\x7f", "refusal": None},
                         "logprobs": None, "finish_reason": "stop"}], "usage": usage_dict(3, 1, 2)}
    fast, slow = WholeResponse(body, headers={"x-a": "b"}), JSONResponse(body, headers={"x-a": "b"})
    assert fast.body == slow.body and fast.raw_headers == slow.raw_headers
    assert sse(body) == b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
    assert sse(body, "done").startswith(b"event: done\ndata: {")


# -- the per-scope marker ---------------------------------------------------------------------------------


def test_scope_marker_line_is_cached_per_namespace_and_still_differs() -> None:
    a, b = b"a" * 32, bytearray(b"b" * 32)  # a bytearray namespace (unhashable) works as before
    first = scoped_messages([{"role": "user", "content": "hi"}], a)[0]["content"]
    assert first == f"[cache-scope {scope_marker(a)}]"
    assert scoped_messages([{"role": "user", "content": "hi"}], a)[0]["content"] == first
    assert scoped_prompt("p", b) == f"[cache-scope {scope_marker(bytes(b))}]\np" != scoped_prompt("p", a)


# -- the ingress scan: the same shape and the same errors as the walk it replaced ----------------------

def _scan_before(value: object, *, max_depth: int = MAX_DEPTH) -> BodyShape:
    """gateway.ingress.scan as it was at af5c657 (the oracle)."""
    texts: list[str] = []
    deepest = 0
    stack: list[tuple[object, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            texts.append(item)
            continue
        deepest = max(deepest, depth)
        if depth > max_depth:
            raise body_limit(f"the request is nested more than {max_depth} levels deep (at '{_where(path[:8])}...')",
                             _where(path[:1]) if path else None)
        if isinstance(item, dict):
            for key, child in item.items():
                texts.append(key)
                if isinstance(child, str):
                    texts.append(child)
                elif isinstance(child, dict | list):
                    stack.append((child, depth + 1, (*path, key)))
        elif isinstance(item, list):
            # token ids and numbers need no visit: skipping them keeps a 1M-id prompt at C speed
            if all(type(child) is int for child in item):
                continue
            if len(item) > MAX_ITEMS:
                raise body_limit(f"'{_where(path)}' has {len(item)} entries; at most {MAX_ITEMS} are accepted",
                                 _where(path))
            for i, child in enumerate(item):
                if isinstance(child, str):
                    texts.append(child)
                elif isinstance(child, dict | list):
                    stack.append((child, depth + 1, (*path, i)))
    if any(map(_SURROGATE.search, texts)):
        where = _where(_surrogate_path(value))
        raise body_limit(f"'{where}' holds a lone UTF-16 surrogate, which is not valid Unicode text", where)
    return BodyShape(deepest, sum(map(len, texts)))


def _scan_outcome(scanner: Callable[..., BodyShape], value: object, max_depth: int) -> object:
    try:
        return scanner(value, max_depth=max_depth)
    except PydanticCustomError as exc:
        return ("body_limit", exc.message(), exc.context)


_bodies = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), _text),
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.lists(st.integers(), max_size=6),
                            st.dictionaries(_text, inner, max_size=5)),
    max_leaves=40)


@settings(max_examples=500, deadline=None)
@given(_bodies, st.integers(min_value=1, max_value=6))
def test_scan_matches_the_walk_it_replaced(value: object, max_depth: int) -> None:
    assert _scan_outcome(scan, value, max_depth) == _scan_outcome(_scan_before, value, max_depth)


@pytest.mark.parametrize("value", [
    {"a": [[[[[[{"b": 1}]]]]]]}, [[[[[[[[[[1]]]]]]]]]], {"messages": [{"content": [{"x": {"y": {"z": {"w": {}}}}}]}]},
    {"prompt": ["a"] * (MAX_ITEMS + 1)}, {"prompt": [[1, 2], ["x"] * (MAX_ITEMS + 1)]}, {"ids": [], "k": [1, "a"]},
])
@pytest.mark.parametrize("max_depth", [2, 4, MAX_DEPTH])
def test_scan_errors_name_the_same_place(value: object, max_depth: int) -> None:
    assert _scan_outcome(scan, value, max_depth) == _scan_outcome(_scan_before, value, max_depth)

