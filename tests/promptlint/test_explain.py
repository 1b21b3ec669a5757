"""The cache-miss explainer: each kind of break is attributed to its rule at the right position."""

from __future__ import annotations

import copy

import pytest

from promptlint.explain import Break, explain, first_divergence, render
from promptlint.rules import all_rules

POLICY = "\n".join(f"Policy {i}: answer politely, cite the handbook section, never promise refunds." for i in range(30))


def _tool(name, props=None):
    return {"type": "function", "function": {"name": name, "description": f"{name} things",
                                             "parameters": {"type": "object", "properties": props or {}}}}


TOOLS = [_tool("create_ticket", {"title": {"type": "string"}}), _tool("lookup_order", {"id": {"type": "string"}}),
         _tool("search_docs", {"q": {"type": "string"}})]


def _body(system, messages=(), tools=TOOLS, **extra):
    return {"model": "gpt-4o", "tools": copy.deepcopy(list(tools)) if tools else None,
            "messages": [{"role": "system", "content": system}, *messages], **extra}


def _at(brk: Break, body: dict, needle: str) -> None:
    """The break's position lies inside the first occurrence of ``needle`` in body's rendering."""
    text = render(body).text
    start = text.index(needle)
    assert start <= brk.position < start + len(needle), (brk.position, start, text[brk.position - 20:brk.position + 20])


def test_timestamp_in_system_prompt_is_pc002_at_the_timestamp():
    q = [{"role": "user", "content": "Where is my order?"}]
    prev = _body(f"You are Acme's assistant.\nCurrent time: 2026-11-29T10:00:00Z\n{POLICY}", q)
    cur = _body(f"You are Acme's assistant.\nCurrent time: 2026-11-29T10:05:13Z\n{POLICY}", q)
    brk = explain(prev, cur)
    assert brk is not None and brk.rule == "PC002" and brk.detail == "timestamp"
    _at(brk, cur, "2026-11-29T10:05:13Z")
    # The exact character: "10:0" is shared, "5" differs.
    assert render(cur).text[brk.position] == "5" and render(prev).text[brk.position] == "0"
    assert brk.where == "messages[0]" and "system prompt" in brk.message
    assert brk.context.endswith("2026-11-29T10:0")


def test_shuffled_tools_are_pc004_in_the_tools_block():
    q = [{"role": "user", "content": "hi"}]
    prev = _body(POLICY, q)
    cur = _body(POLICY, q, tools=[TOOLS[2], TOOLS[0], TOOLS[1]])
    brk = explain(prev, cur)
    assert brk is not None and (brk.rule, brk.detail, brk.where) == ("PC004", "tools-reordered", "tools")
    assert brk.position < render(cur).text.index("<system>")
    assert "search_docs, create_ticket, lookup_order" in brk.message


def test_schema_key_order_is_pc004():
    prev = _body(POLICY, [{"role": "user", "content": "hi"}])
    swapped = copy.deepcopy(TOOLS)
    fn = swapped[0]["function"]
    swapped[0]["function"] = {"parameters": fn["parameters"], "name": fn["name"], "description": fn["description"]}
    brk = explain(prev, _body(POLICY, [{"role": "user", "content": "hi"}], tools=swapped))
    assert brk is not None and (brk.rule, brk.detail) == ("PC004", "schema-key-order")


def test_new_tool_definitions_are_not_called_reordering():
    prev = _body(POLICY, [{"role": "user", "content": "hi"}])
    brk = explain(prev, _body(POLICY, [{"role": "user", "content": "hi"}], tools=[*TOOLS, _tool("zap")]))
    # The first three tools are equal, so the divergence comes where the fourth starts.
    assert brk is not None and (brk.rule, brk.detail) == ("other", "tools-changed")


def test_edited_history_is_pc012_at_the_edited_message():
    hist = [{"role": "user", "content": "My order 1 is late."},
            {"role": "assistant", "content": "Sorry to hear that. It ships tomorrow."},
            {"role": "user", "content": "Can you expedite it?"}]
    prev = _body(POLICY, hist)
    edited = copy.deepcopy(hist) + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}]
    edited[1]["content"] = "Sorry about that. It ships on Monday."
    cur = _body(POLICY, edited)
    brk = explain(prev, cur)
    assert brk is not None and (brk.rule, brk.detail, brk.where) == ("PC012", "edited", "messages[2]")
    _at(brk, cur, "Sorry about that")  # "Sorry to" vs "Sorry ab": the first differing character
    assert render(cur).text[brk.position:].startswith("about that")


def test_sliding_window_is_pc012_truncated():
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} text"} for i in range(8)]
    prev = _body(POLICY, turns[:6])
    cur = _body(POLICY, turns[2:8])  # the two oldest dropped, two new appended
    brk = explain(prev, cur)
    assert brk is not None and (brk.rule, brk.detail, brk.where) == ("PC012", "truncated", "messages[1]")
    assert "2 earlier message(s)" in brk.message


def test_new_question_or_appended_turn_is_no_break():
    prev = _body(POLICY, [{"role": "user", "content": "Question A?"}])
    assert explain(prev, _body(POLICY, [{"role": "user", "content": "Question B?"}])) is None
    longer = _body(POLICY, [{"role": "user", "content": "Question A?"}, {"role": "assistant", "content": "A."},
                            {"role": "user", "content": "And B?"}])
    assert explain(prev, longer) is None
    assert explain(prev, copy.deepcopy(prev)) is None
    # a request that is a prefix of the previous one (a retry from an earlier turn) is fully cacheable
    assert explain(longer, prev) is None


def test_whitespace_only_difference_is_pc009():
    hist = [{"role": "user", "content": "hi"}]
    prev = _body("You are helpful.\n" + POLICY, hist)
    cur = _body("You are helpful.  \r\n" + POLICY, hist)
    brk = explain(prev, cur)
    assert brk is not None and brk.rule == "PC009"
    _at(brk, cur, "  \r\n")


def test_per_user_line_is_pc003_and_tenant_vars_count():
    q = [{"role": "user", "content": "hi"}]
    prev = _body(f"You are helpful.\nuser_name: Alice\n{POLICY}", q)
    cur = _body(f"You are helpful.\nuser_name: Bob\n{POLICY}", q)
    brk = explain(prev, cur)
    assert brk is not None and (brk.rule, brk.detail) == ("PC003", "user_name")
    _at(brk, cur, "Bob")
    # A tenant-declared variable that promptlint does not know by name.
    prev = _body(f"You are helpful.\nloyalty tier: gold\n{POLICY}", q)
    cur = _body(f"You are helpful.\nloyalty tier: silver\n{POLICY}", q)
    assert explain(prev, cur).rule == "other"
    assert explain(prev, cur, per_user_vars=("loyalty_tier",)).rule == "PC003"


def test_system_prompt_differing_between_end_users_is_pc003():
    q = [{"role": "user", "content": "hi"}]
    prev = _body(f"You are helping Alice Smith.\n{POLICY}", q, user="u-1")
    cur = _body(f"You are helping Robert Jones.\n{POLICY}", q, user="u-2")
    brk = explain(prev, cur)
    assert brk is not None and (brk.rule, brk.detail) == ("PC003", "user")
    # Same end user, same difference: a prompt edit, not a per-user value.
    assert explain(prev, {**cur, "user": "u-1"}).rule == "other"


def test_short_shared_prefix_is_pc007_with_a_counter():
    def count(text):
        return len(text.split())

    prev = _body("Be brief.", [{"role": "user", "content": "Question A?"}], tools=None)
    cur = _body("Be brief.", [{"role": "user", "content": "Question B?"}], tools=None)
    brk = explain(prev, cur, min_prefix_tokens=1024, count_tokens=count)
    assert brk is not None and brk.rule == "PC007" and brk.token_position == count(render(cur).text[:brk.position])
    assert explain(prev, cur, min_prefix_tokens=2, count_tokens=count) is None


def test_token_position_and_inputs_not_mutated():
    prev = _body(f"Now: 2026-11-29T10:00:00Z\n{POLICY}", [{"role": "user", "content": "x"}])
    cur = _body(f"Now: 2026-11-29T11:00:00Z\n{POLICY}", [{"role": "user", "content": "x"}])
    snap = copy.deepcopy((prev, cur))
    brk = explain(prev, cur, count_tokens=lambda t: len(t) // 4)
    assert brk.token_position == brk.position // 4
    assert (prev, cur) == snap


def test_every_break_rule_is_a_registered_rule_or_other():
    codes = set(all_rules())
    from promptlint.explain import RULE_NAMES
    for code, name in RULE_NAMES.items():
        assert code == "other" or all_rules()[code].name == name
    assert "PC012" in codes


@pytest.mark.parametrize(("a", "b", "n"), [("", "", 0), ("abc", "abd", 2), ("abc", "abc", 3), ("ab", "abc", 2),
                                           ("x" * 1000 + "y", "x" * 1000 + "z", 1000)])
def test_first_divergence(a, b, n):
    assert first_divergence(a, b) == n
