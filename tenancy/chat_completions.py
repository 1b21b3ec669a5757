"""Stored chat completions (``store: true`` on ``/v1/chat/completions``): the SQL and the sealing.

The same store as the stored Responses (``tenancy.responses``): one table in the tenancy database
(migration v6 of SQLite and PostgreSQL alike), every read, update and delete keyed on (id, tenant)
together, rows cascading with their tenant, and the client's data sealed with the tenant's own data
key. A row keeps two sealed parts::

    chat_completions: id | tenant_id | created_at | model | head              | messages
                                                     clear   sealed:           sealed:
                                                             chat.completion   input messages
                                                             (with metadata)   (stored shape)

The parts are apart because the list route opens every candidate's head to test its metadata
filter, and a conversation can be megabytes that a list never needs; each part's AAD names it, so
one cannot be served as the other. ``model`` is in clear (the list filters on it in SQL): the usage
ledger keeps each request's model in clear already, so it tells the database file nothing new.
Metadata stays sealed: it is the client's own text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from tenancy.database import Database
from tenancy.responses import Sealer, open_json, seal_json
from tenancy.types import ListOrder

Part = Literal["head", "messages"]


def _aad(part: Part, tenant_id: str, completion_id: str) -> bytes:
    return b"\0".join((b"prefixgate.chat_completion.v1", part.encode(), tenant_id.encode(), completion_id.encode()))


def seal(cipher: Sealer, part: Part, tenant_id: str, completion_id: str, value: object) -> bytes:
    """``value`` (a part) as JSON, sealed for (part, tenant, id). No database: run outside its lock."""
    return seal_json(cipher, value, _aad(part, tenant_id, completion_id))


def open_part(cipher: Sealer, part: Part, tenant_id: str, completion_id: str, sealed: bytes) -> Any:
    """The value ``seal`` sealed; None when its tag fails (never served)."""
    return open_json(cipher, sealed, _aad(part, tenant_id, completion_id))


def insert(db: Database, tenant_id: str, completion_id: str, model: str, head: bytes, messages: bytes) -> None:
    # Ids are random; the WHERE still keeps a colliding id from ever overwriting another tenant's row.
    db.execute("INSERT INTO chat_completions (id, tenant_id, created_at, model, head, messages) "
               "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET created_at = excluded.created_at, "
               "model = excluded.model, head = excluded.head, messages = excluded.messages "
               "WHERE chat_completions.tenant_id = excluded.tenant_id",
               [completion_id, tenant_id, time.time(), model, head, messages])


def sealed_part(db: Database, part: Part, tenant_id: str, completion_id: str, since: float = 0.0) -> bytes | None:
    """The sealed ``part`` of this tenant's completion ``completion_id`` stored at ``since`` (epoch s)
    or later, or None."""
    column = {"head": "head", "messages": "messages"}[part]  # a column name, never the caller's text
    rows = db.query(f"SELECT {column} AS v FROM chat_completions WHERE id = ? AND tenant_id = ? AND created_at >= ?",
                    [completion_id, tenant_id, since])
    return bytes(rows[0]["v"]) if rows else None


def replace_head(db: Database, tenant_id: str, completion_id: str, head: bytes) -> bool:
    """Store a new sealed head (new metadata); False when this tenant has no such completion."""
    return db.execute("UPDATE chat_completions SET head = ? WHERE id = ? AND tenant_id = ?",
                      [head, completion_id, tenant_id]) > 0


def purge(db: Database, tenant_id: str | None, before: float) -> int:
    """Delete the tenant's (every tenant's, for None) completions stored before ``before`` (epoch s)."""
    if tenant_id is None:
        return db.execute("DELETE FROM chat_completions WHERE created_at < ?", [before])
    return db.execute("DELETE FROM chat_completions WHERE tenant_id = ? AND created_at < ?", [tenant_id, before])


def delete(db: Database, tenant_id: str, completion_id: str) -> bool:
    return db.execute("DELETE FROM chat_completions WHERE id = ? AND tenant_id = ?", [completion_id, tenant_id]) > 0


@dataclass(frozen=True)
class Cursor:
    """Where a page starts: the (created_at, id) of the completion before it. Ties of created_at
    are ordered by id, so the order is total and a page never repeats or skips a row."""

    created_at: float
    completion_id: str


@dataclass(frozen=True)
class SealedHead:
    completion_id: str
    cursor: Cursor
    head: bytes


def cursor_of(db: Database, tenant_id: str, completion_id: str, since: float = 0.0) -> Cursor | None:
    """The cursor after this tenant's completion ``completion_id`` (stored at ``since`` or later);
    None when it has none such."""
    rows = db.query("SELECT created_at FROM chat_completions WHERE id = ? AND tenant_id = ? AND created_at >= ?",
                    [completion_id, tenant_id, since])
    return Cursor(rows[0]["created_at"], completion_id) if rows else None


def heads_after(db: Database, tenant_id: str, *, after: Cursor | None, order: ListOrder, model: str | None,
                limit: int, since: float = 0.0) -> list[SealedHead]:
    """Up to ``limit`` sealed heads of the tenant's completions stored at ``since`` or later, past
    ``after`` in ``order``, of ``model`` only when one is given."""
    direction, past = ("ASC", ">") if order == "asc" else ("DESC", "<")
    sql = "SELECT id, created_at, head FROM chat_completions WHERE tenant_id = ? AND created_at >= ?"
    params: list[object] = [tenant_id, since]
    if after is not None:
        sql += f" AND (created_at {past} ? OR (created_at = ? AND id {past} ?))"
        params += [after.created_at, after.created_at, after.completion_id]
    if model is not None:
        sql += " AND model = ?"
        params.append(model)
    sql += f" ORDER BY created_at {direction}, id {direction} LIMIT ?"
    params.append(limit)
    return [SealedHead(r["id"], Cursor(r["created_at"], r["id"]), bytes(r["head"])) for r in db.query(sql, params)]
