"""Stored Responses-API responses: the SQL behind ``previous_response_id``, GET and DELETE.

Every read and delete is keyed on (response id, tenant id) together, so a tenant that learns
another's response id still finds nothing. Rows cascade with their tenant (``ON DELETE CASCADE``).
The body (prompts and answers) is sealed with the tenant's data key, bound to (tenant, id): the
database file alone does not reveal it, and shredding the tenant's key makes any copy unreadable.

The SQL is what SQLite and PostgreSQL both accept (``tenancy.database.Database``), so the store
works on either; the table is migration v4 of both.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from tenancy.database import Database


class Sealer(Protocol):
    """The tenant's AEAD (``tenancy.crypto.TenantCipher``): decrypt returns None on a bad tag."""

    def encrypt(self, plaintext: bytes, aad: bytes) -> bytes: ...

    def decrypt(self, blob: bytes, aad: bytes) -> bytes | None: ...


def _aad(tenant_id: str, response_id: str) -> bytes:
    return b"prefixgate.response.v1\0" + tenant_id.encode() + b"\0" + response_id.encode()


def seal_json(cipher: Sealer, body: object, aad: bytes) -> bytes:
    """``body`` as compact JSON, sealed under ``aad`` (what the stored chat completions seal with too)."""
    return cipher.encrypt(json.dumps(body, separators=(",", ":")).encode(), aad)


def open_json(cipher: Sealer, sealed: bytes, aad: bytes) -> Any:
    """The JSON value ``seal_json`` sealed under ``aad``; None when its tag fails (never served)."""
    plain = cipher.decrypt(sealed, aad)
    return json.loads(plain) if plain is not None else None


def seal(cipher: Sealer, tenant_id: str, response_id: str, body: dict[str, Any]) -> bytes:
    """``body`` as JSON, sealed for (tenant, id). No database: the caller runs this outside any lock
    the database needs (a stored conversation can be megabytes: tens of milliseconds of work)."""
    return seal_json(cipher, body, _aad(tenant_id, response_id))


def insert(db: Database, tenant_id: str, response_id: str, sealed: bytes) -> None:
    # Ids are random; the WHERE still keeps a colliding id from ever overwriting another tenant's row.
    db.execute("INSERT INTO responses (id, tenant_id, created_at, body) VALUES (?, ?, ?, ?) "
               "ON CONFLICT (id) DO UPDATE SET created_at = excluded.created_at, body = excluded.body "
               "WHERE responses.tenant_id = excluded.tenant_id",
               [response_id, tenant_id, time.time(), sealed])


def sealed_body(db: Database, tenant_id: str, response_id: str, since: float = 0.0) -> bytes | None:
    """The sealed body of this tenant's response ``response_id`` stored at ``since`` (epoch s) or
    later, or None."""
    rows = db.query("SELECT body FROM responses WHERE id = ? AND tenant_id = ? AND created_at >= ?",
                    [response_id, tenant_id, since])
    return bytes(rows[0]["body"]) if rows else None


def open_body(cipher: Sealer, tenant_id: str, response_id: str, sealed: bytes) -> dict[str, Any] | None:
    """The body ``seal`` sealed; None when its tag fails (never served). No database, as ``seal``."""
    body: dict[str, Any] | None = open_json(cipher, sealed, _aad(tenant_id, response_id))
    return body


def purge(db: Database, tenant_id: str | None, before: float) -> int:
    """Delete the tenant's (every tenant's, for None) responses stored before ``before`` (epoch s)."""
    if tenant_id is None:
        return db.execute("DELETE FROM responses WHERE created_at < ?", [before])
    return db.execute("DELETE FROM responses WHERE tenant_id = ? AND created_at < ?", [tenant_id, before])


def delete(db: Database, tenant_id: str, response_id: str) -> bool:
    return db.execute("DELETE FROM responses WHERE id = ? AND tenant_id = ?", [response_id, tenant_id]) > 0
