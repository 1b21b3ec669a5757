"""Cache-creation tokens in the ledger (#24): schema v5 on SQLite and PostgreSQL, priced at the
provider's cache-write rate where litellm's map has one, summed in reports and /v1/usage's shape."""

from __future__ import annotations

import pytest

from tenancy import report
from tenancy.db import SCHEMA_VERSION
from tenancy.pricing import PriceBook
from tenancy.service import TenancyService
from tenancy.types import UsageRecord
from tests.fleetutil import read_rows


def _rec(ctx, rid: str, model: str, prompt: int, cached: int, written: int) -> UsageRecord:
    return UsageRecord(rid, ctx.tenant_id, ctx.key_id, model, "provider", prompt, cached, 3, 0.05, 0.1, "ok",
                       1_700_000_000.0, cache_creation_tokens=written)


def test_written_tokens_are_priced_as_cache_writes_where_the_map_has_a_price() -> None:
    book = PriceBook()
    _, r = book.rates_for("claude-sonnet-4-5")
    assert r.cache_write is not None and r.cache_write > r.input  # Anthropic: writes cost 1.25x input
    p = book.price("anthropic/claude-sonnet-4-5", 145, 100, 3, cache_creation_tokens=40)
    want = 5 * r.input + 100 * r.cache_read + 40 * r.cache_write + 3 * r.output
    assert p.cost_usd == pytest.approx(want, rel=1e-12)
    assert p.saved_usd == pytest.approx(100 * (r.input - r.cache_read))
    # no cache-write price in the map (OpenAI): a written token costs what an input token costs
    plain = book.price("gpt-4o-mini", 145, 100, 3)
    assert book.price("gpt-4o-mini", 145, 100, 3, cache_creation_tokens=40) == plain
    with pytest.raises(ValueError, match="cache_creation_tokens"):
        book.price("gpt-4o-mini", 145, 100, 3, cache_creation_tokens=46)


def test_a_record_cannot_write_more_than_its_uncached_prompt() -> None:
    with pytest.raises(ValueError, match="cannot exceed prompt_tokens"):
        UsageRecord("r", "t", "k", "m", "local", 10, 6, 0, None, None, "ok", 0.0, cache_creation_tokens=5)
    with pytest.raises(ValueError, match=">= 0"):
        UsageRecord("r", "t", "k", "m", "local", 10, 6, 0, None, None, "ok", 0.0, cache_creation_tokens=-1)


def test_the_ledger_stores_them_and_reports_sum_them(svc: TenancyService) -> None:
    a = svc.authenticate(svc.create_tenant("a").api_key)
    b = svc.authenticate(svc.create_tenant("b").api_key)
    svc.record_usage(_rec(a, "r1", "claude-sonnet-4-5", 145, 100, 40))
    svc.record_usage(_rec(a, "r2", "claude-sonnet-4-5", 145, 140, 0))
    svc.record_usage(_rec(b, "r3", "gpt-4o-mini", 50, 0, 16))
    svc.flush()
    rows = {r["request_id"]: r for r in read_rows(svc, "SELECT request_id, cache_creation_tokens, cost_usd FROM usage")}
    assert {k: r["cache_creation_tokens"] for k, r in rows.items()} == {"r1": 40, "r2": 0, "r3": 16}
    want = PriceBook().price("claude-sonnet-4-5", 145, 100, 3, cache_creation_tokens=40).cost_usd
    assert rows["r1"]["cost_usd"] == pytest.approx(want, rel=1e-9)
    own = svc.usage(a)  # what GET /v1/usage answers: the caller's tenant only
    assert own["totals"]["cache_creation_tokens"] == 40
    assert [r["cache_creation_tokens"] for r in own["rows"]] == [40]
    rep = svc.report()
    assert rep["totals"]["cache_creation_tokens"] == 56
    assert {t["tenant"]: t["cache_creation_tokens"] for t in rep["tenants"]} == {"a": 40, "b": 16}
    assert "cache write tok" in report.render_table(rep)
    header, *lines = report.render_csv(rep).splitlines()
    assert header.split(",")[-1] == "cache_creation_tokens" and lines[0].split(",")[-1] == "40"


def test_a_v4_ledger_gains_the_column_and_keeps_its_rows(home, open_service) -> None:
    svc = open_service(home)
    a = svc.authenticate(svc.create_tenant("a").api_key)
    tenant_id = a.tenant_id
    db = svc.database.connect()
    try:  # put the store back to v4, as the previous release left it, with one row of its own
        with db.transaction():
            db.execute("ALTER TABLE usage DROP COLUMN cache_creation_tokens")
            db.execute("DROP TABLE chat_completions")  # v6's, which a v4 store has not either
            db.execute("DELETE FROM schema_version WHERE version >= 5")
            db.execute("INSERT INTO usage (request_id, tenant_id, key_id, model, backend, prompt_tokens, cached_tokens,"
                       " completion_tokens, status, created_at, cost_usd, saved_usd, priced_as)"
                       " VALUES ('old', ?, 'k', 'm', 'local', 10, 5, 1, 'ok', 1.0, 0.0, 0.0, 'm')", [tenant_id])
    finally:
        db.close()
    svc.close()
    again = open_service(home)  # migrates v4 -> v5 -> the latest
    try:
        assert [v["version"] for v in read_rows(again, "SELECT version FROM schema_version ORDER BY version")] == \
            list(range(1, SCHEMA_VERSION + 1))
        assert read_rows(again, "SELECT request_id, cache_creation_tokens FROM usage") == [
            {"request_id": "old", "cache_creation_tokens": 0}]
        assert again.report()["totals"]["cache_creation_tokens"] == 0
    finally:
        again.close()
