"""Reports: every figure equals the sums over ledger rows; formats; the HTML renders in Chromium."""

from __future__ import annotations

import csv
import io
import json
import random
import re
import shutil
import statistics
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tenancy import report
from tenancy.service import TenancyService
from tenancy.types import UsageRecord
from tests.fleetutil import read_rows

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.fixture
def filled(svc: TenancyService) -> TenancyService:
    """Three tenants, three models, 300 requests over the last 3 days (seeded)."""
    rng = random.Random(7)
    ctxs = [svc.authenticate(svc.create_tenant(n).api_key) for n in ("alpha", "beta", "gamma")]
    now = time.time()
    for i in range(300):
        ctx = rng.choice(ctxs)
        prompt = rng.randint(1, 4000)
        status = rng.choice(["ok"] * 8 + ["error", "aborted"])
        svc.record_usage(UsageRecord(
            f"req-{i}", ctx.tenant_id, ctx.key_id, rng.choice(["gpt-4o-mini", "gpt-4o", "local-tiny"]), "local",
            prompt, rng.choice([0, rng.randint(0, prompt)]), rng.randint(0, 500),
            rng.uniform(0.01, 2.0) if status == "ok" else None, rng.uniform(0.1, 5.0), status,
            now - rng.uniform(0, 3 * 86400),
        ))
    svc.flush()
    return svc


def _ledger(svc: TenancyService) -> list[dict]:
    return read_rows(svc, "SELECT u.*, t.name FROM usage u JOIN tenants t ON t.id = u.tenant_id")


def test_report_figures_equal_the_sums_of_ledger_rows(filled: TenancyService) -> None:
    rep = filled.report()
    ledger = _ledger(filled)
    assert rep["schema"] == "prefixgate.report/v1"
    assert len(rep["rows"]) == len({(r["name"], r["model"]) for r in ledger})
    for row in rep["rows"]:
        mine = [r for r in ledger if r["name"] == row["tenant"] and r["model"] == row["model"]]
        assert row["requests"] == len(mine)
        assert row["ok"] + row["errors"] + row["aborted"] == len(mine)
        assert row["errors"] == sum(r["status"] == "error" for r in mine)
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert row[field] == sum(r[field] for r in mine), field
        assert row["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in mine), rel=1e-9)
        assert row["saved_usd"] == pytest.approx(sum(r["saved_usd"] for r in mine), rel=1e-9)
        assert row["hit_rate"] == pytest.approx(row["cached_tokens"] / row["prompt_tokens"])
        assert row["request_hit_rate"] == pytest.approx(sum(r["cached_tokens"] > 0 for r in mine) / len(mine))
        ttfts = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
        cuts = statistics.quantiles(ttfts, n=100, method="inclusive")  # independent oracle (linear)
        assert row["ttft_p50_s"] == pytest.approx(cuts[49])
        assert row["ttft_p95_s"] == pytest.approx(cuts[94])
    totals = rep["totals"]
    assert totals["requests"] == 300 == sum(t["requests"] for t in rep["tenants"])
    assert totals["prompt_tokens"] == sum(r["prompt_tokens"] for r in ledger)
    assert totals["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in ledger), rel=1e-9)
    # the timeline partitions the same rows
    assert sum(p["requests"] for p in rep["timeline"]) == 300
    assert sum(p["cached_tokens"] for p in rep["timeline"]) == totals["cached_tokens"]
    assert rep["bucket_s"] == 86400  # > 2 days of data: daily buckets


def test_since_and_tenant_filters(filled: TenancyService) -> None:
    since = datetime.now(UTC) - timedelta(days=1)
    alpha = filled.get_tenant_by_name("alpha")
    rep = filled.report(tenant_ids=[alpha.tenant_id], since=since)
    want = [r for r in _ledger(filled) if r["name"] == "alpha" and r["created_at"] >= since.timestamp()]
    assert rep["totals"]["requests"] == len(want) > 0
    assert rep["totals"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in want)
    assert {r["tenant"] for r in rep["rows"]} == {"alpha"}
    assert rep["bucket_s"] == 3600


def test_deleted_tenants_rows_stay_in_the_report(filled: TenancyService) -> None:
    gamma = filled.get_tenant_by_name("gamma")
    before = filled.report()["totals"]
    filled.delete_tenant("gamma")
    rep = filled.report()
    assert rep["totals"]["requests"] == before["requests"]
    assert f"deleted:{gamma.tenant_id}" in {t["tenant"] for t in rep["tenants"]}


def test_csv_json_and_table_carry_the_same_numbers(filled: TenancyService) -> None:
    rep = filled.report()
    parsed = list(csv.DictReader(io.StringIO(report.render_csv(rep))))
    assert len(parsed) == len(rep["rows"])
    for got, want in zip(parsed, rep["rows"]):
        assert (got["tenant"], got["model"], int(got["requests"]), int(got["cached_tokens"])) == \
            (want["tenant"], want["model"], want["requests"], want["cached_tokens"])
        assert float(got["cost_usd"]) == pytest.approx(want["cost_usd"])
    assert json.loads(report.render_json(rep)) == rep
    table = report.render_table(rep)
    total_line = table.strip().splitlines()[-1].split()
    assert total_line[0] == "TOTAL" and int(total_line[1]) == rep["totals"]["requests"]


def test_empty_report_renders(svc: TenancyService) -> None:
    rep = svc.report()
    assert rep["rows"] == [] and rep["totals"]["requests"] == 0 and rep["totals"]["ttft_p50_s"] is None
    for fmt in report.RENDERERS:
        assert report.RENDERERS[fmt](rep)


@pytest.mark.parametrize("text,seconds", [("7d", 7 * 86400), ("24h", 86400), ("30m", 1800), ("2w", 14 * 86400)])
def test_parse_since(text: str, seconds: int) -> None:
    now = datetime(2026, 3, 1, tzinfo=UTC)
    assert report.parse_since(text, now) == now - timedelta(seconds=seconds)


def test_parse_since_dates_and_errors() -> None:
    assert report.parse_since("2026-01-31") == datetime(2026, 1, 31, tzinfo=UTC)
    with pytest.raises(ValueError, match="--since"):
        report.parse_since("last tuesday")


def test_percentile_is_linear_interpolation() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    for q in (10, 50, 95):
        assert report.percentile(xs, q) == pytest.approx(cuts[q - 1])
    assert report.percentile(xs, 0) == 1.0 and report.percentile(xs, 100) == 5.0
    assert report.percentile([2.5], 95) == 2.5
    assert report.percentile([], 50) is None


def _chromium(url: str, tmp: Path) -> tuple[str, str]:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0", "--dump-dom", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, out.stderr


def _console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI installs it: apt-get install chromium)")
def test_html_report_renders_in_headless_chromium_without_console_errors(filled: TenancyService,
                                                                         tmp_path: Path) -> None:
    # a client-chosen model name is data, never markup (the CSP would also log any inline script)
    ctx = filled.authenticate(filled.create_key("alpha").api_key)
    nasty = "</script><script>console.error('xss')</script><!--<b>x"
    filled.record_usage(UsageRecord("nasty", ctx.tenant_id, ctx.key_id, nasty, "local", 10, 0, 1, 0.1, 0.2, "ok",
                                    time.time()))
    rep = filled.report()
    page = tmp_path / "report.html"
    page.write_text(report.render_html(rep), encoding="utf-8")
    # the detector itself works: a page with a script error is caught
    probe = tmp_path / "probe.html"
    probe.write_text("<html><body><script>undefinedFunction()</script></body></html>")
    _, probe_err = _chromium(probe.as_uri(), tmp_path)
    assert any("undefinedFunction" in line for line in _console_lines(probe_err))

    dom, stderr = _chromium(page.as_uri(), tmp_path)
    assert _console_lines(stderr) == []  # no script errors, no blocked (network) loads under the CSP
    assert dom.count("<svg") == 2 and 'id="chart-hit-rate"' in dom and 'id="chart-cost-saved"' in dom
    # every tenant x model row is in the rendered table with its request count
    cells = re.findall(r'<td class="requests">(\d+)</td>', dom)
    assert sorted(map(int, cells)) == sorted([r["requests"] for r in rep["rows"]] + [rep["totals"]["requests"]])
    assert len(re.findall(r"<polyline", dom)) == 3  # one hit-rate line per tenant
    island = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', dom, re.S)
    assert json.loads(island.group(1))["totals"] == rep["totals"]
    assert nasty in {r["model"] for r in json.loads(island.group(1))["rows"]}
    assert "&lt;/script&gt;&lt;script&gt;console.error('xss')&lt;/script&gt;&lt;!--&lt;b&gt;x" in dom
    assert "<b>x" not in dom
    for name in ("https://", "http://", "<link", "src="):
        assert name not in page.read_text(), f"the report must be self-contained: found {name!r}"
