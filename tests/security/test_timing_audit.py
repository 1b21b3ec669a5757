"""Timing audit (Gu et al. 2025, two-sample KS on TTFT): the deterministic half, for `make test`.

The audit's statistical half (a KS test on wall-clock timings) fails by chance at its own
significance level and depends on the machine's load, so it lives only in the slow suite
(``tests/slow/test_timing_audit_full.py``: 250 trials per side, within-tenant p < 1e-6 and
across-tenant p > 0.05). What the fast suite can assert exactly is the mechanism the timings
would reveal: the same interleaved attack/control trials, and the cached tokens each side was
told. Within a tenant every attack trial is a hit and every control trial a miss (the audit has a
signal to find); across tenants no trial hits at all (there is nothing to find).
"""

from __future__ import annotations

from security_helpers import timing_audit


def test_hit_is_served_from_cache_within_a_tenant(gateway) -> None:
    client, keys, _ = gateway
    res = timing_audit(client, keys["acme"], keys["acme"], trials=12, seed=1)
    assert res["control_cached"] == 0
    assert res["attack_cached"] >= 12 * 16, res["attack_cached"]  # each attack reuses >= one block


def test_cross_tenant_trials_never_hit(gateway) -> None:
    client, keys, _ = gateway
    res = timing_audit(client, keys["acme"], keys["beta"], trials=24, seed=2)
    assert res["attack_cached"] == 0 and res["control_cached"] == 0
