"""The shipped Prometheus rules and Grafana dashboard against a real Prometheus and a real server.

``promtool check rules`` and ``promtool test rules`` pass; a real ``prometheus`` scrapes a real
``prefixgate serve`` with the metrics token as its bearer token (and fails with a 401 without it),
loads the rules, evaluates them without errors, and answers every query of the Grafana dashboard.
Skipped, saying why, where Debian's ``prometheus`` package (prometheus + promtool) is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tenancy.service import TenancyService
from tests.serverutil import METRICS_TOKEN, free_port, serve_tiny, stop

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "prefixgate-rules.yml"
RULES_TEST = REPO / "deploy" / "prometheus" / "prefixgate-rules.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "prefixgate-dashboard.json"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")


@needs_promtool
def test_promtool_checks_and_unit_tests_the_rules():
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent,
                          capture_output=True, text=True, timeout=120)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr
    alerts = {r["alert"] for g in _yaml(RULES)["groups"] for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for case in _yaml(RULES_TEST)["tests"] for t in case["alert_rule_test"]}
    assert alerts == tested  # every alert has a unit test
    assert {"PrefixGateHitRateCollapse", "PrefixGateKVPressure", "PrefixGateQueueingForMemory",
            "PrefixGateRestoreFailures", "PrefixGateTierAuthFailures", "PrefixGateBudgetBurn"} <= alerts


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _grafana_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return [e.replace("$__rate_interval", "1m").replace("$tenant", ".*") for e in exprs]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    home = tmp_path_factory.mktemp("prom-home")
    with TenancyService.open(home) as svc:
        key = svc.create_tenant("acme").api_key
        svc.flush()
    url, server = serve_tiny(home, "--kv-blocks", "64", "--dram-bytes", "8MiB", timeout=300)
    work = tmp_path_factory.mktemp("prom")
    token = work / "token"
    token.write_text(METRICS_TOKEN)
    token.chmod(0o600)
    target = url.removeprefix("http://")
    (work / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: prefixgate
    authorization: {{type: Bearer, credentials_file: "{token}"}}
    static_configs: [{{targets: ["{target}"]}}]
  - job_name: prefixgate-without-token
    static_configs: [{{targets: ["{target}"]}}]
""")
    port = free_port()
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=(work / "prometheus.log").open("wb"),
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    system = "You are the support assistant of ExampleCo. Answer briefly. " * 4
    for i in range(6):
        client.chat.completions.create(model="tiny", max_tokens=3, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"question {i % 2}"}])
    try:
        yield f"http://127.0.0.1:{port}", work
    finally:
        prom.terminate()
        prom.wait(20)
        stop(server)


def _api(prom: str, path: str, **params: str) -> dict:
    r = httpx.get(f"{prom}/api/v1/{path}", params=params, timeout=10, trust_env=False)
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]


def _wait(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = what()
            if got:
                return got
        except (httpx.HTTPError, AssertionError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what.__doc__}")
        time.sleep(0.5)


def test_prometheus_scrapes_the_server_with_the_metrics_token(scraped):
    prom, work = scraped

    def targets():
        """both targets scraped once"""
        active = _api(prom, "targets")["activeTargets"]
        return {t["labels"]["job"]: t for t in active} if all(t["health"] != "unknown" for t in active) else None

    got = _wait(targets)
    assert got["prefixgate"]["health"] == "up", got["prefixgate"]
    assert got["prefixgate-without-token"]["health"] == "down"
    assert "401" in got["prefixgate-without-token"]["lastError"]

    def requests():
        """the gateway's request counter in Prometheus"""
        return _api(prom, "query", query='sum(prefixgate_gateway_requests_total{job="prefixgate",outcome="ok"})')[
            "result"]

    assert float(_wait(requests)[0]["value"][1]) == 6
    hit = _api(prom, "query", query='sum(prefixgate_prompt_tokens_hit_total{job="prefixgate"})')["result"]
    assert float(hit[0]["value"][1]) > 0


def test_prometheus_loads_and_evaluates_every_rule(scraped):
    prom, _ = scraped

    def evaluated():
        """every rule evaluated at least once"""
        groups = _api(prom, "rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = _wait(evaluated)
    in_file = yaml.safe_load(RULES.read_text())
    assert len(rules) == sum(len(g["rules"]) for g in in_file["groups"])  # every rule of the file loaded
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_prometheus_answers_every_grafana_query(scraped):
    prom, _ = scraped
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "prefixgate" and len(dash["panels"]) >= 15
    queries = _grafana_queries()
    assert len(queries) >= 25
    for expr in queries:
        _api(prom, "query", query=expr)  # a PromQL error is a status "error" (asserted in _api)
    # and the metrics they chart exist in a real scrape
    names = set(_api(prom, "label/__name__/values"))
    for needed in ("prefixgate_gateway_ttft_seconds_bucket", "prefixgate_tpot_seconds_bucket",
                   "prefixgate_waiting_requests", "prefixgate_kv_blocks_used", "prefixgate_tier_bytes_used",
                   "prefixgate_cache_manage_seconds_total", "prefixgate_gateway_cost_usd_total"):
        assert needed in names, needed


def _grafana_expr(panel_id: int, legend: str) -> str:
    dash = json.loads(DASHBOARD.read_text())
    panel = next(p for p in dash["panels"] if p["id"] == panel_id)
    expr = next(t["expr"] for t in panel["targets"] if t.get("legendFormat") == legend)
    return expr.replace("$__rate_interval", "5m").replace("$tenant", ".*")


@needs_promtool
def test_grafana_fleet_queries_add_up_per_engine(tmp_path):
    """Two engines (one full, one idle; different block sizes and speeds): the KV bytes panel is the
    sum of each engine's own bytes (not the product of fleet sums: 2 nodes read 4x the truth), and
    "prefill saved" prices each engine's hits at its own prefill seconds per token; "unit cost" and
    "saved" per 1M tokens divide by the same tokens (audit operator F2, F4)."""
    a, b = 'instance="node-a:8000"', 'instance="node-b:8000"'
    series = {
        # node-a: 30 used + 10 evictable of 100 blocks of 16 tokens, 1000 B/token; node-b: 5 + 5 of 20
        # blocks of 32 tokens, 500 B/token (free blocks include the evictable ones)
        f"prefixgate_kv_blocks_used{{{a}}}": "30x10", f"prefixgate_kv_blocks_evictable{{{a}}}": "10x10",
        f"prefixgate_kv_blocks_free{{{a}}}": "70x10", f"prefixgate_kv_blocks_free{{{b}}}": "15x10",
        f"prefixgate_kv_block_size{{{a}}}": "16x10", f"prefixgate_kv_bytes_per_token{{{a}}}": "1000x10",
        f"prefixgate_kv_blocks_used{{{b}}}": "5x10", f"prefixgate_kv_blocks_evictable{{{b}}}": "5x10",
        f"prefixgate_kv_block_size{{{b}}}": "32x10", f"prefixgate_kv_bytes_per_token{{{b}}}": "500x10",
        # per minute: node-a hits 600 tokens, computes 60 in 6 s (0.1 s/token); node-b hits 60 and
        # computes 600 in 6 s (0.01 s/token)
        f'prefixgate_prompt_tokens_hit_total{{tenant="acme",{a}}}': "0+600x10",
        f"prefixgate_prefill_tokens_total{{{a}}}": "0+60x10", f"prefixgate_prefill_seconds_total{{{a}}}": "0+6x10",
        f'prefixgate_prompt_tokens_hit_total{{tenant="acme",{b}}}': "0+60x10",
        f"prefixgate_prefill_tokens_total{{{b}}}": "0+600x10", f"prefixgate_prefill_seconds_total{{{b}}}": "0+6x10",
        # tenant acme, per minute: 0.6 USD spent and 0.6 saved over 360 prompt + 240 completion tokens
        'prefixgate_gateway_cost_usd_total{tenant="acme"}': "0+0.6x10",
        'prefixgate_gateway_saved_usd_total{tenant="acme"}': "0+0.6x10",
        'prefixgate_gateway_prompt_tokens_total{tenant="acme",backend="local"}': "0+360x10",
        'prefixgate_gateway_completion_tokens_total{tenant="acme",backend="local"}': "0+240x10",
    }
    hbm_bytes = 40 * 16 * 1000 + 10 * 32 * 500  # 800,000 B
    saved_s_per_s = (600 * 0.1 + 60 * 0.01) / 60  # 1.01 s of prefill saved per second
    case = {
        "rule_files": [str(RULES)], "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": name, "values": values} for name, values in series.items()],
            "promql_expr_test": [
                {"expr": _grafana_expr(11, "HBM held"), "eval_time": "8m",
                 "exp_samples": [{"labels": "{}", "value": hbm_bytes}]},
                {"expr": f"round({_grafana_expr(16, 'prefill saved')}, 0.0001)", "eval_time": "8m",
                 "exp_samples": [{"labels": "{}", "value": round(saved_s_per_s, 4)}]},
                # cost and saving per 1M tokens share one denominator, prompt + completion (as the panel)
                {"expr": f"round({_grafana_expr(17, '{{tenant}}')})", "eval_time": "8m",
                 "exp_samples": [{"labels": '{tenant="acme"}', "value": 1000}]},
                {"expr": f"round({_grafana_expr(18, '{{tenant}}')})", "eval_time": "8m",
                 "exp_samples": [{"labels": '{tenant="acme"}', "value": 1000}]},
                {"expr": _grafana_expr(10, "HBM held {{instance}}"), "eval_time": "8m",
                 "exp_samples": [{"labels": f"{{{a}}}", "value": 0.4}, {"labels": f"{{{b}}}", "value": 0.5}]},
            ],
        }],
    }
    (tmp_path / "grafana.test.yml").write_text(yaml.safe_dump(case))
    unit = subprocess.run([PROMTOOL, "test", "rules", "grafana.test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr
