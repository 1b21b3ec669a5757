"""The store interface: one ``Database`` Protocol, two implementations, chosen by a database URL.

::

    --database-url (or database_url in the config file)
        unset / sqlite:///PATH ─► tenancy.db.SqliteDatabase       (embedded default: <home>/prefixgate.db)
        postgresql://...      ─► tenancy.pg_store.PostgresDatabase (shared by a fleet of gateways)

``store``, ``ledger`` and ``report`` write their SQL once, with ``?`` placeholders and the SQL both
engines accept (``ON CONFLICT ... DO NOTHING``, ``COALESCE``, ``||``); the implementations own what
differs: placeholders, transactions and locks, numbered migrations, and which errors are worth a retry.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from tenancy.errors import TenancyError

DB_FILENAME = "prefixgate.db"


class ErrorKind(enum.Enum):
    """What a failed statement means for the row that was being written."""

    TRANSIENT = "transient"  # the database is not ready (locked, restarting, disk full): retry later
    REFUSED = "refused"  # this row is wrong for the schema (constraint, bad value): keep it aside
    FATAL = "fatal"  # neither: not the row's fault and not going away by itself


class DatabaseUnavailableError(TenancyError):
    """The configured database cannot be reached or opened (start-up fails with this one line)."""


class Database(Protocol):
    """One connection to the tenancy database. Not thread-safe: callers hold their own lock.

    Contract:
        - ``execute``/``executemany``/``query`` outside ``transaction()`` autocommit each statement.
        - ``transaction()`` is a write transaction: everything inside commits together or not at all.
          With ``exclusive=True`` (the default) it holds the database's one writer lock from the
          first statement, so a read-then-write inside it (KEK check, migration) sees no other
          writer; ledger batches pass ``exclusive=False`` and rely on ``ON CONFLICT DO NOTHING``.
        - ``savepoint()`` inside a transaction: an exception raised in it rolls back only its
          statements and propagates.
        - ``classify(exc)`` says whether an exception from this database is transient, a refused
          row, or fatal. After a transient error the connection may be ``broken``; the owner then
          closes it and connects again.
    """

    @property
    def broken(self) -> bool: ...

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]: ...

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; returns the number of rows it changed."""
        ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...

    def transaction(self, *, exclusive: bool = True) -> contextlib.AbstractContextManager[None]: ...

    def savepoint(self) -> contextlib.AbstractContextManager[None]: ...

    def classify(self, exc: BaseException) -> ErrorKind: ...

    def is_conflict(self, exc: BaseException) -> bool:
        """True for a unique-key violation (a tenant name taken)."""
        ...

    def shred_freed_pages(self) -> None:
        """Make deleted rows (a shredded data key) unrecoverable from the database's files, where it can."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DatabaseTarget:
    """Where the tenancy database is: an SQLite file or a PostgreSQL URL. ``connect`` opens it migrated."""

    sqlite_path: Path | None = None
    postgres_url: str | None = None

    def __post_init__(self) -> None:
        assert (self.sqlite_path is None) != (self.postgres_url is None), "exactly one of sqlite_path, postgres_url"

    @property
    def kind(self) -> str:
        return "sqlite" if self.sqlite_path is not None else "postgresql"

    def describe(self) -> str:
        """For logs and /health: the file, or the URL without its password."""
        if self.sqlite_path is not None:
            return str(self.sqlite_path)
        return redact_url(self.postgres_url or "")

    def connect(self, *, busy_timeout_s: float = 10.0) -> Database:
        """Open a connection migrated to the latest schema. Raises DatabaseUnavailableError."""
        if self.sqlite_path is not None:
            from tenancy.db import SqliteDatabase

            return SqliteDatabase.open(self.sqlite_path, busy_timeout_s=busy_timeout_s)
        from tenancy.pg_store import PostgresDatabase

        assert self.postgres_url is not None
        return PostgresDatabase.open(self.postgres_url, lock_timeout_s=busy_timeout_s)


def resolve_database(home: Path, url: str | None) -> DatabaseTarget:
    """The target for ``--database-url`` (None: the SQLite file under ``home``). Raises ValueError."""
    if url is None or url == "":
        return DatabaseTarget(sqlite_path=Path(home) / DB_FILENAME)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("postgresql", "postgres"):
        return DatabaseTarget(postgres_url=url)
    if scheme == "sqlite":
        path = url[len("sqlite:///"):] if url.lower().startswith("sqlite:///") else ""
        if not path:
            raise ValueError(f"--database-url {url!r}: an SQLite URL looks like sqlite:///ABSOLUTE/PATH.db")
        return DatabaseTarget(sqlite_path=Path("/" + path.lstrip("/")))
    raise ValueError(f"--database-url {redact_url(url)!r}: use postgresql://USER@HOST:PORT/DB or "
                     "sqlite:///PATH (unset: the SQLite file under --home)")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()

