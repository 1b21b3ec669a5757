"""The embedded tenancy database (``tenancy.database.Database`` on SQLite): one SQLite file (WAL) opened through sqlite-utils, with numbered migrations.

Every process (gateway replicas, the CLI, the ledger writer thread) opens its own connection; WAL
lets readers run beside the single writer, and ``busy_timeout`` makes writers queue, not fail.

Migrations are numbered and append-only: ``MIGRATIONS[i]`` takes the schema from version ``i`` to
``i + 1``. Each runs in its own ``BEGIN IMMEDIATE`` transaction together with its row in
``schema_version``, so two processes opening a fresh database at once apply it exactly once, and a
crash mid-migration leaves the previous version intact.

Tables (v1)::

    tenants    id PK, name UNIQUE, settings (share scope, canon mode, ...), quota columns
    api_keys   key_id PK, tenant_id -> tenants ON DELETE CASCADE, key_hash (HMAC-SHA256), revoked_at
    data_keys  owner PK ("tenant:<id>" | "group:<name>"), data key wrapped by the KEK
    meta       key PK, value   (kek_fingerprint)
    usage      request_id PK, one row per request (the ledger); kept after its tenant is deleted

v3 adds ``usage_quarantine`` (rows the ledger writer could not store, with the reason and the row as
ASCII JSON) and the tenant setting ``store_miss_context``.

v4 adds ``responses`` (id PK, tenant_id -> tenants ON DELETE CASCADE, created_at, body: the stored
Responses-API response, JSON sealed with the tenant's data key) and the tenant setting
``cache_retention_s``.

v6 adds ``chat_completions`` (id PK, tenant_id -> tenants ON DELETE CASCADE, created_at, model,
head and messages: a stored chat completion and its input messages, each JSON sealed with the
tenant's data key).

``tenancy.pg_store`` keeps the same numbered migrations for PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import sqlite_utils

from tenancy.database import DB_FILENAME, DatabaseUnavailableError, ErrorKind

__all__ = ["DB_FILENAME", "MIGRATIONS", "SCHEMA_VERSION", "SqliteDatabase", "connect", "migrate"]

# Errors that may go away by themselves: another process holds the write lock, the disk is full.
_TRANSIENT_CODES = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_FULL,
                              sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN})


def _v1(db: sqlite_utils.Database) -> None:
    statements = [
        """CREATE TABLE tenants (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            is_admin INTEGER NOT NULL DEFAULT 0,
            share_scope TEXT NOT NULL DEFAULT 'tenant',
            canon_mode TEXT NOT NULL DEFAULT 'safe' CHECK (canon_mode IN ('off', 'safe', 'reorder')),
            per_user_vars TEXT NOT NULL DEFAULT '[]',
            priority INTEGER NOT NULL DEFAULT 0,
            ttft_target_s REAL,
            rpm INTEGER, tpm INTEGER,
            budget_usd REAL,
            budget_period TEXT NOT NULL DEFAULT 'month' CHECK (budget_period IN ('day', 'month')),
            kv_blocks_hbm INTEGER, kv_blocks_dram INTEGER, kv_blocks_nvme INTEGER,
            created_at REAL NOT NULL
        )""",
        """CREATE TABLE api_keys (
            key_id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
            key_hash BLOB NOT NULL,
            created_at REAL NOT NULL,
            revoked_at REAL
        )""",
        "CREATE INDEX api_keys_tenant ON api_keys(tenant_id)",
        """CREATE TABLE data_keys (
            owner TEXT PRIMARY KEY,
            wrapped BLOB NOT NULL,
            created_at REAL NOT NULL
        )""",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE usage (
            request_id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL,
            key_id TEXT NOT NULL,
            model TEXT NOT NULL,
            backend TEXT NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            ttft_s REAL,
            latency_s REAL,
            status TEXT NOT NULL CHECK (status IN ('ok', 'error', 'aborted')),
            created_at REAL NOT NULL,
            cost_usd REAL NOT NULL,
            saved_usd REAL NOT NULL,
            priced_as TEXT NOT NULL,
            miss_rule TEXT,
            miss_position INTEGER
        )""",
        "CREATE INDEX usage_tenant_time ON usage(tenant_id, created_at)",
        "CREATE INDEX usage_time ON usage(created_at)",
    ]
    for sql in statements:
        db.execute(sql)


def _v2(db: sqlite_utils.Database) -> None:
    """Cache-miss explanations: what broke the prefix, what it cost (added by the explain feature)."""
    for column, kind in (("miss_detail", "TEXT"), ("miss_tokens", "INTEGER"), ("miss_family", "TEXT"),
                         ("miss_context", "TEXT"), ("miss_usd", "REAL")):
        db.execute(f"ALTER TABLE usage ADD COLUMN {column} {kind}")
    db.execute("CREATE INDEX usage_miss_rule ON usage(miss_rule) WHERE miss_rule IS NOT NULL")


def _v3(db: sqlite_utils.Database) -> None:
    """Hardening (issue 16): rows the ledger refused are kept aside, and each tenant chooses whether
    cache-miss explanations keep prompt text (off by default)."""
    db.execute("""CREATE TABLE usage_quarantine (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        request_id TEXT,
        tenant_id TEXT,
        reason TEXT NOT NULL,
        row_json TEXT NOT NULL,
        created_at REAL NOT NULL
    )""")
    db.execute("ALTER TABLE tenants ADD COLUMN store_miss_context INTEGER NOT NULL DEFAULT 0")


def _v4(db: sqlite_utils.Database) -> None:
    """Stored Responses-API responses (``previous_response_id``): one tenant's, deleted with it; and
    the tenant setting ``cache_retention_s``."""
    db.execute("""CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        body BLOB NOT NULL
    )""")
    db.execute("CREATE INDEX responses_tenant ON responses(tenant_id)")
    # Explicit cache control as a tenant setting: every prompt's prefix is retained this many seconds.
    db.execute("ALTER TABLE tenants ADD COLUMN cache_retention_s REAL")


def _v5(db: sqlite_utils.Database) -> None:
    """Prompt tokens a request wrote to a prompt cache (Anthropic's ``cache_creation_input_tokens``,
    from a provider or the local engine), priced at the provider's cache-write rate. Rows written
    before it count 0."""
    db.execute("ALTER TABLE usage ADD COLUMN cache_creation_tokens INTEGER NOT NULL DEFAULT 0")


def _v6(db: sqlite_utils.Database) -> None:
    """Stored chat completions (``store: true`` on ``/v1/chat/completions``): one tenant's, deleted
    with it, the completion and its input messages sealed apart (``tenancy.chat_completions``). The
    index serves the list route's order (created_at, then id) within a tenant."""
    db.execute("""CREATE TABLE chat_completions (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        model TEXT NOT NULL,
        head BLOB NOT NULL,
        messages BLOB NOT NULL
    )""")
    db.execute("CREATE INDEX chat_completions_tenant ON chat_completions(tenant_id, created_at, id)")


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_v1, _v2, _v3, _v4, _v5, _v6]
SCHEMA_VERSION = len(MIGRATIONS)


def connect(path: Path, *, busy_timeout_s: float = 10.0) -> sqlite_utils.Database:
    """Open (creating if needed) the database at ``path`` with tenancy's pragmas, migrated to the latest schema.

    The connection may be used from several threads (``check_same_thread=False``); callers serialise
    access with their own lock. ``busy_timeout_s``: how long a statement waits for another
    connection's write lock before "database is locked".
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        # Key hashes and wrapped data keys live here: owner-only, like the KEK. SQLite gives the
        # -wal and -shm files the same mode as the database file.
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    conn = sqlite3.connect(str(path), timeout=busy_timeout_s, check_same_thread=False)
    db = sqlite_utils.Database(conn, execute_plugins=False)
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    deadline = time.monotonic() + busy_timeout_s
    delay = 0.01
    while True:
        try:
            _prepare(db)
            return db
        except sqlite3.OperationalError as exc:
            # Processes opening one fresh file together: switching it to WAL, or a schema read that
            # races a writer before WAL is in force, can fail with "database is locked" at once,
            # without waiting (SQLite's deadlock avoidance skips the busy handler). Every step of
            # _prepare is idempotent, so it is redone until the busy timeout has passed.
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.2)


def _prepare(db: sqlite_utils.Database) -> None:
    db.enable_wal()
    # FULL: a commit is on disk when it returns. The ledger batches commits, so the fsync is cheap.
    db.execute("PRAGMA synchronous = FULL")
    # Deleted rows (a shredded data key) are overwritten with zeros, not left in free pages.
    db.execute("PRAGMA secure_delete = ON")
    db.execute("PRAGMA foreign_keys = ON")
    migrate(db)


def current_version(db: sqlite_utils.Database) -> int:
    if not db["schema_version"].exists():
        return 0
    row = next(db.query("SELECT MAX(version) AS v FROM schema_version"))
    return int(row["v"] or 0)


def migrate(db: sqlite_utils.Database) -> int:
    """Apply every pending migration; return the resulting version. Safe against concurrent openers."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
    while True:
        db.conn.execute("BEGIN IMMEDIATE")  # take the write lock before reading the version
        try:
            version = current_version(db)
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"database schema v{version} is newer than this prefixgate (v{SCHEMA_VERSION}); upgrade it"
                )
            if version == SCHEMA_VERSION:
                db.conn.execute("COMMIT")
                return version
            MIGRATIONS[version](db)
            db.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", [version + 1, time.time()])
            db.conn.execute("COMMIT")
        except BaseException:
            db.rollback()
            raise


@contextlib.contextmanager
def write_transaction(db: sqlite_utils.Database) -> Iterator[sqlite_utils.Database]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (rollback on error).

    Read-then-write transactions must take the write lock up front: a deferred transaction that
    read a snapshot and then tries to write while another connection wrote gets SQLITE_BUSY at once
    (busy_timeout cannot help, its snapshot is stale). IMMEDIATE waits for the lock instead.
    """
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.rollback()
        raise
    db.conn.execute("COMMIT")


def checkpoint_truncate(db: sqlite_utils.Database) -> None:
    """Copy the WAL into the main file and truncate it, so no old page version (a shredded key) lingers there."""
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


def is_transient(exc: BaseException) -> bool:
    """True for an SQLite error worth retrying later (the row is fine, the database is not ready)."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _TRANSIENT_CODES  # extended codes carry the primary code in the low byte
    text = str(exc).lower()
    return "locked" in text or "busy" in text or "disk is full" in text


class SqliteDatabase:
    """``tenancy.database.Database`` on one SQLite file (WAL): the embedded default."""

    def __init__(self, db: sqlite_utils.Database) -> None:
        self.raw = db

    @classmethod
    def open(cls, path: Path, *, busy_timeout_s: float = 10.0) -> SqliteDatabase:
        try:
            return cls(connect(path, busy_timeout_s=busy_timeout_s))
        except sqlite3.OperationalError as exc:
            if is_transient(exc):
                raise  # locked by a migrating neighbour: the caller's retry policy decides
            raise DatabaseUnavailableError(f"cannot open the SQLite database {path}: {exc}") from None
        except OSError as exc:
            raise DatabaseUnavailableError(f"cannot open the SQLite database {path}: {exc.strerror}") from None

    @property
    def broken(self) -> bool:
        return False  # a file does not go away between statements; errors are per statement

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return list(self.raw.query(sql, list(params)))

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.raw.execute(sql, list(params)).rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.raw.conn.executemany(sql, rows)

    def transaction(self, *, exclusive: bool = True) -> contextlib.AbstractContextManager[None]:
        # SQLite has one writer anyway: IMMEDIATE takes its lock up front (see write_transaction).
        return _as_none(write_transaction(self.raw))

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        self.raw.conn.execute("SAVEPOINT tenancy_sp")
        try:
            yield
        except BaseException:
            self.raw.conn.execute("ROLLBACK TO tenancy_sp")
            self.raw.conn.execute("RELEASE tenancy_sp")
            raise
        self.raw.conn.execute("RELEASE tenancy_sp")

    def classify(self, exc: BaseException) -> ErrorKind:
        if is_transient(exc):
            return ErrorKind.TRANSIENT
        if isinstance(exc, sqlite3.Error | ValueError | TypeError | OverflowError | UnicodeError):
            return ErrorKind.REFUSED
        return ErrorKind.FATAL

    def is_conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.IntegrityError)

    def shred_freed_pages(self) -> None:
        checkpoint_truncate(self.raw)

    def close(self) -> None:
        self.raw.close()


@contextlib.contextmanager
def _as_none(cm: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    with cm:
        yield
