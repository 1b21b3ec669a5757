"""Issue #17, session 6: per-request work the front door no longer does, pinned to what it did before.

Each test compares the cheaper path with the formula it replaced (kept here as the oracle), so a
cut that changed a byte or a value fails here, not only in the benchmark.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from gateway_fakes import FakeEngine, FakeTenancy
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

from engine.protocol import EngineError, GenerateRequest, RequestOutput, SamplingParams
from gateway import metrics
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
from gateway.pipeline import Prepared, prepare, provider_message, run_choices
from gateway.ports import canonicalize
from gateway.responder import WholeResponse
from gateway.routes.completions import Parts
from gateway.routing import Backend, BackendKind, Router
from gateway.schemas import ChatCompletionRequest, usage_dict
from gateway.settings import GatewaySettings, RouteConfig
from gateway.upstream import (
    DirectOpenAIClient,
    NormalizedUsage,
    UpstreamRequest,
    _get,
    normalize_usage,
    scope_marker,
    scoped_messages,
    scoped_prompt,
)
from gateway.wire_json import ascii_json, is_plain, utf8_json
from promptlint.cache_control import is_marked, parse_breakpoints
from tenancy.service import TenancyService, UsageRecord
from tenancy.storable import (
    _REPLACEMENT,
    _UNSTORABLE,
    OPTIONAL_NUMBERS,
    REQUIRED_NUMBERS,
    REQUIRED_TEXT,
    TEXT_LIMITS,
    storable_number,
    storable_row,
    storable_text,
)

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


class _ChatMessageBefore(BaseModel):
    """``schemas.ChatMessage`` as it was at the cut, kept as the oracle: its ``tool_calls`` were plain
    dicts, so ``exclude_none`` dropped None at a message's top level only. (Since then the calls are
    typed models, whose own dump would drop the None inside a call too: not what a provider gets.)"""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


def _before(body: dict[str, Any], canon_mode: str) -> tuple[list[dict[str, Any]], Any]:
    """What prepare sent a provider before the cut: the canonical messages validated again into
    ``ChatMessage``s and dumped with ``exclude_none``; the tools of the canonical body."""
    req = ChatCompletionRequest.model_validate(copy.deepcopy(body))
    canon = canonicalize(req.model_dump(exclude_unset=True), canon_mode, ())
    messages = [_ChatMessageBefore.model_validate(m).model_dump(exclude_none=True) for m in canon.body["messages"]]
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
    assert provider_message(message) == _ChatMessageBefore.model_validate(message).model_dump(exclude_none=True)
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
    """gateway.ingress.scan as it was at af5c657 (the oracle), plus the count of token ids."""
    texts: list[str] = []
    deepest = 0
    token_ids = 0
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
                token_ids += len(item)
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
    return BodyShape(deepest, sum(map(len, texts)), token_ids)


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


@pytest.mark.parametrize("value,max_depth,shown", [({"\ud800": []}, 1, "\\ud800"), ({"a": {"\udfff": [[1]]}}, 2, "a.\\udfff"),
                                                   ({"a": {"\ud800": "x"}}, 4, "'a'")])
def test_refusals_naming_a_surrogate_key_can_be_encoded(value, max_depth, shown):
    """The case the hypothesis test below found: the path in a nesting refusal holds a key, and the key
    a lone surrogate. The message shows it escaped, so the 400 it becomes can be written as UTF-8 (a
    surrogate refusal names the container of the key)."""
    with pytest.raises(PydanticCustomError) as caught:
        scan(value, max_depth=max_depth)
    message = caught.value.message()
    message.encode("utf-8")
    assert shown in message, message


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


# -- accounting: one price per request, one TenantTotals per tenant ------------------------------------


class _CountingTenancy(FakeTenancy):
    """FakeTenancy that counts price() calls (its record_usage prices the row, as tenancy's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.priced = 0

    def price(self, *args: Any, **kwargs: Any) -> Any:
        self.priced += 1
        return super().price(*args, **kwargs)


def test_a_request_is_priced_once_and_the_metrics_take_the_ledger_price() -> None:
    tenancy = _CountingTenancy()
    key = tenancy.add("acme")
    app = create_app(GatewaySettings(), engine=FakeEngine(), tenancy=tenancy)
    with TestClient(app) as client:
        for _ in range(3):
            r = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                            json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "a b c"}]})
            assert r.status_code == 200, r.text
        row = app.state.live_stats.snapshot()[0]
    assert tenancy.priced == 3  # record_usage's own pricing only: Accounting no longer prices again
    ledger = sum(tenancy.price(r.price_as or r.model, r.prompt_tokens, r.cached_tokens, r.completion_tokens,
                               r.cache_creation_tokens).cost_usd for r in tenancy.rows)
    assert row["requests"] == 3 and row["cost_usd"] == round(ledger, 8) > 0


def test_record_usage_returns_the_price_it_stored(tmp_path: Path) -> None:
    svc = TenancyService.open(tmp_path / "home")
    try:
        ctx = svc.authenticate(svc.create_tenant("acme").api_key)
        rec = UsageRecord(request_id="r-1", tenant_id=ctx.tenant_id, key_id=ctx.key_id, model="gpt-4o-mini",
                          backend="b", prompt_tokens=1000, cached_tokens=400, completion_tokens=50, ttft_s=None,
                          latency_s=0.1, status="ok", created_at=time.time(), cache_creation_tokens=100)
        expected = svc.price("gpt-4o-mini", 1000, 400, 50, 100)
        assert svc.record_usage(rec) == expected
        assert svc.record_usage(rec) == expected  # a repeated id: not stored again, the same price
        svc.flush()
        assert svc.report()["totals"]["requests"] == 1
    finally:
        svc.close()


def test_live_stats_build_one_tenant_totals_per_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    class _Counted(metrics.TenantTotals):
        def __init__(self, name: str) -> None:
            built.append(name)
            super().__init__(name=name)

    monkeypatch.setattr(metrics, "TenantTotals", _Counted)
    live = metrics.LiveStats()
    for tenant, prompt in (("a", 10), ("a", 5), ("b", 7), ("a", 1)):
        live.add(metrics.RequestSample(tenant_id=f"t-{tenant}", tenant=tenant, outcome=metrics.Outcome.OK,
                                       prompt=prompt, ttft=0.1, latency=0.2))
    assert built == ["a", "b"]
    assert {r["tenant"]: (r["requests"], r["prompt_tokens"]) for r in live.snapshot()} == {"a": (3, 16), "b": (1, 7)}


# -- one generator layer less: run_choices and ProviderClient.generate hand out the worker itself ------


class _TwoOutputs:
    """An engine client whose request yields two outputs; it records aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(request.request_id, (1,), "a", False, 3, 0, 1)
        yield RequestOutput(request.request_id, (2,), "b", True, 3, 0, 2, finish_reason="stop")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_leaving_run_choices_early_aborts_before_aclose_returns() -> None:
    """The responder's contract: closing run_choices (aclosing) aborts the engine request at once,
    before the ledger row; through a re-yielding layer the abort waited for a finalizer task."""
    client = _TwoOutputs()
    tenancy = FakeTenancy()
    ctx = tenancy.keys[tenancy.add("acme")]
    gr = GenerateRequest(request_id="r-0-0", tenant=ctx, sampling=SamplingParams(max_tokens=2), messages=({},))
    prep = Prepared(kind="chat", request_id="r", created=0, model="m", requests=[gr], n=1, stream=False,
                    include_usage=False, canon_applied=(), tenant=ctx,
                    backend=Backend("local", BackendKind.LOCAL, client, "m"))

    async def first_then_leave() -> list[str]:
        outputs = run_choices(prep, Router([]), one_task=True)
        assert (await anext(outputs))[1].new_text == "a"
        await outputs.aclose()
        return list(client.aborted)  # read before the loop runs anything else

    assert asyncio.run(first_then_leave()) == ["r-0-0"]


def test_provider_generate_starts_nothing_before_iteration() -> None:
    client = DirectOpenAIClient("openai/m", api_base="http://127.0.0.1:9/v1", api_key="k")
    tenancy = FakeTenancy()
    ctx = tenancy.keys[tenancy.add("acme")]
    request = UpstreamRequest(request_id="r", tenant=ctx, sampling=SamplingParams(max_tokens=2),
                              messages=({"role": "user", "content": "hi"},), passthrough={"tool_choice": "none"},
                              incremental=False)
    outputs = client.generate(request)
    assert inspect.isasyncgen(outputs) and outputs.ag_frame.f_lasti == 0  # created, not started

    async def drain() -> None:
        async for _ in outputs:
            pass

    with pytest.raises(EngineError):  # nothing listens on port 9: the provider error, on iteration
        asyncio.run(drain())


# -- the direct pool's request head: Content-Type is a pool default, the bytes are as before -----------

_WHOLE = json.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()


async def _heads_of(requests: list[tuple[str | None, str | None]]) -> list[bytes]:
    """The request heads a DirectOpenAIClient sends (route key, tenant with its own key) per request."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.CancelledError):  # the client closed; the test ended
                break
            await reader.readexactly(int(re.search(rb"Content-Length: (\d+)", head)[1]))
            heads.append(re.sub(rb"Host: [^\r]*|Content-Length: \d+", b"<var>", head))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(_WHOLE) + _WHOLE)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tenancy = FakeTenancy()
    ctx = tenancy.keys[tenancy.add("acme")]
    try:
        for route_key, tenant in requests:
            client = DirectOpenAIClient("openai/m", api_base=f"http://127.0.0.1:{port}/v1", api_key=route_key,
                                        tenant_api_keys={"acme": "sk-acme"}, keyless=route_key is None)
            request = UpstreamRequest(request_id="r", tenant=ctx, sampling=SamplingParams(max_tokens=2),
                                      messages=({"role": "user", "content": "hi"},), incremental=False,
                                      tenant_name=tenant)
            async for _ in client.generate(request):
                pass
            await client.aclose()
    finally:
        server.close()
        await server.wait_closed()
    return heads


def test_direct_request_heads_are_byte_for_byte_as_before() -> None:
    heads = asyncio.run(_heads_of([("sk-route", None), ("sk-route", "acme"), (None, None)]))
    start = b"POST /v1/chat/completions HTTP/1.1\r\n<var>\r\n"
    assert heads == [
        start + b"Authorization: Bearer sk-route\r\nContent-Type: application/json\r\n<var>\r\n\r\n",
        start + b"Authorization: Bearer sk-acme\r\nContent-Type: application/json\r\n<var>\r\n\r\n",
        start + b"Content-Type: application/json\r\nAuthorization: Bearer EMPTY\r\n<var>\r\n\r\n",  # keyless
    ]


# -- fast paths for the common values: the same results as the general code ---------------------------


def _request_id_before(value: object) -> str:
    """tenancy.storable.storable_request_id as it was (the oracle)."""
    text = value if isinstance(value, str) else str(value)
    limit = TEXT_LIMITS["request_id"]
    clean = _UNSTORABLE.sub(_REPLACEMENT, text)
    if len(clean) <= limit and clean == text:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{clean[: limit - 33]}~{digest}"


def _row_before(row: dict[str, object]) -> dict[str, object]:
    """storable_row's meaning: every column through the general functions, no fast path."""
    out: dict[str, object] = {}
    for column, limit in TEXT_LIMITS.items():
        value = row.get(column)
        if column == "request_id":
            out[column] = _request_id_before("" if value is None else value)
            continue
        text = storable_text(value, limit, multiline=column == "miss_context")
        out[column] = "" if text is None and column in REQUIRED_TEXT else text
    for columns, required in ((REQUIRED_NUMBERS, True), (OPTIONAL_NUMBERS, False)):
        for column in columns:
            out[column] = storable_number(row.get(column), required=required)
    return out


_cell = st.one_of(st.none(), _text, st.text(min_size=120, max_size=300), st.integers(min_value=-2**70, max_value=2**70),
                  st.floats(allow_nan=True, allow_infinity=True), st.booleans())


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({}, optional={c: _cell for c in (*TEXT_LIMITS, *REQUIRED_NUMBERS, *OPTIONAL_NUMBERS)}))
def test_storable_row_matches_the_general_path(row: dict[str, object]) -> None:
    stored, expected = storable_row(row), _row_before(row)
    assert stored.keys() == expected.keys()
    for column, value in expected.items():  # NaN != NaN: compare as text
        assert repr(stored[column]) == repr(value), column


def _usage_before(usage: Any) -> NormalizedUsage:
    """gateway.upstream.normalize_usage as it was (the oracle)."""
    completion = _get(usage, "completion_tokens") or _get(usage, "output_tokens") or 0
    cache_read = _get(usage, "cache_read_input_tokens") or 0
    cache_creation = _get(usage, "cache_creation_input_tokens") or 0
    prompt = _get(usage, "prompt_tokens")
    if prompt is None:
        prompt = (_get(usage, "input_tokens") or 0) + cache_read + cache_creation
    cached = _get(_get(usage, "prompt_tokens_details"), "cached_tokens") or 0
    cached = cached or cache_read or _get(usage, "prompt_cache_hit_tokens") or 0
    return NormalizedUsage(int(prompt), int(cached), int(completion), int(cache_creation))


_USAGE_FIELDS = ("completion_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",
                 "prompt_tokens", "input_tokens", "prompt_cache_hit_tokens")


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={**{f: st.one_of(st.none(), st.integers(0, 10**6)) for f in _USAGE_FIELDS},
                                           "prompt_tokens_details": st.one_of(st.none(), st.fixed_dictionaries(
                                               {}, optional={"cached_tokens": st.one_of(st.none(), st.integers(0, 99))}))}))
def test_normalize_usage_reads_a_dict_and_an_object_as_before(usage: dict[str, Any]) -> None:
    expected = _usage_before(usage)
    assert normalize_usage(usage) == expected
    as_object = SimpleNamespace(**{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in usage.items()})
    assert normalize_usage(as_object) == _usage_before(as_object) == expected
    assert normalize_usage(None) == _usage_before(None)


def test_cache_control_marks_in_any_mapping_still_count() -> None:
    body = {"messages": [MappingProxyType({"role": "user", "content": [
        MappingProxyType({"type": "text", "text": "x" * 40, "cache_control": {"type": "ephemeral"}})]})]}
    assert [bp.param for bp in parse_breakpoints(body)] == ["messages.0.content.0.cache_control"]
    assert is_marked(MappingProxyType({"cache_control": {"type": "ephemeral"}})) and not is_marked(["cache_control"])
