"""Stored Responses-API responses: the SQL behind ``previous_response_id``, GET and DELETE.

Every read and delete is keyed on (response id, tenant id) together, so a tenant that learns
another's response id still finds nothing. Rows cascade with their tenant (``ON DELETE CASCADE``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import sqlite_utils


def save(db: sqlite_utils.Database, tenant_id: str, response_id: str, body: dict[str, Any]) -> None:
    db.execute("INSERT OR REPLACE INTO responses (id, tenant_id, created_at, body) VALUES (?, ?, ?, ?)",
               [response_id, tenant_id, time.time(), json.dumps(body, separators=(",", ":"))])


def load(db: sqlite_utils.Database, tenant_id: str, response_id: str) -> dict[str, Any] | None:
    rows = list(db.query("SELECT body FROM responses WHERE id = ? AND tenant_id = ?", [response_id, tenant_id]))
    return json.loads(rows[0]["body"]) if rows else None


def delete(db: sqlite_utils.Database, tenant_id: str, response_id: str) -> bool:
    cur = db.execute("DELETE FROM responses WHERE id = ? AND tenant_id = ?", [response_id, tenant_id])
    return cur.rowcount > 0
