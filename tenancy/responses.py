"""Stored Responses-API responses: the SQL behind ``previous_response_id``, GET and DELETE.

Every read and delete is keyed on (response id, tenant id) together, so a tenant that learns
another's response id still finds nothing. Rows cascade with their tenant (``ON DELETE CASCADE``).
The body (prompts and answers) is sealed with the tenant's data key, bound to (tenant, id): the
database file alone does not reveal it, and shredding the tenant's key makes any copy unreadable.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

import sqlite_utils


class Sealer(Protocol):
    """The tenant's AEAD (``tenancy.crypto.TenantCipher``): decrypt returns None on a bad tag."""

    def encrypt(self, plaintext: bytes, aad: bytes) -> bytes: ...

    def decrypt(self, blob: bytes, aad: bytes) -> bytes | None: ...


def _aad(tenant_id: str, response_id: str) -> bytes:
    return b"prefixgate.response.v1\0" + tenant_id.encode() + b"\0" + response_id.encode()


def save(db: sqlite_utils.Database, cipher: Sealer, tenant_id: str, response_id: str, body: dict[str, Any]) -> None:
    sealed = cipher.encrypt(json.dumps(body, separators=(",", ":")).encode(), _aad(tenant_id, response_id))
    db.execute("INSERT OR REPLACE INTO responses (id, tenant_id, created_at, body) VALUES (?, ?, ?, ?)",
               [response_id, tenant_id, time.time(), sealed])


def load(db: sqlite_utils.Database, cipher: Sealer, tenant_id: str, response_id: str) -> dict[str, Any] | None:
    rows = list(db.query("SELECT body FROM responses WHERE id = ? AND tenant_id = ?", [response_id, tenant_id]))
    if not rows:
        return None
    plain = cipher.decrypt(bytes(rows[0]["body"]), _aad(tenant_id, response_id))
    return json.loads(plain) if plain is not None else None  # a failed tag is "not found", never served


def delete(db: sqlite_utils.Database, tenant_id: str, response_id: str) -> bool:
    cur = db.execute("DELETE FROM responses WHERE id = ? AND tenant_id = ?", [response_id, tenant_id])
    return cur.rowcount > 0
