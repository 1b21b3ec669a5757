"""The gateway's miss tracker: breaks attributed to the right rule and position, bounded memory, isolation."""

from __future__ import annotations

import copy

import pytest
from prometheus_client import CollectorRegistry

from gateway.miss_tracker import MissTracker, break_counter, header_value
from promptlint.explain import render
from promptlint.miss import CHARS_PER_TOKEN, PromptFacts, family_key

POLICY = "\n".join(f"Rule {i}: answer from the handbook, cite the section, stay polite and brief." for i in range(40))


def _tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


TOOLS = [_tool("create_ticket"), _tool("lookup_order"), _tool("search_docs")]


def _body(ts="2026-11-29T10:00:00Z", tools=TOOLS, history=(), question="Where is my order?", **extra):
    system = f"You are Acme's assistant.\nCurrent time: {ts}\n{POLICY}"
    return {"model": "tiny", "tools": copy.deepcopy(list(tools)),
            "messages": [{"role": "system", "content": system}, *history, {"role": "user", "content": question}],
            **extra}


def _run(tracker, tenant, body, request_id, cached=0, prompt_tokens=None):
    obs = tracker.observe(tenant, body)
    prompt_tokens = prompt_tokens or obs.prompt_tokens  # what a provider would count, near enough
    return obs, tracker.settle(obs, request_id=request_id, prompt_tokens=prompt_tokens, cached_tokens=cached)


def test_timestamp_then_shuffled_tools_then_edited_history_each_attributed():
    t = MissTracker()
    hist = [{"role": "user", "content": "My order 1 is late."},
            {"role": "assistant", "content": "It ships tomorrow."}]
    _, first = _run(t, "acme", _body(history=hist), "r1")
    assert first is None  # nothing to compare with: a cold miss is not a break

    # 1. the client stamps the time into the system prompt
    cur = _body(ts="2026-11-29T10:05:00Z", history=hist)
    obs, rec = _run(t, "acme", cur, "r2", cached=10)
    assert (rec.rule, rec.detail, rec.where) == ("PC002", "timestamp", "messages[0]")
    text = render(cur).text
    assert rec.char_position == text.index("2026-11-29T10:05") + len("2026-11-29T10:0")
    # No token ids (as on a provider route): the text stands in for tokens, and the break's position
    # is the block boundary where the cache stops: the full 16-token blocks before the timestamp.
    block_chars = 16 * CHARS_PER_TOKEN
    assert rec.position == rec.char_position // block_chars * 16
    assert rec.tokens_lost == obs.reachable_tokens - 10 > 0 and obs.reachable_tokens % 16 == 0

    # 2. same time, tools in another order (a dict-built registry)
    cur = _body(ts="2026-11-29T10:05:00Z", tools=[TOOLS[1], TOOLS[2], TOOLS[0]], history=hist)
    _, rec = _run(t, "acme", cur, "r3")
    assert (rec.rule, rec.detail, rec.where) == ("PC004", "tools-reordered", "tools")
    assert rec.char_position < render(cur).text.index("<system>")

    # 3. same tools and time, an earlier assistant turn rewritten
    edited = copy.deepcopy(hist)
    edited[1]["content"] = "It shipped today."
    cur = _body(ts="2026-11-29T10:05:00Z", tools=[TOOLS[1], TOOLS[2], TOOLS[0]], history=edited)
    _, rec = _run(t, "acme", cur, "r4")
    assert (rec.rule, rec.detail, rec.where) == ("PC012", "edited", "messages[2]")
    assert render(cur).text[rec.char_position:].startswith("ped today")  # "It ships" vs "It shipped"

    assert [r.rule for r in t.recent_breaks("acme")] == ["PC002", "PC004", "PC012"]


def test_a_break_that_cost_nothing_is_not_recorded_and_appends_are_not_breaks():
    t = MissTracker()
    _run(t, "acme", _body(), "r1")
    later = _body(ts="2026-11-29T10:05:00Z")
    obs = t.observe("acme", later)
    assert obs.brk is not None and obs.brk.rule == "PC002"
    pt = len(render(later).text) // 4
    # The engine served the whole reachable prefix anyway (another request had cached it).
    assert t.settle(obs, request_id="r2", prompt_tokens=pt, cached_tokens=pt) is None
    obs = t.observe("acme", _body(ts="2026-11-29T10:05:00Z", question="And my refund?"))
    assert obs.brk is None


def test_family_key_masks_dynamic_values_and_prefers_explicit_keys():
    assert family_key(_body()) == family_key(_body(ts="2031-01-01T00:00:00Z"))
    assert family_key(_body(user="u-7")) == "user:u-7"
    assert family_key(_body(user="u-7", prompt_cache_key="support")) == "prompt_cache_key:support"
    other = _body()
    other["messages"][0]["content"] = "You are a poet.\n" + POLICY
    assert family_key(other) != family_key(_body())


def test_memory_stays_bounded_with_many_tenants():
    t = MissTracker(families_per_tenant=3, requests_per_family=2, max_chars=200_000)
    for tenant in range(120):
        for fam in range(5):
            for i in range(3):
                body = _body(ts=f"2026-11-29T10:{i:02d}:00Z", prompt_cache_key=f"f{fam}")
                _run(t, f"tenant-{tenant}", body, f"{tenant}-{fam}-{i}")
    assert t.stored_chars <= 200_000
    # The accounting is exact: recount what is stored.
    assert t.stored_chars == sum(e.size for q in t._families.values() for e in q)
    assert all(len(q) <= 2 for q in t._families.values())
    assert max(t.families_of(f"tenant-{i}") for i in range(120)) <= 3
    assert t.family_count * 2 * len(render(_body()).text) >= t.stored_chars
    assert len(t._latest) <= t.family_count and len(t._records) <= t.family_count
    # The most recent tenant is still tracked and its next request is explained.
    _, rec = _run(t, "tenant-119", _body(ts="2026-11-29T11:00:00Z", prompt_cache_key="f4"), "x")
    assert rec is not None and rec.rule == "PC002"


def test_a_tenant_never_sees_another_tenants_requests_or_breaks():
    t = MissTracker()
    _run(t, "alpha", _body(), "a1")
    _, rec = _run(t, "alpha", _body(ts="2026-11-29T10:05:00Z"), "a2")
    assert rec is not None and rec.tenant == "alpha"
    # beta sends the same family's prompt: no near-hit of alpha's is used against it
    obs, rec = _run(t, "beta", _body(ts="2026-11-29T10:09:00Z"), "b1")
    assert obs.brk is None and rec is None
    assert t.recent_breaks("beta") == [] and [r.request_id for r in t.recent_breaks("alpha")] == ["a2"]


def test_unrelated_prompt_of_a_new_family_is_not_a_break():
    t = MissTracker()
    _run(t, "acme", _body(), "r1")
    poem = {"model": "tiny", "messages": [{"role": "system", "content": "You write haiku."},
                                          {"role": "user", "content": "autumn"}]}
    obs = t.observe("acme", poem)
    assert obs.brk is None
    # but a per-user line in a new family's system prompt is compared with the tenant's latest request
    a = {"model": "tiny", "messages": [{"role": "system", "content": f"user_name: Alice\n{POLICY}"},
                                       {"role": "user", "content": "hi"}]}
    b = copy.deepcopy(a)
    b["messages"][0]["content"] = f"user_name: Bob\n{POLICY}"
    t.observe("acme", a)
    assert t.observe("acme", b).brk.rule == "PC003"


def test_shared_blocks_counts_full_cache_blocks_of_the_common_token_prefix():
    body = _body()
    a = list(range(1000))
    b = a[:550] + [-1] + a[551:]

    def facts(ids, bs=100):
        return PromptFacts.of(body, token_ids=ids, block_size=bs, seen_at=0.0)

    assert facts(a).shared_blocks(facts(a)) == 10 and facts(a).shared_blocks(facts(b)) == 5
    assert facts(a[600:]).shared_blocks(facts(b[600:])) == 4  # after the break the blocks agree again
    assert facts(a[:599]).shared_blocks(facts(a)) == 5  # a partial last block is not shared
    assert facts(a, 16).shared_blocks(facts(b, 16)) == 550 // 16
    # no token ids on one side: the rendered text at CHARS_PER_TOKEN characters a token
    text_only = PromptFacts.of(body, token_ids=None, block_size=16, seen_at=0.0)
    assert text_only.shared_blocks(text_only) == len(render(body).text) // (16 * CHARS_PER_TOKEN)


def test_header_and_counter():
    t = MissTracker()
    _run(t, "acme", _body(), "r1")
    obs, rec = _run(t, "acme", _body(ts="2026-11-29T10:05:00Z"), "r2", cached=16)
    assert header_value(16, rec) == f"cached=16; break=PC002; detail=timestamp; pos={rec.position}"
    assert header_value(None, brk=obs.brk) == f"break=PC002; detail=timestamp; char={obs.brk.position}"
    assert header_value(32) == "cached=32"
    reg = CollectorRegistry()
    counter = break_counter(reg)
    counter.labels(tenant="acme", rule=rec.rule).inc()
    assert reg.get_sample_value("prefixgate_cache_breaks_total", {"tenant": "acme", "rule": "PC002"}) == 1.0


def test_bounds_are_validated():
    with pytest.raises(ValueError):
        MissTracker(requests_per_family=0)
