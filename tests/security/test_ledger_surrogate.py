"""Issue 16 item 1 through the real gateway: a tenant whose ``prompt_cache_key`` and ``user`` hold a
lone surrogate, plus a prefix break in that family, does not stop the ledger: the other tenant's
rows commit, and both tenants' ``/v1/usage`` and budget checks answer at once."""

from __future__ import annotations

import time

from security_helpers import auth


def _chat(client, key: str, system: str, extra: str = "") -> int:
    # Raw JSON: "\ud800" is a lone surrogate once parsed, which no UTF-8 encoder accepts.
    body = ('{"model": "tiny", "max_tokens": 1, "temperature": 0, "messages": ['
            f'{{"role": "system", "content": "{system}"}}, {{"role": "user", "content": "hi"}}]{extra}}}')
    r = client.post("/v1/chat/completions", content=body.encode(),
                    headers={**auth(key), "content-type": "application/json"})
    return r.status_code


def test_a_lone_surrogate_family_does_not_stop_the_ledger(gateway) -> None:
    client, keys, app = gateway
    lead = "You are a careful assistant. " * 20
    statuses = [_chat(client, keys["acme"], lead + f"Request {i} at 12:0{i}.",
                      ', "prompt_cache_key": "\\ud800", "user": "\\udfff"') for i in range(3)]
    assert all(s < 500 for s in statuses), statuses
    for i in range(5):
        assert _chat(client, keys["beta"], f"beta {i}") == 200
    t0 = time.monotonic()
    r = client.get("/v1/usage", headers=auth(keys["beta"]))
    assert r.status_code == 200 and time.monotonic() - t0 < 5.0
    assert r.json()["totals"]["requests"] >= 5
    r = client.get("/v1/usage", headers=auth(keys["acme"]))
    assert r.status_code == 200
    assert app.state.tenancy.ledger_stats().lost == 0
