"""The bounded counter of prefill-computed prefixes: exact space-saving counts on a fixed stream,
the capacity bound and the error guarantee, and what ``LLMEngine`` counts (the first computed full
prompt block of each request, by tenant label) in ``stats()``."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from engine_core_fakes import scope
from test_llm_engine import BS, greq, make_engine, prompt, run_all

from engine.computed_prefixes import ComputedPrefixes, HeavyHitter, SpaceSaving
from engine.prefix_index import extend_block_hashes


def test_space_saving_exact_counts_on_a_fixed_stream():
    s: SpaceSaving[str] = SpaceSaving(3)
    for key in "aabacab":  # a:4 b:2 c:1, three distinct keys fit: exact
        s.add(key)
        s.check_integrity()
    assert s.top(3) == [HeavyHitter("a", 4, 0), HeavyHitter("b", 2, 0), HeavyHitter("c", 1, 0)]
    # d replaces the oldest key of the smallest count (c: 1) and inherits it as its error
    s.add("d")
    s.check_integrity()
    assert s.top(3) == [HeavyHitter("a", 4, 0), HeavyHitter("b", 2, 0), HeavyHitter("d", 2, 1)]
    # now b and d tie at 2: e evicts b, the older of the two
    s.add("e")
    s.check_integrity()
    assert s.top(3) == [HeavyHitter("a", 4, 0), HeavyHitter("e", 3, 2), HeavyHitter("d", 2, 1)]
    assert s.total == 9 and len(s) == 3
    assert s.top(1) == [HeavyHitter("a", 4, 0)]


def test_space_saving_bound_and_error_guarantee_on_a_skewed_stream():
    rng = random.Random(21)
    keys = [f"k{min(int(rng.paretovariate(1.2)), 500)}" for _ in range(20_000)]
    s: SpaceSaving[str] = SpaceSaving(16)
    for k in keys:
        s.add(k)
        assert len(s) <= 16
    s.check_integrity()
    true = Counter(keys)
    hitters = s.top(16)
    for h in hitters:
        assert h.count - h.error <= true[h.key] <= h.count
    # every key more frequent than total / capacity is tracked
    tracked = {h.key for h in hitters}
    assert {k for k, n in true.items() if n > len(keys) / 16} <= tracked
    assert hitters[0].key == true.most_common(1)[0][0]


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        SpaceSaving(0)


def test_computed_prefixes_count_the_first_computed_full_block():
    hashes: list = []
    extend_block_hashes(b"ns", list(range(40)), 8, hashes)  # 5 full blocks of 8
    c = ComputedPrefixes(capacity=4)
    c.observe("t1", "acme", hashes, 43, 0, 8)  # nothing cached: block 0
    c.observe("t1", "acme", hashes, 43, 16, 8)  # 2 blocks hit: block 2
    c.observe("t1", "acme", hashes, 43, 0, 8)
    c.observe("t1", "acme", hashes, 43, 40, 8)  # every full block hit: counts nothing
    c.observe("t2", "beta", hashes[:1], 7, 0, 8)  # shorter than a block: counts nothing
    top = c.top(hex_chars=12)
    assert top == {"t1": {"tenant": "acme", "prefixes": [{"hash": hashes[0].hex()[:12], "count": 2, "error": 0},
                                                         {"hash": hashes[2].hex()[:12], "count": 1, "error": 0}]}}


def test_computed_prefixes_are_kept_per_tenant_key_not_per_label():
    """Two tenants whose names are cut to the same metrics label keep separate counters."""
    hashes: list = []
    extend_block_hashes(b"ns", list(range(16)), 8, hashes)
    c = ComputedPrefixes(capacity=4)
    c.observe("id-victim", "abcdefghij", hashes, 16, 0, 8)
    c.observe("id-snoop", "abcdefghij", hashes, 16, 8, 8)
    top = c.top(hex_chars=12)
    assert top["id-victim"]["prefixes"] == [{"hash": hashes[0].hex()[:12], "count": 1, "error": 0}]
    assert top["id-snoop"]["prefixes"] == [{"hash": hashes[1].hex()[:12], "count": 1, "error": 0}]


def test_engine_stats_name_the_prefix_prefill_recomputes_by_hash_per_tenant():
    # caching off: every request computes its prompt from block 0
    engine, _ = make_engine(caching=False)
    shared = prompt(3, 3 * BS + 2)
    for i in range(3):
        engine.add_request(greq(f"a{i}", shared, max_tokens=2, tenant=scope("acme")))
    engine.add_request(greq("b0", prompt(5, 2 * BS), max_tokens=2, tenant=scope("beta")))
    run_all(engine)
    want: list = []
    extend_block_hashes(b"acme", shared[: 3 * BS], BS, want)
    got = engine.stats()["computed_prefixes"]  # keyed by tenant key in hex (a plain scope's: its namespace)
    acme, beta = b"acme".hex(), b"beta".hex()
    assert got[acme] == {"tenant": "acme", "prefixes": [{"hash": want[0].hex()[:12], "count": 3, "error": 0}]}
    assert [e["count"] for e in got[beta]["prefixes"]] == [1]
    # caching on: the repeats hit, so only the first request computed the shared prefix
    engine, _ = make_engine(caching=True)
    for i in range(3):
        engine.add_request(greq(f"a{i}", shared, max_tokens=2, tenant=scope("acme")))
        run_all(engine)
    assert engine.stats()["computed_prefixes"] == {
        acme: {"tenant": "acme", "prefixes": [{"hash": want[0].hex()[:12], "count": 1, "error": 0}]}}
