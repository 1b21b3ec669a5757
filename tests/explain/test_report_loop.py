"""The loop without the HTTP layer: tracker -> ledger (real SQLite) -> report -> promptlint --from-usage."""

from __future__ import annotations

import json
import time

import pytest

from gateway.miss_tracker import MissTracker, usage_fields
from promptlint.cli import main as promptlint_main
from promptlint.explain import render
from tenancy import report
from tenancy.service import TenancyService
from tenancy.types import UsageRecord

POLICY = "\n".join(f"Rule {i}: answer from the handbook, cite the section, stay polite and brief." for i in range(30))
TEMPLATE = "You are Acme's support assistant.\nCurrent time: {timestamp}\n" + POLICY + "\n"


def _body(ts, question="Where is my order?", user=None):
    body = {"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": TEMPLATE.replace("{timestamp}", ts).strip()},
        {"role": "user", "content": question}]}
    if user:
        body["user"] = user
    return body


@pytest.fixture
def svc(tmp_path):
    s = TenancyService.open(tmp_path / "home")
    yield s
    s.close()


def _serve(svc, tracker, ctx, body, request_id, cached):
    """What the gateway does per request: observe, 'run' (cached tokens given), settle, record usage."""
    obs = tracker.observe(ctx.tenant_id, body)
    prompt_tokens = len(render(body).text) // 4
    rec = tracker.settle(obs, request_id=request_id, prompt_tokens=prompt_tokens, cached_tokens=cached)
    svc.record_usage(UsageRecord(request_id, ctx.tenant_id, ctx.key_id, body["model"], "local", prompt_tokens,
                                 cached, 5, 0.01, 0.02, "ok", time.time(), **usage_fields(rec)))
    return rec


def test_breaks_reach_the_report_per_tenant_and_promptlint_finds_the_template_line(svc, tmp_path, capsys):
    # acme opts in to keeping the text around a break (off by default): promptlint needs it to find the line
    a = svc.authenticate(svc.create_tenant("acme", admin=True, store_miss_context=True).api_key)
    b = svc.authenticate(svc.create_tenant("globex").api_key)
    tracker = MissTracker()
    for i in range(4):
        _serve(svc, tracker, a, _body(f"2026-11-29T10:0{i}:00Z"), f"a{i}", cached=0)
    _serve(svc, tracker, b, _body("2026-11-29T10:00:00Z", user="u1"), "b0", cached=0)
    _serve(svc, tracker, b, _body("2026-11-29T10:00:00Z", "Refund?", user="u1"), "b1", cached=300)

    rep = svc.report()
    assert [(x["tenant"], x["rule"], x["requests"]) for x in rep["breaks"]] == [("acme", "PC002", 3)]
    assert rep["breaks"][0]["tokens_lost"] > 0 and rep["breaks"][0]["usd_lost"] > 0
    assert {m["request_id"] for m in rep["misses"]} == {"a1", "a2", "a3"}
    assert all(m["rule"] == "PC002" and m["detail"] == "timestamp" for m in rep["misses"])
    assert "Top cache-break reasons" in report.render_table(rep)
    assert '<table id="breaks">' in report.render_html(rep) and "<td>PC002</td>" in report.render_html(rep)
    # globex's own view holds none of acme's break records
    mine = svc.usage(b)
    assert mine["misses"] == [] and mine["breaks"] == []
    assert len(svc.usage(a, tenant="acme")["misses"]) == 3

    # The exported report drives promptlint to the template line with the timestamp.
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "support.txt").write_text(TEMPLATE)
    exported = tmp_path / "usage.json"
    exported.write_text(report.render_json(rep))
    capsys.readouterr()
    code = promptlint_main(["check", str(tmp_path / "prompts"), "--from-usage", str(exported), "--format", "json"])
    live = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["message"].startswith("live traffic")]
    assert code == 1 and [(f["code"], f["line"]) for f in live] == [("PC002", 2)]
    assert "3 request(s)" in live[0]["message"]
