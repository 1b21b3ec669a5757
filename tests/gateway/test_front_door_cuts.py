"""Issue #17, session 6: per-request work the front door no longer does, pinned to what it did before.

Each test compares the cheaper path with the formula it replaced (kept here as the oracle), so a
cut that changed a byte or a value fails here, not only in the benchmark.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from gateway_fakes import FakeTenancy

from gateway.app import create_app
from gateway.pipeline import Prepared, prepare, provider_message
from gateway.ports import canonicalize
from gateway.routes.completions import Parts
from gateway.schemas import ChatCompletionRequest, ChatMessage
from gateway.settings import GatewaySettings, RouteConfig

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

