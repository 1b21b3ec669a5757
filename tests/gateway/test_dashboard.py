"""The operations panel's numbers: refused requests counted, bounded percentiles, tenant-id filtering,
/metrics protection, the time-series ring, and agreement of panel, ledger and /metrics.

Real tenancy (SQLite ledger, real rpm quotas, real pricing) and the gateway's fake engine
(``gateway_fakes.FakeEngine``: a real prefix cache over word tokens, no model), in process.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import FakeEngine
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.cli.serve_cmd import build_settings, register
from gateway.metrics import GatewayMetrics, LiveStats, Outcome, RequestSample, percentile
from gateway.settings import GatewaySettings
from gateway.timeseries import TimeSeries, latency_quantiles
from tenancy.report import percentile as ledger_percentile
from tenancy.service import TenancyService

SYSTEM = "You are the terse support assistant of ExampleCo. Answer in one line. " * 4
CHAT = {"model": "tiny", "max_tokens": 3,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "opening hours?"}]}
LONG_A = "a" * 32 + "-alpha"  # both names cut to the same 32-character metrics label
LONG_B = "a" * 32 + "-bravo"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def panel(tmp_path: Path):
    svc = TenancyService.open(tmp_path / "home")
    keys = {
        "limited": svc.create_tenant("limited", rpm=6).api_key,
        "other": svc.create_tenant("other").api_key,
        "long_a": svc.create_tenant(LONG_A).api_key,
        "long_b": svc.create_tenant(LONG_B).api_key,
        "admin": svc.create_tenant("ops", admin=True).api_key,
    }
    app = create_app(GatewaySettings(metrics_token="scrape-token"), engine=FakeEngine(), tenancy=svc)
    with TestClient(app) as client:
        yield client, keys, app
    svc.close()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}")]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_rejected_requests_are_counted_in_metrics_dashboard_and_ledger(panel):
    client, keys, _ = panel
    codes = [client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["limited"])).status_code
             for _ in range(10)]
    assert codes.count(200) == 6 and codes.count(429) == 4  # rpm 6
    scrape = client.get("/metrics", headers=auth("scrape-token")).text
    assert metric(scrape, "prefixgate_gateway_requests_total", tenant="limited") == 10
    assert metric(scrape, "prefixgate_gateway_requests_total", tenant="limited", outcome="ok") == 6
    assert metric(scrape, "prefixgate_gateway_requests_total", tenant="limited", outcome="429_rate_limit") == 4
    # a 400 is counted too, as 4xx
    assert client.post("/v1/chat/completions", json={**CHAT, "n": 99}, headers=auth(keys["other"])).status_code == 400
    scrape = client.get("/metrics", headers=auth("scrape-token")).text
    assert metric(scrape, "prefixgate_gateway_requests_total", tenant="other", outcome="4xx") == 1

    # a body that fails validation is refused after its key was authenticated: counted too, with a ledger row
    bad = client.post("/v1/chat/completions", json={"model": "tiny"}, headers=auth(keys["other"]))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "missing_required_parameter"
    scrape = client.get("/metrics", headers=auth("scrape-token")).text
    assert metric(scrape, "prefixgate_gateway_requests_total", tenant="other", outcome="4xx") == 2
    other = client.get("/dashboard/data", headers=auth(keys["other"])).json()["tenants"][0]
    assert (other["requests"], other["errors"]) == (2, 2)
    assert client.get("/v1/usage", headers=auth(keys["other"])).json()["totals"]["requests"] == 2

    row = client.get("/dashboard/data", headers=auth(keys["limited"])).json()["tenants"]
    assert [(r["tenant"], r["requests"], r["errors"]) for r in row] == [("limited", 10, 4)]
    assert row[0]["by_outcome"] == {"ok": 6, "429_rate_limit": 4}
    ledger = client.get("/v1/usage", headers=auth(keys["limited"])).json()["totals"]
    assert (ledger["requests"], ledger["errors"]) == (10, 4)


def test_no_percentile_exceeds_the_slowest_request():
    # 19 fast requests and one slow: "exclusive" quantiles (statistics' default) put p95 past 3.25 s
    values = sorted([0.2] * 19 + [3.25])
    for q in (50, 95, 99, 100):
        assert percentile(values, q) <= 3.25
        assert percentile(values, q) == ledger_percentile(values, q)  # the same method as the ledger report
    live = LiveStats()
    for v in values:
        live.add(RequestSample(tenant_id="t1", tenant="t", outcome=Outcome.OK, prompt=1, ttft=v, latency=v + 1,
                               completion=5))
    row = live.snapshot()[0]
    assert row["ttft_p95_s"] <= row["ttft_max_s"] == 3.25
    quantiles = latency_quantiles(live.observations(0, float("inf")))
    assert quantiles["ttft_p99"] <= quantiles["ttft_max"] == 3.25
    assert quantiles["tpot_p99"] <= quantiles["tpot_max"] == pytest.approx(0.25)


def test_dashboard_filters_by_tenant_id_not_by_the_32_character_label(panel):
    client, keys, _ = panel
    for _ in range(3):
        client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["long_a"]))
    client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["long_b"]))
    a = client.get("/dashboard/data", headers=auth(keys["long_a"])).json()
    b = client.get("/dashboard/data", headers=auth(keys["long_b"])).json()
    assert [(r["tenant"], r["requests"]) for r in a["tenants"]] == [(LONG_A, 3)]
    assert [(r["tenant"], r["requests"]) for r in b["tenants"]] == [(LONG_B, 1)]
    assert a["totals"]["requests"] == 3 and b["totals"]["requests"] == 1
    assert {m["tenant"] for m in b["ledger"]["models"]} == {LONG_B}
    assert [i["tenant"] for i in b["isolation"]] == [LONG_B]
    assert b["series"] is None  # engine-wide charts are the operator's
    admin = client.get("/dashboard/data", headers=auth(keys["admin"])).json()
    assert {r["tenant"] for r in admin["tenants"]} == {LONG_A, LONG_B}
    isolation = {i["tenant"]: i for i in admin["isolation"]}
    assert set(isolation) >= {LONG_A, LONG_B, "limited", "other", "ops"}
    assert isolation[LONG_A]["spill_encrypted"] is True  # seen: its context carries its data-key cipher
    assert isolation["limited"]["spill_encrypted"] is None  # no request yet: unknown, not claimed
    assert isolation["limited"]["quotas"]["rpm"] == 6 and isolation["ops"]["last_key_created_at"] > 0


def test_metrics_need_the_metrics_token_or_an_admin_key(panel, tmp_path):
    client, keys, _ = panel
    assert client.get("/metrics").status_code == 401
    assert client.post("/v1/chat/completions", json=CHAT, headers=auth("sk-nobody")).status_code == 401
    scrape = client.get("/metrics", headers=auth("scrape-token")).text
    # /metrics' own 401s count like any route's (audit operator F5): a Prometheus without its token shows
    assert "prefixgate_gateway_unauthenticated_requests_total 2.0" in scrape
    assert client.get("/metrics", headers=auth("wrong")).json()["error"]["code"] == "invalid_api_key"
    scrape = client.get("/metrics", headers=auth("scrape-token")).text
    assert "prefixgate_gateway_unauthenticated_requests_total 3.0" in scrape
    denied = client.get("/metrics", headers=auth(keys["other"]))
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
    for credential in ("scrape-token", keys["admin"]):
        ok = client.get("/metrics", headers=auth(credential))
        assert ok.status_code == 200 and "prefixgate_gateway_requests_total" in ok.text
    svc = TenancyService.open(tmp_path / "open")
    try:
        with TestClient(create_app(GatewaySettings(metrics_public=True), engine=FakeEngine(), tenancy=svc)) as c:
            assert c.get("/metrics").status_code == 200  # opted in: a listener only Prometheus reaches
    finally:
        svc.close()


def test_panel_numbers_equal_the_ledger_and_metrics(panel):
    client, keys, _ = panel
    for name, n in (("other", 4), ("long_a", 2)):
        for i in range(n):
            body = {**CHAT, "messages": [*CHAT["messages"][:1], {"role": "user", "content": f"question {i % 2}"}]}
            assert client.post("/v1/chat/completions", json=body, headers=auth(keys[name])).status_code == 200
    for _ in range(8):  # 6 ok + 2 refused
        client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["limited"]))
    panel_data = client.get("/dashboard/data?window=1h", headers=auth(keys["admin"])).json()
    scrape = client.get("/metrics", headers=auth("scrape-token")).text
    ledger = {r["tenant"]: r for r in client.get("/v1/usage?since=1h", headers=auth(keys["admin"])).json()["tenants"]}
    assert panel_data["ledger"]["totals"]["requests"] == sum(r["requests"] for r in ledger.values()) == 14
    for row in panel_data["tenants"]:
        label = row["tenant"][:32]
        ours = ledger[row["tenant"]]
        assert (row["requests"], row["errors"]) == (ours["requests"], ours["errors"] + ours["aborted"])
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert row[field] == ours[field], field
            assert row[field] == metric(scrape, f"prefixgate_gateway_{field}_total", tenant=label), field
        assert row["requests"] == metric(scrape, "prefixgate_gateway_requests_total", tenant=label)
        assert row["cost_usd"] == pytest.approx(ours["cost_usd"], abs=1e-9)
        assert row["cost_usd"] == pytest.approx(metric(scrape, "prefixgate_gateway_cost_usd_total", tenant=label),
                                                abs=1e-9)
        assert row["saved_usd"] == pytest.approx(ours["saved_usd"], abs=1e-9)
        assert row["saved_usd"] == pytest.approx(metric(scrape, "prefixgate_gateway_saved_usd_total", tenant=label),
                                                 abs=1e-9)
        assert row["ttft_p95_s"] == pytest.approx(ours["ttft_p95_s"])
    # the panel's per-model unit cost is the ledger's cost over its tokens
    for m in panel_data["ledger"]["models"]:
        if m["tokens"]:
            assert m["cost_per_1m_usd"] == pytest.approx(m["cost_usd"] * 1e6 / m["tokens"])
    # the prompts computed most are named by family (a hash), never by prompt text
    computed = panel_data["cache"]["most_computed"]
    assert computed and all("ExampleCo" not in c["family"] for c in computed)
    assert sum(c["computed_tokens"] for c in computed) == sum(
        r["prompt_tokens"] - r["cached_tokens"] for r in panel_data["tenants"])


def test_time_series_rates_windows_and_bounds():
    registry, now = CollectorRegistry(), [1000.0]
    metrics, live = GatewayMetrics(registry), LiveStats(clock=lambda: now[0])
    series = TimeSeries(registry, live, clock=lambda: now[0])
    series.sample()
    for step in range(1, 200):
        now[0] += 5
        metrics.count("acme", "local", "ok", Outcome.OK)
        metrics.prompt_tokens.labels("acme", "local").inc(100)
        metrics.cached_tokens.labels("acme", "local").inc(25)
        live.add(RequestSample(tenant_id="t", tenant="acme", outcome=Outcome.OK, ttft=0.1 * (step % 3 + 1)))
        series.sample()
    five = series.series("5m")
    assert len(five["t"]) == 61 and five["step_s"] == 5  # bounded: 300 s at 5 s (+ the rate's base point)
    assert five["series"]["requests.ok"][-1] == pytest.approx(1 / 5)  # one request per 5 s
    assert five["series"]["hit_rate"][-1] == pytest.approx(0.25)
    assert max(v for v in five["series"]["ttft_p99"] if v is not None) <= 0.3 + 1e-9
    hour = series.series("1h")
    assert hour["step_s"] == 60 and 16 <= len(hour["t"]) <= 18  # 995 s of samples, one a minute
    assert hour["series"]["requests.ok"][-1] == pytest.approx(1 / 5)
    assert len(series.series("24h")["t"]) == 1


def test_dashboard_page_and_vendored_assets_need_no_network(panel):
    client, keys, _ = panel
    page = client.get("/dashboard").text
    assert not re.search(r"""(src|href)=["']https?:""", page)
    js = client.get("/dashboard/assets/uPlot.iife.min.js")
    assert js.status_code == 200 and "uPlot" in js.text[:2000]
    assert client.get("/dashboard/assets/dashboard.js").status_code == 200
    assert client.get("/dashboard/assets/..%2Fmetrics.py").status_code == 404
    assert client.get("/dashboard/data?window=7d", headers=auth(keys["admin"])).status_code == 400



def test_serve_metrics_flags(tmp_path, monkeypatch):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    bad = subprocess.run([sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(tmp_path), "--model",
                          "none", "--metrics-token-env", "PG_UNSET_TOKEN"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "PG_UNSET_TOKEN" in bad.stderr
    parser = argparse.ArgumentParser()  # flags -> settings, as `serve` parses them
    register(parser.add_subparsers(), argparse.ArgumentParser(add_help=False))
    monkeypatch.setenv("PG_SCRAPE", "tok-1")
    args = parser.parse_args(["serve", "--model", "none", "--metrics-token-env", "PG_SCRAPE", "--metrics-public"])
    settings = build_settings(args, tmp_path)
    assert settings.metrics_token == "tok-1" and settings.metrics_public
    monkeypatch.setenv("PREFIXGATE_METRICS_TOKEN", "tok-2")
    assert build_settings(parser.parse_args(["serve", "--model", "none"]), tmp_path).metrics_token == "tok-2"


def test_recomputed_prefixes_are_filtered_by_tenant_id_not_by_the_label(tmp_path, tiny_engine):
    """The engine counts recomputed prefixes per tenant id: a tenant sharing another's 32-character
    label, or re-created under a deleted tenant's name, sees none of its rows."""
    svc = TenancyService.open(tmp_path / "home")
    keys = {"a": svc.create_tenant(LONG_A).api_key, "b": svc.create_tenant(LONG_B).api_key,
            "admin": svc.create_tenant("ops", admin=True).api_key}
    try:
        with TestClient(create_app(GatewaySettings(), engine=tiny_engine, tenancy=svc)) as client:
            for _ in range(2):
                assert client.post("/v1/chat/completions", json=CHAT, headers=auth(keys["a"])).status_code == 200

            def prefixes(key: str) -> list[dict]:
                return client.get("/dashboard/data", headers=auth(key)).json()["cache"]["computed_prefixes"]

            own = prefixes(keys["a"])
            assert own and {r["tenant"] for r in own} == {LONG_A[:32]}
            assert prefixes(keys["admin"]) == own
            assert prefixes(keys["b"]) == []  # same label, another tenant
            svc.delete_tenant(LONG_A)
            again = svc.create_tenant(LONG_A).api_key
            assert prefixes(again) == []  # the deleted tenant's counts are not the new one's
    finally:
        svc.close()


def test_cache_pays_counts_only_the_local_engines_hits(tmp_path, tiny_model_dir, monkeypatch):
    """"Does the cache pay" prices hit tokens at the local engine's prefill seconds per token, so it
    counts the local engine's hits only: cached tokens a provider route reports (here an upstream
    PrefixGate over the fake engine) are no saving of this engine's (audit operator F3)."""
    from gateway_fakes import FakeTenancy, LoopbackServer

    from gateway.settings import RouteConfig

    monkeypatch.setenv("PG_TEST_UPSTREAM_KEY", "sk-upstream")
    up_tenancy = FakeTenancy()
    up_tenancy.keys["sk-upstream"] = up_tenancy.keys.pop(up_tenancy.add("gatewayco"))
    route = RouteConfig(model="up-tiny", provider="openai/tiny", api_key_env="PG_TEST_UPSTREAM_KEY",
                        max_model_len=256, transport="direct", api_base="http://127.0.0.1:9/v1")
    svc = TenancyService.open(tmp_path / "home")
    keys = {"acme": svc.create_tenant("acme").api_key, "admin": svc.create_tenant("ops", admin=True).api_key}
    try:
        with LoopbackServer(create_app(GatewaySettings(), engine=FakeEngine(), tenancy=up_tenancy)) as up:
            route = route.model_copy(update={"api_base": f"{up.url}/v1"})
            settings = GatewaySettings(model="tiny", model_dir=tiny_model_dir, kv_blocks=128, routes=(route,),
                                       metrics_token="scrape-token")
            with TestClient(create_app(settings, tenancy=svc)) as client:
                for model in ("tiny", "tiny", "up-tiny", "up-tiny", "up-tiny"):
                    r = client.post("/v1/chat/completions", json={**CHAT, "model": model}, headers=auth(keys["acme"]))
                    assert r.status_code == 200, r.text
                scrape = client.get("/metrics", headers=auth("scrape-token")).text
                cache = client.get("/dashboard/data", headers=auth(keys["admin"])).json()["cache"]
    finally:
        svc.close()
    engine_hits = metric(scrape, "prefixgate_prompt_tokens_hit_total", tenant="acme")
    reported = metric(scrape, "prefixgate_gateway_cached_tokens_total", tenant="acme", backend="direct:openai/tiny")
    assert engine_hits > 0 and reported > 0  # both kinds of cached tokens were there to be mixed up
    def unlabelled(name: str) -> float:
        return float(re.search(rf"^{name} (\S+)$", scrape, re.MULTILINE).group(1))

    per_token = unlabelled("prefixgate_prefill_seconds_total") / unlabelled("prefixgate_prefill_tokens_total")
    assert cache["prefill_seconds_saved"] == pytest.approx(engine_hits * per_token, rel=1e-6)
