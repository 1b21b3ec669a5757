"""Timing audit (Gu et al. 2025, two-sample KS on TTFT): a fast variant for `make test`.

Within one tenant a hit must be detectable (that is the cache working, and shows the audit has
the power to see a shared cache); across tenants the attacker's timings must look like misses.
The 200+-samples-per-side audit at p > 0.05 is ``tests/slow/test_timing_audit_full.py``. Here, with
60 trials per side, we assert p > 0.01 across tenants: a correct system then fails by chance in
1 run of 100 rather than 1 in 20, while a shared cache (D near 1 within the tenant, p ~ 1e-20)
is still caught at once.
"""

from __future__ import annotations

from security_helpers import summarize, timing_audit


def test_hit_is_detectable_within_a_tenant(gateway) -> None:
    client, keys, _ = gateway
    res = timing_audit(client, keys["acme"], keys["acme"], trials=30, seed=1)
    assert res["control_cached"] == 0 and res["attack_cached"] > 0
    assert res["p"] < 1e-3, (res["D"], res["p"], summarize(res["attack"]), summarize(res["control"]))


def test_cross_tenant_timings_are_indistinguishable_from_misses(gateway) -> None:
    client, keys, _ = gateway
    res = timing_audit(client, keys["acme"], keys["beta"], trials=60, seed=2)
    assert res["attack_cached"] == 0 and res["control_cached"] == 0
    assert res["p"] > 0.01, (res["D"], res["p"], summarize(res["attack"]), summarize(res["control"]))
