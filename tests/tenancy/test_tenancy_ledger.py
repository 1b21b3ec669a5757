"""The usage ledger: idempotent on request_id, batched off the request path, crash-safe."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from ledger_writer_proc import expected_row

from tenancy import db as dbmod
from tenancy.database import resolve_database
from tenancy.ledger import LedgerWriter
from tenancy.service import TenancyService
from tenancy.types import UsageRecord

HERE = Path(__file__).resolve().parent


def _rows(home: Path) -> list[dict]:
    conn = sqlite3.connect(home / "prefixgate.db")
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("SELECT * FROM usage ORDER BY created_at")]
    conn.close()
    return rows


def _rec(ctx, rid: str, prompt: int, cached: int = 0) -> UsageRecord:
    return UsageRecord(rid, ctx.tenant_id, ctx.key_id, "gpt-4o-mini", "local", prompt, cached, 1, 0.05, 0.1,
                       "ok", time.time())


def test_record_usage_is_idempotent_on_request_id_first_write_wins(home: Path) -> None:
    svc = TenancyService.open(home)
    ctx = svc.authenticate(svc.create_tenant("a").api_key)
    svc.record_usage(_rec(ctx, "req-1", 100))
    svc.record_usage(_rec(ctx, "req-1", 999))  # same process, before the flush
    svc.flush()
    svc.record_usage(_rec(ctx, "req-1", 555))  # same process, after the flush
    svc.close()
    other = TenancyService.open(home)  # another process / a restart
    other.record_usage(_rec(ctx, "req-1", 777))
    other.record_usage(_rec(ctx, "req-2", 5))
    other.close()
    rows = _rows(home)
    assert [(r["request_id"], r["prompt_tokens"]) for r in rows] == [("req-1", 100), ("req-2", 5)]


def test_duplicates_inside_one_batch_are_stored_once(home: Path) -> None:
    dbmod.connect(home / "prefixgate.db").close()
    w = LedgerWriter(home / "prefixgate.db", batch_max=1000, max_delay_s=0.5)
    base = expected_row(1, "t", "k") | {"cost_usd": 0.1, "saved_usd": 0.0, "priced_as": "x"}
    for n in (1, 2, 3):
        w.submit(base | {"prompt_tokens": n})
    w.flush()
    w.close()
    rows = _rows(home)
    assert len(rows) == 1 and rows[0]["prompt_tokens"] == 1


def test_record_usage_returns_before_the_row_is_written(home: Path) -> None:
    svc = TenancyService.open(home, ledger_max_delay_s=0.3)
    try:
        ctx = svc.authenticate(svc.create_tenant("a").api_key)
        svc.record_usage(_rec(ctx, "slow", 10))
        assert _rows(home) == []  # still queued: the request path did not wait for SQLite
        svc.flush()
        assert [r["request_id"] for r in _rows(home)] == ["slow"]
    finally:
        svc.close()


def test_rows_carry_price_and_all_fields(home: Path) -> None:
    svc = TenancyService.open(home)
    # store_miss_context: this tenant chose to keep miss text in clear (the default keeps none,
    # tests/tenancy/test_tenancy_ledger_hardening.py)
    ctx = svc.authenticate(svc.create_tenant("a", store_miss_context=True).api_key)
    rec = UsageRecord("r", ctx.tenant_id, ctx.key_id, "local-tiny", "local", 1000, 600, 50, 0.25, 1.5, "aborted",
                      1_750_000_000.0, miss_rule="PC003", miss_position=17, miss_detail="user_name",
                      miss_tokens=400, miss_family="user:u-1", miss_context="user_name: ")
    svc.record_usage(rec)
    svc.close()
    (row,) = _rows(home)
    price = TenancyService.open(home).price("local-tiny", 1000, 600, 50)
    assert row == {
        "request_id": "r", "tenant_id": ctx.tenant_id, "key_id": ctx.key_id, "model": "local-tiny",
        "backend": "local", "prompt_tokens": 1000, "cached_tokens": 600, "completion_tokens": 50, "ttft_s": 0.25,
        "latency_s": 1.5, "status": "aborted", "created_at": 1_750_000_000.0, "cost_usd": price.cost_usd,
        "saved_usd": price.saved_usd, "priced_as": "gpt-4o-mini", "miss_rule": "PC003", "miss_position": 17,
        "miss_detail": "user_name", "miss_tokens": 400, "miss_family": "user:u-1", "miss_context": "user_name: ",
        # the 400 re-prefilled tokens priced as if they had been cache reads
        "miss_usd": TenancyService.open(home).price("local-tiny", 400, 400, 0).saved_usd,
        "cache_creation_tokens": 0,
    }


def test_a_killed_writer_leaves_committed_rows_whole_and_no_partial_row(tmp_path: Path,
                                                                        database_url: str | None) -> None:
    """On either store: one transaction per batch, so a kill -9 keeps whole batches and nothing else."""
    home = tmp_path / "home"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "ledger_writer_proc.py"), str(home), *([database_url] if database_url else [])],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=HERE.parents[1],
    )
    try:
        tenant_id, key_id = proc.stdout.readline().split()[1:]
        committed = 0
        deadline = time.monotonic() + 60
        target = 1200
        while committed < target and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "writer process died early"
            committed = int(line.split()[1])
        time.sleep(random.uniform(0.0, 0.02))  # land somewhere inside a later batch
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert committed >= target
    if database_url is None:
        conn = sqlite3.connect(home / "prefixgate.db")
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()
    db = resolve_database(home, database_url).connect()
    rows = db.query("SELECT * FROM usage ORDER BY created_at")
    db.close()
    by_id = {r["request_id"]: r for r in rows}
    assert len(by_id) == len(rows)
    for i in range(committed):  # everything reported committed survived
        assert f"r{i}" in by_id, f"committed row r{i} lost"
    for r in rows:  # every surviving row is exactly what was written, nothing half-written
        i = int(r["request_id"][1:])
        want = expected_row(i, tenant_id, key_id)
        assert {k: r[k] for k in want} == want
        assert r["cost_usd"] > 0 and r["priced_as"] == "gpt-4o-mini"
    ids = sorted(int(k[1:]) for k in by_id)
    assert ids == list(range(len(ids)))  # batches commit in order: no holes
    # the database is usable afterwards
    svc = TenancyService.open(home, database_url=database_url)
    try:
        assert svc.report()["totals"]["requests"] == len(rows)
    finally:
        svc.close()
