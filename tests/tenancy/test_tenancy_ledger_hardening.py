"""Issue 16 (items 1, 7, 9): one tenant's row never stops the ledger; client text is stored bounded
and valid; the ledger keeps no prompt text unless the tenant chose it. Real SQLite throughout."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from tenancy import db as dbmod
from tenancy.ledger import QUARANTINE_FILENAME, LedgerWriter, RetryPolicy, append_spill_file
from tenancy.miss_privacy import keyed_family
from tenancy.service import TenancyService
from tenancy.storable import (
    OPTIONAL_NUMBERS,
    REQUIRED_NUMBERS,
    REQUIRED_TEXT,
    TEXT_LIMITS,
    storable_number,
    storable_row,
    storable_text,
)
from tenancy.types import UsageRecord
from tests.fleetutil import read_rows


def _rows(where: Path | TenancyService, sql: str = "SELECT * FROM usage ORDER BY created_at") -> list[dict]:
    """Rows through the service's store (either backend), or straight from the SQLite file in ``where``."""
    if isinstance(where, TenancyService):
        return read_rows(where, sql)
    conn = sqlite3.connect(where / "prefixgate.db")
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute(sql)]
    conn.close()
    return rows


def _rec(ctx, rid: str, **kw) -> UsageRecord:
    fields = {"model": "gpt-4o-mini", "created_at": time.time()} | kw
    model, created = fields.pop("model"), fields.pop("created_at")
    return UsageRecord(rid, ctx.tenant_id, ctx.key_id, model, "local", 100, 0, 1, 0.05, 0.1, "ok", created,
                       **fields)


def _row(i: int, tenant: str = "t_a", **kw) -> dict:
    return {"request_id": f"r{i}", "tenant_id": tenant, "key_id": "k", "model": "m", "backend": "local",
            "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": 1, "ttft_s": 0.1, "latency_s": 0.2,
            "status": "ok", "created_at": 1_700_000_000.0 + i, "cost_usd": 0.0, "saved_usd": 0.0,
            "priced_as": "m"} | kw


def test_a_lone_surrogate_from_one_tenant_does_not_stop_the_ledger_for_others(svc: TenancyService) -> None:
    a = svc.authenticate(svc.create_tenant("a").api_key)
    b = svc.authenticate(svc.create_tenant("b", store_miss_context=True).api_key)
    # what the attack sent: a lone surrogate in prompt_cache_key / user, reaching miss_family,
    # plus the same in the model name and a NUL in the context
    svc.record_usage(_rec(a, "bad-1", model="m\ud800", miss_rule="PC003", miss_tokens=16,
                          miss_family="prompt_cache_key:\ud800", miss_context="x\ud800\x00y"))
    svc.record_usage(_rec(b, "bad-2", miss_rule="PC003", miss_tokens=16, miss_family="user:\udfff",
                          miss_context="ctx\ud800\x00"))
    for i in range(20):
        svc.record_usage(_rec(b, f"b{i}"))
    t0 = time.monotonic()
    svc.flush()
    assert time.monotonic() - t0 < 5.0
    rows = {r["request_id"]: r for r in _rows(svc)}
    assert {f"b{i}" for i in range(20)} <= set(rows)
    assert rows["bad-1"]["model"] == "m\ufffd" and rows["bad-1"]["miss_context"] is None
    assert rows["bad-2"]["miss_family"] == "user:\ufffd" and rows["bad-2"]["miss_context"] == "ctx\ufffd\ufffd"
    # the service still answers reads and budget checks for both tenants
    assert svc.usage(b)["totals"]["requests"] == 21
    svc.admit(a, estimated_tokens=10)
    assert svc.ledger_stats().lost == 0


def test_a_row_the_database_refuses_is_quarantined_and_the_rows_behind_it_commit(tmp_path: Path) -> None:
    db_path = tmp_path / "prefixgate.db"
    dbmod.connect(db_path).close()
    w = LedgerWriter(db_path, batch_max=64, max_delay_s=0.01)
    w.submit(_row(0, tenant="t_a"))
    w.submit(_row(1, tenant="t_a", status="not-a-status"))  # the CHECK constraint refuses it
    for i in range(2, 40):
        w.submit(_row(i, tenant="t_b"))
    w.flush(5.0)
    w.close()
    home = tmp_path
    ids = {r["request_id"] for r in _rows(home)}
    assert ids == {f"r{i}" for i in range(40)} - {"r1"}
    (q,) = _rows(home, "SELECT * FROM usage_quarantine")
    assert q["request_id"] == "r1" and q["tenant_id"] == "t_a" and "CHECK" in q["reason"]
    assert json.loads(q["row_json"])["status"] == "not-a-status"
    s = w.stats()
    assert (s.committed, s.quarantined, s.spilled, s.lost) == (39, 1, 0, 0)


def _hold_write_lock(db_path: Path) -> tuple[sqlite3.Connection, threading.Event]:
    conn = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn, threading.Event()


def test_a_locked_database_is_retried_a_bounded_number_of_times_then_spilled_and_replayed(tmp_path: Path) -> None:
    db_path = tmp_path / "prefixgate.db"
    dbmod.connect(db_path).close()
    locker, _ = _hold_write_lock(db_path)
    w = LedgerWriter(db_path, max_delay_s=0.01, retry=RetryPolicy(attempts=3, first_delay_s=0.01,
                                                                  busy_timeout_ms=100))
    for i in range(10):
        w.submit(_row(i))
    t0 = time.monotonic()
    w.flush(10.0)  # returns: the rows are kept in the quarantine file, the writer is not wedged
    assert time.monotonic() - t0 < 5.0
    s = w.stats()
    assert (s.committed, s.spilled, s.retries) == (0, 10, 3)
    spill = tmp_path / QUARANTINE_FILENAME
    assert spill.stat().st_mode & 0o777 == 0o600
    locker.execute("ROLLBACK")
    locker.close()
    w.submit(_row(10))  # the database works again: new rows commit, and the spilled ones come back
    w.close()
    assert {r["request_id"] for r in _rows(tmp_path)} == {f"r{i}" for i in range(11)}
    assert w.stats().replayed == 10 and not spill.exists()


def test_rows_a_previous_process_spilled_are_replayed_once_at_start(tmp_path: Path) -> None:
    db_path = tmp_path / "prefixgate.db"
    dbmod.connect(db_path).close()
    spill = tmp_path / QUARANTINE_FILENAME
    append_spill_file(spill, [_row(i) for i in range(5)], "database is locked")
    with spill.open("a") as f:
        f.write('{"reason": "cut by a crash", "row": {"request_id"')  # a torn last line is skipped
    w = LedgerWriter(db_path)
    w.submit(_row(2))  # already replayed or not: stored once
    w.close()
    assert sorted(r["request_id"] for r in _rows(tmp_path)) == [f"r{i}" for i in range(5)]
    assert not spill.exists() and w.stats().replayed == 5


def test_close_with_the_database_locked_is_prompt_and_loses_no_row(tmp_path: Path) -> None:
    home = tmp_path / "home"
    svc = TenancyService.open(home, ledger_max_delay_s=0.01)
    ctx = svc.authenticate(svc.create_tenant("a").api_key)
    svc.flush()
    locker, _ = _hold_write_lock(home / "prefixgate.db")
    for i in range(50):
        svc.record_usage(_rec(ctx, f"q{i}"))
    t0 = time.monotonic()
    svc.close()  # what SIGTERM runs in the gateway's shutdown
    assert time.monotonic() - t0 < 10.0
    locker.execute("ROLLBACK")
    locker.close()
    with TenancyService.open(home) as again:
        again.flush()
        assert again.report()["totals"]["requests"] == 50


def test_client_text_is_bounded_at_the_ledger_entry(svc: TenancyService) -> None:
    a = svc.authenticate(svc.create_tenant("a").api_key)
    huge = "m" * 3_000_000
    for i in range(20):  # the attack: 20 rejected requests with 3 MB model names
        svc.record_usage(_rec(a, f"big{i}", model=huge, miss_rule="PC003" + "x" * 1000, miss_detail=huge,
                              miss_family="user:" + huge))
    svc.flush()
    rows = _rows(svc)
    assert len(rows) == 20
    for r in rows:
        for column, limit in TEXT_LIMITS.items():
            assert r[column] is None or len(r[column]) <= limit, column
    if svc.database.kind == "sqlite":
        assert (svc.home / "prefixgate.db").stat().st_size < 2_000_000


def test_a_long_request_id_stays_unique_and_idempotent() -> None:
    head = "x" * 500
    one, two = storable_row({"request_id": head + "1"}), storable_row({"request_id": head + "2"})
    assert one["request_id"] != two["request_id"]
    assert len(one["request_id"]) <= TEXT_LIMITS["request_id"]
    assert storable_row({"request_id": head + "1"})["request_id"] == one["request_id"]
    assert storable_row({"request_id": "r-1"})["request_id"] == "r-1"


def test_numbers_sqlite_cannot_hold_are_made_storable(tmp_path: Path) -> None:
    db_path = tmp_path / "prefixgate.db"
    w = LedgerWriter(db_path)
    w.submit(_row(0, prompt_tokens=10**30, cost_usd=float("nan"), ttft_s=float("inf"), miss_position=-(10**40)))
    w.close()
    (r,) = _rows(tmp_path)
    assert r["prompt_tokens"] == 2**63 - 1 and r["cost_usd"] == 0 and r["ttft_s"] is None
    assert w.stats().quarantined == 0


def test_the_ledger_keeps_no_prompt_text_unless_the_tenant_chose_it(svc: TenancyService) -> None:
    a = svc.authenticate(svc.create_tenant("a").api_key)
    b = svc.authenticate(svc.create_tenant("b").api_key)
    miss = {"miss_rule": "PC003", "miss_tokens": 32, "miss_context": " Jane Roe, SSN 078-05-1120. req "}
    svc.record_usage(_rec(a, "a1", miss_family="user:jane@example.com", **miss))
    svc.record_usage(_rec(a, "a2", miss_family="user:jane@example.com", **miss))
    svc.record_usage(_rec(b, "b1", miss_family="user:jane@example.com", **miss))
    svc.record_usage(_rec(a, "a3", miss_family="prefix:gpt-4o-mini:0123456789abcdef", **miss))
    svc.update_tenant("b", store_miss_context=True)
    svc.record_usage(_rec(b, "b2", miss_family="prompt_cache_key:onboarding", **miss))
    svc.flush()
    rows = {r["request_id"]: r for r in _rows(svc)}
    for rid in ("a1", "a2", "a3", "b1"):
        assert rows[rid]["miss_context"] is None
        assert "jane" not in rows[rid]["miss_family"] and "0123456789abcdef" not in rows[rid]["miss_family"]
    assert rows["a1"]["miss_family"] == rows["a2"]["miss_family"]  # still groups a tenant's misses
    assert rows["a1"]["miss_family"].startswith("user:~")
    assert rows["a1"]["miss_family"] != rows["b1"]["miss_family"]  # equal families of two tenants do not link
    assert rows["a3"]["miss_family"].startswith("prefix:gpt-4o-mini:~")
    assert rows["b2"]["miss_context"] == miss["miss_context"] and rows["b2"]["miss_family"] == "prompt_cache_key:onboarding"
    # nothing of the prompt anywhere in the database file of the tenant that did not opt in
    if svc.database.kind == "sqlite":
        raw = (svc.home / "prefixgate.db").read_bytes() + (svc.home / "prefixgate.db-wal").read_bytes()
        assert raw.count(b"078-05-1120") <= 2  # only b's two clear rows (b1 was recorded before b opted in)
    stored = " ".join(str(v) for r in _rows(svc) for v in r.values())  # either store: what a query returns
    assert stored.count("078-05-1120") <= 2
    assert svc.get_tenant_by_name("b").store_miss_context and not svc.get_tenant_by_name("a").store_miss_context


def test_keyed_family_is_idempotent_and_keyed() -> None:
    k1, k2 = b"1" * 32, b"2" * 32
    f = keyed_family(k1, "t_a", "user:u-1")
    assert keyed_family(k1, "t_a", f) == f
    assert keyed_family(k2, "t_a", "user:u-1") != f


def test_store_miss_context_must_be_a_boolean(svc: TenancyService) -> None:
    from tenancy.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError):
        svc.create_tenant("a", store_miss_context="yes")


def test_cli_store_miss_context_flag_round_trips(home: Path) -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(repo), "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1",
           "PATH": "/usr/bin:/bin"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gateway.cli.main", *args, "--home", str(home)],
                              capture_output=True, text=True, env=env, cwd=repo, timeout=120)

    assert cli("tenant", "create", "acme", "--store-miss-context", "--json").returncode == 0
    shown = json.loads(cli("tenant", "show", "acme", "--json").stdout)
    assert shown["store_miss_context"] is True
    assert cli("tenant", "set", "acme", "--no-store-miss-context").returncode == 0
    assert json.loads(cli("tenant", "show", "acme", "--json").stdout)["store_miss_context"] is False


def test_limits_past_what_sqlite_stores_are_a_setting_error_not_a_crash(svc: TenancyService) -> None:
    from tenancy.errors import InvalidSettingError

    svc.create_tenant("a")
    with pytest.raises(InvalidSettingError, match="tpm"):
        svc.update_tenant("a", tpm=99999999999999999999999)
    svc.update_tenant("a", tpm=2**63 - 1)
    assert svc.get_tenant_by_name("a").quotas.tpm == 2**63 - 1


def test_a_lone_surrogate_end_user_gets_its_own_namespace(svc: TenancyService) -> None:
    ctx = svc.authenticate(svc.create_tenant("u", share_scope="user").api_key)
    spaces = {svc.scope_for(ctx, user=u).namespace for u in ("\ud800", "\udfff", "\ufffd", "a", None)}
    assert len(spaces) == 5


def test_reports_over_extreme_bounds_and_odd_stored_times_answer(svc: TenancyService) -> None:
    from datetime import datetime

    a = svc.authenticate(svc.create_tenant("a").api_key)
    svc.record_usage(_rec(a, "odd", created_at=1e300))
    svc.record_usage(_rec(a, "fine"))
    for since in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"):
        rep = svc.usage(a, datetime.fromisoformat(since))
        assert rep["since"] is not None
    assert svc.report()["totals"]["requests"] == 1  # "odd" lies in the future, past "until"


def test_client_text_cannot_drive_a_terminal_or_a_spreadsheet(svc: TenancyService) -> None:
    from tenancy.report import render_csv, render_table

    a = svc.authenticate(svc.create_tenant("a").api_key)
    svc.record_usage(_rec(a, "esc", model="m\x1b[2J\x9b31m\nTOTAL  999"))
    svc.record_usage(_rec(a, "formula", model="=HYPERLINK(\"http://x\")"))
    rep = svc.usage(a)
    table = render_table(rep)
    assert "\x1b" not in table and "\x9b" not in table and "\nTOTAL  999" not in table
    assert "'=HYPERLINK" in render_csv(rep)
    assert storable_row({"miss_context": "a\nb\tc"})["miss_context"] == "a\nb\tc"


def test_the_fast_path_of_storable_row_keeps_exactly_what_the_cleaners_keep() -> None:
    """``storable_row`` takes common values as they are (issue 17); every value, common or not,
    comes out as ``storable_text`` / ``storable_number`` make it."""
    class Text(str):
        pass

    limit = TEXT_LIMITS["model"]
    texts = ["m", "", "имя ✓", "a\x1fb", "a\x7fb", "a\x85b", "a\x9fb", "a\ud800b", "a\x00b", "a\tb", "a\nb",
             "x" * limit, "x" * (limit + 1), "\x85" * limit, Text("t\x1b"), None, 7]
    numbers = [0, 5, -5, 2**63 - 1, 2**63, -(2**63), True, 1.5, float("nan"), float("inf"), None, "3"]
    for text in texts:
        for column in ("model", "miss_context", "priced_as"):
            expected = storable_text(text, TEXT_LIMITS[column], multiline=column == "miss_context")
            if expected is None and column in REQUIRED_TEXT:
                expected = ""
            assert storable_row({column: text})[column] == expected, (column, text)
    for number in numbers:
        for column in (*REQUIRED_NUMBERS[:1], *OPTIONAL_NUMBERS[:1]):
            got = storable_row({column: number})[column]
            expected = storable_number(number, required=column in REQUIRED_NUMBERS)
            assert got == expected and type(got) is type(expected), (column, number)
