"""Property tests for the explainer on random requests: no false breaks, breaks where they must be."""

from __future__ import annotations

import copy

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from promptlint.explain import explain, first_divergence, render
from tests.promptlint.test_promptlint_canon_properties import _body, _message, _names


@settings(max_examples=40, deadline=None)
@given(_body)
def test_identical_requests_never_break_and_inputs_are_not_mutated(body):
    snap = copy.deepcopy(body)
    assert explain(body, copy.deepcopy(body)) is None
    assert body == snap


@settings(max_examples=40, deadline=None)
@given(_body, st.lists(_message, min_size=1, max_size=3))
def test_appending_messages_is_never_a_break(body, more):
    longer = {**body, "messages": [*body["messages"], *more]}
    assert explain(body, longer) is None


@settings(max_examples=40, deadline=None)
@given(_body, st.lists(_names, min_size=2, max_size=5, unique=True))
def test_reordered_distinct_tools_are_pc004_before_any_message(body, names):
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in names]
    shuffled = tools[1:] + tools[:1]
    brk = explain({**body, "tools": tools}, {**body, "tools": shuffled})
    assert brk is not None and (brk.rule, brk.detail, brk.where) == ("PC004", "tools-reordered", "tools")


@settings(max_examples=40, deadline=None)
@given(_body, _body)
def test_a_reported_position_is_the_first_difference(a, b):
    brk = explain(a, b)
    assume(brk is not None)
    ta, tb = render(a).text, render(b).text
    assert brk.position == first_divergence(ta, tb) and ta[: brk.position] == tb[: brk.position]
    assert brk.position < min(len(ta), len(tb))
