"""What ``tenant delete`` leaves: the usage rows (billing history) without the client data a tenant
with ``store_miss_context`` kept in clear (prompt text before a cache break, clear family), on both
stores; and a home whose KEK is bad fails before it writes a fresh server secret."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tenancy.errors import TenancyError
from tenancy.service import TenancyService
from tenancy.types import UsageRecord
from tests.fleetutil import read_rows


def _miss_row(request_id: str, tenant_id: str, key_id: str) -> UsageRecord:
    return UsageRecord(request_id, tenant_id, key_id, "gpt-4o", "openai", 100, 0, 5, None, None, "ok", time.time(),
                       miss_rule="timestamp", miss_family="user:alice@example.com",
                       miss_context="<system>\nToday is 2026-01-0")


def test_delete_scrubs_the_miss_text_a_tenant_kept_in_clear(svc: TenancyService) -> None:
    kept = svc.authenticate(svc.create_tenant("kept", store_miss_context=True).api_key)
    other = svc.authenticate(svc.create_tenant("other", store_miss_context=True).api_key)
    svc.record_usage(_miss_row("r1", kept.tenant_id, kept.key_id))
    svc.record_usage(_miss_row("r2", other.tenant_id, other.key_id))
    svc.flush()
    db = svc.database.connect()
    try:  # a row the ledger had set aside, holding the same text
        db.execute("INSERT INTO usage_quarantine (request_id, tenant_id, reason, row_json, created_at) "
                   "VALUES (?, ?, ?, ?, ?)", ["r3", kept.tenant_id, "test", json.dumps(
                       {"request_id": "r3", "miss_context": "secret prompt", "miss_family": "user:bob"}), time.time()])
    finally:
        db.close()
    svc.record_usage(_miss_row("r4", kept.tenant_id, kept.key_id))  # still queued when the delete comes
    svc.delete_tenant("kept")
    rows = {r["request_id"]: r for r in read_rows(svc, "SELECT request_id, miss_rule, miss_family, miss_context, "
                                                       "prompt_tokens FROM usage")}
    for rid in ("r1", "r4"):  # the billing history stays, the client's text does not
        assert rows[rid]["prompt_tokens"] == 100 and rows[rid]["miss_rule"] == "timestamp"
        assert rows[rid]["miss_context"] is None and "alice" not in rows[rid]["miss_family"]
        assert rows[rid]["miss_family"].startswith("user:~")  # keyed: still groups the tenant's misses
    assert rows["r1"]["miss_family"] == rows["r4"]["miss_family"]
    assert rows["r2"]["miss_context"] == "<system>\nToday is 2026-01-0"  # another tenant's choice stands
    (quarantined,) = read_rows(svc, "SELECT row_json FROM usage_quarantine")
    assert "secret prompt" not in quarantined["row_json"] and "bob" not in quarantined["row_json"]


def test_a_bad_kek_fails_before_a_server_secret_is_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "kek.key").write_bytes(b"not a key")
    (home / "kek.key").chmod(0o600)
    with pytest.raises(TenancyError):
        TenancyService.open(home)
    assert not (home / "server.secret").exists()
