"""Miss explanations on the cache's block grid (token ids, the engine's block size) and with
cache_control breakpoints (promptlint.miss, through the gateway's MissTracker)."""

from __future__ import annotations

import copy

from gateway.miss_tracker import MissTracker
from promptlint.explain import first_divergence, render
from promptlint.miss import PromptFacts

POLICY = "\n".join(f"Rule {i}: answer from the handbook, cite the section, stay polite and brief." for i in range(30))


def _ids(body):
    """A real, deterministic tokenizer for the test: one token per UTF-8 byte of the rendering."""
    return list(render(body).text.encode())


def _body(ts="2026-11-29T10:00:00Z", *, mark_ttl=None, lead_mark=False, question="Where is my order?"):
    """A /v1/messages request as the door hands it on: system blocks as text parts, marks kept."""
    parts = [{"type": "text", "text": "Hi.\n"}, {"type": "text", "text": f"Current time: {ts}\n{POLICY}"}]
    if lead_mark:
        parts[0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    if mark_ttl is not None:
        parts[1]["cache_control"] = {"type": "ephemeral", "ttl": mark_ttl}
    return {"model": "tiny", "prompt_cache_key": "support",
            "messages": [{"role": "system", "content": parts}, {"role": "user", "content": question}]}


def _run(t, body, rid, cached=0, ids=True):
    token_ids = _ids(body) if ids else None
    obs = t.observe("acme", body, token_ids=token_ids)
    prompt = len(token_ids) if ids else obs.prompt_tokens
    return obs, t.settle(obs, request_id=rid, prompt_tokens=prompt, cached_tokens=cached)


def test_break_position_is_the_block_boundary_of_the_common_token_prefix():
    t = MissTracker(block_size=16)
    first, later = _body(), _body(ts="2026-11-29T10:05:00Z")
    _run(t, first, "r1")
    obs, rec = _run(t, later, "r2", cached=32)
    common = first_divergence(_ids(first), _ids(later))
    assert (rec.rule, rec.detail) == ("PC002", "timestamp")
    assert rec.position == common // 16 * 16 and rec.position % 16 == 0 and rec.position < common
    # reachable: the near-hit's full blocks before its own input (the user question), in its tokens
    reachable = render(first).segments[-1].start // 16 * 16
    assert obs.reachable_tokens == reachable and rec.tokens_lost == reachable - 32
    # another block size, another grid
    t8 = MissTracker(block_size=128)
    _run(t8, first, "r1")
    _, rec8 = _run(t8, later, "r2")
    assert rec8.position == common // 128 * 128


def test_a_change_inside_a_marked_prefix_is_a_breakpoint_break():
    t = MissTracker(block_size=16)
    _run(t, _body(mark_ttl="5m"), "r1")
    _, rec = _run(t, _body(ts="2026-11-29T10:05:00Z", mark_ttl="5m"), "r2")
    assert (rec.rule, rec.detail, rec.name) == ("PC010", "breakpoint-changed", "cache-breakpoint-after-dynamic")
    assert "messages.0.content.1.cache_control" in rec.message and "PC002 timestamp" in rec.message
    # the same change with no breakpoint is the plain timestamp break
    t = MissTracker(block_size=16)
    _run(t, _body(), "r1")
    assert _run(t, _body(ts="2026-11-29T10:05:00Z"), "r2")[1].rule == "PC002"


def test_a_breakpoint_shorter_than_one_block_was_never_written():
    t = MissTracker(block_size=16)
    _run(t, _body(lead_mark=True), "r1")
    obs, rec = _run(t, _body(lead_mark=True, question="And my refund?"), "r2", cached=0)  # evicted meanwhile
    assert (rec.rule, rec.detail) == ("unwritten", "below-one-block")
    assert "less than one 16-token cache block" in rec.message and rec.position == 0
    # served from cache after all: nothing is recorded
    assert t.settle(obs, request_id="r3", prompt_tokens=obs.prompt_tokens, cached_tokens=obs.reachable_tokens) is None


def test_a_prefix_no_earlier_request_marked_was_not_kept():
    t = MissTracker(block_size=16)
    _run(t, _body(), "r1")
    _, rec = _run(t, _body(mark_ttl="1h", question="And my refund?"), "r2", cached=0)
    assert (rec.rule, rec.detail) == ("unwritten", "no-earlier-breakpoint")
    assert rec.position > 0 and rec.position % 16 == 0


def test_ttl_expiry_explains_a_miss_with_nothing_changed():
    clock = [0.0]
    t = MissTracker(block_size=16, clock=lambda: clock[0])
    _run(t, _body(mark_ttl="5m"), "r1")
    clock[0] = 100.0  # within 5 minutes: a miss here is plain eviction, no breakpoint story
    obs, _ = _run(t, _body(mark_ttl="5m", question="Second?"), "r2")
    assert obs.brk is None
    clock[0] = 500.0  # 400 s after r2
    _, rec = _run(t, _body(mark_ttl="5m", question="Third?"), "r3", cached=0)
    assert (rec.rule, rec.detail) == ("ttl", "5m") and "400 s later" in rec.message
    clock[0] = 1000.0  # a 1h mark is still alive after 500 s
    _run(t, _body(mark_ttl="1h"), "r4")
    clock[0] = 1500.0
    obs, _ = _run(t, _body(mark_ttl="1h", question="Fifth?"), "r5")
    assert obs.brk is None


def test_facts_locate_each_breakpoint_in_the_rendering():
    body = _body(mark_ttl="1h", lead_mark=True)
    facts = PromptFacts.of(body, token_ids=_ids(body), block_size=16, seen_at=0.0)
    text = render(body).text
    lead, policy = facts.marks
    assert text[: lead.char_end].endswith("Hi.\n") and text[: policy.char_end].endswith(POLICY)
    assert lead.breakpoint.param == "messages.0.content.0.cache_control" and policy.breakpoint.ttl == "1h"
    # invalid marks (a 1h after a 5m) give no breakpoints: the doors refuse such a request anyway
    bad = copy.deepcopy(body)
    bad["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "5m"}
    assert PromptFacts.of(bad, token_ids=None, block_size=16, seen_at=0.0).marks == ()
