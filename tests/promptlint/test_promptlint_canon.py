"""Canonicalization: off is identity, safe is idempotent and meaning-preserving, reorder stabilises the prefix."""

import copy
import json

import pytest

from promptlint.canon import CONTEXT_HEADER, CanonResult, canonicalize, find_dynamic_spans


def _tool(name, props):
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": props}},
    }


def _request(system, user="How do I reset my password?", tools=None):
    body = {
        "model": "gpt-4o",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    if tools is not None:
        body["tools"] = tools
    return body


SYSTEM = "You are Acme's support assistant.\nCurrent time: {ts}\nuser_name: {name}\nGreet {name} by name.\nBe brief."


def test_off_is_identity_and_a_new_object():
    body = _request("  sys \r\n", tools=[_tool("b", {}), _tool("a", {})])
    snapshot = copy.deepcopy(body)
    res = canonicalize(body, "off")
    assert isinstance(res, CanonResult)
    assert res.body == snapshot and res.applied == ()
    assert res.body is not body and res.body["messages"] is not body["messages"]
    assert json.dumps(res.body) == json.dumps(snapshot)  # key order too
    assert body == snapshot


def test_safe_sorts_tools_and_schema_keys_without_changing_meaning():
    tools = [
        _tool("search", {"q": {"type": "string"}, "k": {"type": "integer"}}),
        _tool("add", {"y": {}, "x": {}}),
    ]
    body = _request("sys", tools=tools)
    snapshot = copy.deepcopy(body)
    res = canonicalize(body, "safe")
    assert body == snapshot, "input mutated"
    assert [t["function"]["name"] for t in res.body["tools"]] == ["add", "search"]
    assert list(res.body["tools"][1]["function"]["parameters"]["properties"]) == ["k", "q"]
    assert res.applied == ("tools-sorted", "tool-schemas-canonical")
    # Same tools as a set, each equal as parsed JSON: only order changed.
    by_name = {t["function"]["name"]: t for t in tools}
    assert all(by_name[t["function"]["name"]] == t for t in res.body["tools"])
    assert res.body["messages"] == body["messages"]


def test_safe_is_idempotent_and_normalises_message_edges():
    body = _request(
        "\n  You are terse.\r\nReally.  \n", user="  hi\r\n", tools=[_tool("b", {}), _tool("a", {})]
    )
    body["messages"].append({"role": "assistant", "content": "Sure, "})  # trailing prefill: untouched
    once = canonicalize(body, "safe")
    assert once.body["messages"][0]["content"] == "You are terse.\nReally."
    assert once.body["messages"][1]["content"] == "hi"
    assert once.body["messages"][2]["content"] == "Sure, "
    assert "whitespace-normalized" in once.applied
    twice = canonicalize(once.body, "safe")
    assert twice.body == once.body and json.dumps(twice.body) == json.dumps(once.body)
    assert twice.applied == ()


def test_safe_leaves_a_canonical_request_alone():
    body = _request("sys", tools=[_tool("a", {"x": {}}), _tool("b", {})])
    body = canonicalize(body, "safe").body
    assert canonicalize(body, "safe").applied == ()


def test_safe_does_not_move_dynamic_values():
    body = _request(SYSTEM.format(ts="2026-11-29T10:00:00Z", name="Alice"))
    res = canonicalize(body, "safe", per_user_vars=["user_name"])
    assert res.body["messages"][0]["content"] == body["messages"][0]["content"]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (dict(ts="2026-11-29T10:00:00Z", name="Alice"), dict(ts="2026-11-30T08:12:59Z", name="Alice")),
        (
            dict(ts="3f2b8c1e-1234-4abc-9def-0123456789ab", name="Alice"),
            dict(ts="9a1b8c1e-0000-4abc-8def-fedcba987654", name="Alice"),
        ),
        (dict(ts="2026-11-29T10:00:00Z", name="Alice"), dict(ts="2026-11-29T10:00:00Z", name="Bartholomew")),
        (dict(ts="req_8f7a6b5c4d3e", name="Alice"), dict(ts="req_11aa22bb33cc", name="Zoe")),
    ],
)
def test_reorder_makes_system_prompts_byte_identical(a, b):
    ra = canonicalize(_request(SYSTEM.format(**a)), "reorder", per_user_vars=["user_name"])
    rb = canonicalize(_request(SYSTEM.format(**b)), "reorder", per_user_vars=["user_name"])
    sa, sb = ra.body["messages"][0]["content"], rb.body["messages"][0]["content"]
    assert sa.encode() == sb.encode()
    assert a["name"] not in sa and "<user_name>" in sa
    # The moved values are still sent, labelled, just before the last user message.
    ctx = ra.body["messages"][1]
    assert ctx["role"] == "system" and ctx["content"].startswith(CONTEXT_HEADER)
    assert a["ts"] in ctx["content"] and f"user_name: {a['name']}" in ctx["content"]
    assert ra.body["messages"][-1]["role"] == "user"
    assert "dynamic-moved:per-user" in ra.applied


def test_reorder_is_idempotent_and_reports_kinds():
    body = _request("Today: 2026-11-29\nYou are helpful.\nTrace 3f2b8c1e-1234-4abc-9def-0123456789ab")
    body["messages"].insert(1, {"role": "assistant", "content": "earlier turn"})
    body["messages"].insert(1, {"role": "user", "content": "earlier question"})
    once = canonicalize(body, "reorder")
    assert once.applied == ("dynamic-moved:date", "dynamic-moved:uuid")
    assert once.body["messages"][0]["content"] == "You are helpful."
    # inserted just before the LAST user message, after the history
    assert [m["role"] for m in once.body["messages"]] == ["system", "user", "assistant", "system", "user"]
    twice = canonicalize(once.body, "reorder")
    assert twice.body == once.body and twice.applied == ()


def test_reorder_without_dynamic_content_is_safe_mode():
    body = _request("Static rules only.", tools=[_tool("b", {}), _tool("a", {})])
    assert canonicalize(body, "reorder").body == canonicalize(body, "safe").body


def test_reorder_handles_content_parts():
    body = _request("x")
    body["messages"][0]["content"] = [{"type": "text", "text": "Be kind.\nNow: 2026-11-29 10:00"}]
    res = canonicalize(body, "reorder")
    assert res.body["messages"][0]["content"] == [{"type": "text", "text": "Be kind."}]
    assert "2026-11-29 10:00" in res.body["messages"][1]["content"]


def test_bad_mode_and_body():
    with pytest.raises(ValueError, match="unknown canonicalization mode"):
        canonicalize({}, "aggressive")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="JSON object"):
        canonicalize([], "safe")  # type: ignore[arg-type]
    assert canonicalize({"model": "m"}, "reorder").body == {"model": "m"}


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("at 2026-11-29T10:00:00Z ok", "timestamp"),
        ("Sat, 29 Nov 2026 10:00:00 +0000", "timestamp"),
        ("epoch 1764410000", "timestamp"),
        ("on 2026-11-29 ok", "date"),
        ("Today is Sunday, November 29, 2026.", "date"),
        ("on 29 Nov 2026", "date"),
        ("due 11/29/2026", "date"),
        ("at 10:22:33 UTC", "time"),
        ("id 3F2B8C1E-1234-4ABC-9DEF-0123456789AB", "uuid"),
        ("request req_8f7a6b5c4d", "request-id"),
        ("chatcmpl-9xYz12AbCd", "request-id"),
        ("sha deadbeef00112233aa", "random-id"),
        ("ulid 01ARZ3NDEKTSV4RRFFQ69G5FAV", "random-id"),
    ],
)
def test_detectors_find_each_kind(text, kind):
    spans = find_dynamic_spans(text)
    assert [s.kind for s in spans] == [kind]
    s = spans[0]
    assert text[s.start : s.end] == s.text


@pytest.mark.parametrize(
    "text",
    [
        "You are a helpful assistant.",
        "Open 9:00-17:00 on weekdays.",
        "Use version 3.11 and HTTP/2.",
        "Call us at 555-0100.",
        "request_handler and session_state",
        "deadbeefcafebabe (no digits)",
    ],
)
def test_detectors_leave_static_text_alone(text):
    assert find_dynamic_spans(text) == []


def test_reorder_drops_a_system_message_left_empty():
    body = {"messages": [{"role": "system", "content": "Now: 2026-11-29T10:00:00Z"}, {"role": "user", "content": "hi"}]}
    res = canonicalize(body, "reorder")
    assert [m["role"] for m in res.body["messages"]] == ["system", "user"]
    assert res.body["messages"][0]["content"].startswith(CONTEXT_HEADER)
    assert canonicalize(res.body, "reorder").body == res.body
