"""Database plumbing: WAL, numbered migrations recorded in schema_version, concurrent first opens."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from tenancy import db as dbmod


def test_fresh_database_is_migrated_and_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    db = dbmod.connect(path)
    assert dbmod.current_version(db) == dbmod.SCHEMA_VERSION == len(dbmod.MIGRATIONS)
    assert next(db.query("PRAGMA journal_mode"))["journal_mode"] == "wal"
    assert {"tenants", "api_keys", "data_keys", "meta", "usage", "schema_version"} <= set(db.table_names())
    db.close()
    again = dbmod.connect(path)  # reopening applies nothing twice
    versions = [r["version"] for r in again.query("SELECT version FROM schema_version")]
    assert versions == list(range(1, dbmod.SCHEMA_VERSION + 1))
    again.close()


def test_concurrent_first_opens_migrate_once(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            dbmod.connect(path).close()
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == dbmod.SCHEMA_VERSION
    conn.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    dbmod.connect(path).close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO schema_version VALUES (99, 0)")
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="newer"):
        dbmod.connect(path)


def test_ledger_rows_reject_partial_or_invalid_values(tmp_path: Path) -> None:
    db = dbmod.connect(tmp_path / "p.db")
    with pytest.raises(sqlite3.IntegrityError):
        db.execute("INSERT INTO usage (request_id, tenant_id) VALUES ('r', 't')")
    with pytest.raises(sqlite3.IntegrityError):
        db.execute(
            "INSERT INTO usage VALUES ('r','t','k','m','b',1,0,1,NULL,NULL,'weird',0,0,0,'m',NULL,NULL,NULL,NULL,NULL,NULL,NULL,0)"  # + v2's five miss columns, v5's writes
        )
    db.close()
