"""The full timing audit: 250 trials per side, two-sample KS at p > 0.05 (Gu et al. 2025)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from security_helpers import summarize, timing_audit

pytestmark = pytest.mark.slow

TRIALS = 250


@pytest.fixture(scope="module")
def client_keys(slow_home):
    from engine.launch import default_tiny_dir
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    home, keys = slow_home
    # 2048 blocks: 1000 prompts of ~11 blocks fit, so no eviction blurs the within-tenant hits
    app = create_app(GatewaySettings(home=home, model="tiny", model_dir=default_tiny_dir(home), kv_blocks=2048))
    with TestClient(app) as client:
        yield client, keys


def test_full_audit(client_keys) -> None:
    client, keys = client_keys
    within = timing_audit(client, keys["acme"], keys["acme"], trials=TRIALS, seed=11)
    across = timing_audit(client, keys["acme"], keys["beta"], trials=TRIALS, seed=12)
    report = {
        name: {"D": r["D"], "p": r["p"], "attack": summarize(r["attack"]), "control": summarize(r["control"]),
               "attack_cached_tokens": r["attack_cached"]}
        for name, r in (("within_tenant", within), ("across_tenants", across))
    }
    print("\nTIMING AUDIT " + json.dumps(report, indent=2))
    assert within["p"] < 1e-6
    assert across["attack_cached"] == 0
    assert across["p"] > 0.05, report
