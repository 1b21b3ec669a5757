"""``POST /v1/cache/warm`` refusals are counted like every door's: each gets its ledger row (status
error) and takes a place in the tenant's rate limit (issue 16.9), whether the body fails the schema
(an unknown field, a bad ttl) or names a model the local engine does not serve."""

from __future__ import annotations

import httpx
from gateway_fakes import LoopbackServer

from gateway.app import create_app
from gateway.settings import GatewaySettings, RouteConfig
from tenancy.service import TenancyService
from tests.fleetutil import read_rows

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]


def test_warm_refusals_are_in_the_ledger_and_take_rpm(tmp_path, tiny_engine, monkeypatch):
    monkeypatch.setenv("PG_WARM_UPSTREAM_KEY", "sk-unused")
    svc = TenancyService.open(tmp_path)
    key = svc.create_tenant("w1", rpm=3).api_key
    # a provider route: resolvable without the network, but not the local engine's
    route = RouteConfig(model="elsewhere", provider="openai/gpt-4o-mini", api_base="http://127.0.0.1:9/v1",
                        api_key_env="PG_WARM_UPSTREAM_KEY")
    app = create_app(GatewaySettings(routes=(route,)), engine=tiny_engine, tenancy=svc)
    try:
        with LoopbackServer(app) as srv, httpx.Client(base_url=srv.url, trust_env=False, timeout=60,
                                                        headers={"Authorization": f"Bearer {key}"}) as http:
            refused = [
                http.post("/v1/cache/warm", json={"model": "tiny", "messages": MESSAGES, "role": "bogus"}),
                http.post("/v1/cache/warm", json={"model": "tiny", "messages": MESSAGES, "ttl": "7h"}),
                http.post("/v1/cache/warm", json={"model": "elsewhere", "messages": MESSAGES}),
            ]
            assert [r.status_code for r in refused] == [400, 400, 400], [r.text for r in refused]
            assert refused[2].json()["error"]["param"] == "model"
            over = http.post("/v1/cache/warm", json={"model": "tiny", "messages": MESSAGES})
            assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
        svc.flush()
        assert [r["status"] for r in read_rows(svc, "SELECT status FROM usage")] == ["error"] * 4
    finally:
        svc.close()
