"""The fleet simulation's model, checked on small deterministic traces (seeded; no timing)."""

from __future__ import annotations

from benchmarks.fleet_sim import (
    BLOCK_TOKENS,
    EventIndex,
    FleetConfig,
    Policy,
    Replica,
    TraceConfig,
    build_trace,
    simulate,
)


def test_replica_lru_hits_the_longest_cached_prefix_and_evicts_oldest_first() -> None:
    rep = Replica(capacity=4)
    evicted: list[int] = []
    rep.insert([1, 2, 3], evicted)
    assert rep.cached_prefix([1, 2, 3, 4]) == 3 and rep.cached_prefix([2, 3]) == 2 and rep.cached_prefix([9, 1]) == 0
    rep.insert([1, 5, 6], evicted)  # 1 is touched, so 2 is the oldest: 5 blocks, one goes
    assert evicted == [2] and rep.cached_prefix([1, 2]) == 1 and rep.cached_prefix([3, 1, 5, 6]) == 4


def test_event_index_follows_stored_and_evicted_events() -> None:
    idx = EventIndex()
    idx.stored(0, [10, 11, 12])
    idx.stored(1, [10, 11])
    assert idx.longest([10, 11, 12, 13]) == (3, {0})
    idx.evicted(0, [12])
    assert idx.longest([10, 11, 12]) == (2, {0, 1})
    idx.evicted(0, [10, 11])
    idx.evicted(1, [10])
    assert idx.longest([10, 11]) == (0, set())


def test_trace_is_deterministic_and_prefixes_are_fixed_per_template() -> None:
    cfg = TraceConfig(tenants=5, requests=400, seed=3)
    a, b = build_trace(cfg, 10.0), build_trace(cfg, 10.0)
    assert [(r.t, r.tenant, r.template) for r in a.requests] == [(r.t, r.tenant, r.template) for r in b.requests]
    lengths: dict[tuple[int, int], set[int]] = {}
    for r in a.requests:
        lengths.setdefault((r.tenant, r.template), set()).add(r.prefix_blocks)
    assert all(len(v) == 1 for v in lengths.values())
    assert all(r.prefix_blocks * BLOCK_TOKENS in cfg.prefix_tokens for r in a.requests)


def test_pure_affinity_piles_one_tenant_onto_few_replicas_and_the_bounded_policies_do_not() -> None:
    fleet = FleetConfig(replicas=16, load=0.7)
    tcfg = TraceConfig(tenants=1, requests=16 * 60, templates_per_tenant=(1, 1), seed=1)
    trace = build_trace(tcfg, 0.7 * 16 * fleet.prefill_tok_s / 2000)
    affinity = simulate(Policy.PREFIX_HASH, fleet, trace, 1)
    aware = simulate(Policy.CACHE_AWARE, fleet, trace, 1)
    rr = simulate(Policy.ROUND_ROBIN, fleet, trace, 1)
    # one template: pure affinity gives all the work to one replica of 16
    assert affinity.imbalance > 15.9
    assert aware.imbalance < affinity.imbalance / 2
    assert aware.ttft_p99_ms < affinity.ttft_p99_ms
    # the cache-aware router reuses at least as much as spraying requests round-robin
    assert aware.hit_rate >= rr.hit_rate


def test_cache_aware_beats_round_robin_on_hits_when_prefixes_do_not_fit_everywhere() -> None:
    fleet = FleetConfig(replicas=8, cache_blocks=600, load=0.6)
    tcfg = TraceConfig(tenants=40, requests=8 * 80, seed=2)
    trace = build_trace(tcfg, 0.6 * 8 * fleet.prefill_tok_s / 2000)
    aware = simulate(Policy.CACHE_AWARE, fleet, trace, 40)
    rr = simulate(Policy.ROUND_ROBIN, fleet, trace, 40)
    assert aware.hit_rate > rr.hit_rate + 0.1
