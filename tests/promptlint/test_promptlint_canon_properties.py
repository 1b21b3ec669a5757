"""Property tests for canon: idempotence, no mutation, and meaning preservation on random requests."""

from __future__ import annotations

import copy
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from promptlint.canon import CONTEXT_HEADER, canonicalize, canonicalize_owned

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=8))
_schema = st.recursive(
    _json_leaf,
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(_names, children, max_size=4)),
    max_leaves=12,
)
_tool = st.builds(
    lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
    _names,
    st.dictionaries(_names, _schema, max_size=4),
)
_dynamic_line = st.sampled_from([
    "Current time: 2026-11-29T10:00:00Z", "Today is 29 Nov 2026", "trace 3f2b8c1e-1234-4abc-9def-0123456789ab",
    "user_name: Alice", "Request req_88aa99bb7c", "",
])
_static_line = st.sampled_from(["You are helpful.", "  Be brief.  ", "Use numbered steps.", "Cite sources.\r"])
_text = st.lists(st.one_of(_static_line, _dynamic_line), max_size=6).map("\n".join)
_message = st.builds(lambda role, text: {"role": role, "content": text},
                     st.sampled_from(["system", "user", "assistant", "developer"]), _text)
_body = st.builds(
    lambda tools, messages: {"model": "m", "tools": tools, "messages": messages},
    st.lists(_tool, max_size=5), st.lists(_message, max_size=6),
)


@settings(max_examples=100, deadline=None)
@given(_body, st.sampled_from(["off", "safe", "reorder"]))
def test_every_mode_is_idempotent_and_never_mutates(body, mode):
    snapshot = copy.deepcopy(body)
    once = canonicalize(body, mode, per_user_vars=["user_name"])
    assert body == snapshot and json.dumps(body) == json.dumps(snapshot)
    twice = canonicalize(once.body, mode, per_user_vars=["user_name"])
    assert json.dumps(twice.body) == json.dumps(once.body)
    assert twice.applied == ()


@settings(max_examples=100, deadline=None)
@given(_body, st.sampled_from(["off", "safe", "reorder"]), st.sampled_from([(), ("user_name",)]))
def test_the_owned_variant_gives_what_canonicalize_gives(body, mode, per_user):
    """The gateway's in-place canonicalization (issue 17) is the same transform as the copying one."""
    expected = canonicalize(body, mode, per_user)
    owned = copy.deepcopy(body)
    got = canonicalize_owned(owned, mode, per_user)
    assert got == expected
    assert json.dumps(got.body) == json.dumps(expected.body)  # key order too: it is what a cache matches
    assert got.body is owned


@settings(max_examples=100, deadline=None)
@given(_body)
def test_safe_changes_only_order_and_edge_whitespace(body):
    out = canonicalize(body, "safe").body
    # tools: the same multiset of tools, each equal as parsed JSON (dict equality ignores key order)
    key = lambda t: json.dumps(t, sort_keys=True)  # noqa: E731
    assert sorted(map(key, out["tools"])) == sorted(map(key, body["tools"]))
    assert [t["function"]["name"] for t in out["tools"]] == sorted(t["function"]["name"] for t in body["tools"])
    assert len(out["messages"]) == len(body["messages"])
    last = len(body["messages"]) - 1
    for i, (before, after) in enumerate(zip(body["messages"], out["messages"])):
        assert before["role"] == after["role"]
        if i == last and before["role"] == "assistant":
            assert after["content"] == before["content"]  # a trailing prefill is sent byte for byte
        else:
            assert before["content"].replace("\r\n", "\n").replace("\r", "\n").strip() == after["content"]


_slots = st.lists(st.one_of(_static_line.map(lambda x: ("static", x)),
                            st.sampled_from(["time", "uuid", "user"]).map(lambda k: ("dyn", k))),
                  min_size=1, max_size=8)
_values = {
    "time": ("Now: 2026-11-29T10:00:00Z", "Now: 2027-01-02T23:59:59Z"),
    "uuid": ("trace 3f2b8c1e-1234-4abc-9def-0123456789ab", "trace 00000000-aaaa-4bbb-8ccc-111111111111"),
    "user": ("user_name: Alice", "user_name: Bartholomew"),
}


@settings(max_examples=100, deadline=None)
@given(_slots)
def test_reorder_system_prompt_is_byte_stable_across_dynamic_values(slots):
    def render(which):
        lines = [v if kind == "static" else _values[v][which] for kind, v in slots]
        return {"messages": [{"role": "system", "content": "\n".join(lines)}, {"role": "user", "content": "q"}]}

    def prefix(which):
        body = canonicalize(render(which), "reorder", per_user_vars=["user_name"]).body
        # everything before the context message (a system prompt left empty is dropped)
        head = []
        for m in body["messages"]:
            if m["content"].startswith(CONTEXT_HEADER):
                break
            head.append(m)
        return json.dumps(head).encode()

    assert prefix(0) == prefix(1)


@given(st.text(alphabet="ab{$}\n", max_size=60), st.lists(st.integers(0, 70), max_size=12), st.sampled_from(["{$", "{}", "$"]))
@settings(max_examples=300, deadline=None)
def test_forward_finder_answers_as_find_any_at_increasing_positions(text, steps, chars):
    """The scanners' loops ask for positions that never decrease; the finder remembers each
    character's next index (one search per character, not one per call) and must answer exactly
    as ``find_any`` does at every position."""
    from promptlint.canon import ForwardFinder, find_any

    finder = ForwardFinder(text, chars)
    for pos in sorted(steps):
        assert finder.find(pos) == find_any(text, chars, pos)
