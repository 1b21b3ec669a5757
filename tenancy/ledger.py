"""The usage ledger writer: one row per request, written off the request path.

::

    request threads ──submit(row)──► storable_row ──► queue ──► writer thread ──► BEGIN; INSERT x N; COMMIT
                      (bounded, valid UTF-8,            (own connection, batches of <= batch_max rows
                       finite numbers)                   or whatever arrived within max_delay_s)
                                                              │ a row the database refuses
                                                              ├──────────────► usage_quarantine table (counted)
                                                              │ the database unreachable after bounded retries
                                                              └──────────────► ledger-quarantine.jsonl (replayed at start)

Guarantees:
    - Idempotent: ``request_id`` is the primary key and rows go in with ``ON CONFLICT DO NOTHING``, so a
      retried record (the gateway may record twice after a reconnect) is stored once, first wins.
    - Crash-safe: a batch is one transaction (SQLite in WAL mode with ``synchronous=FULL``, or
      PostgreSQL, where batches of several gateways commit side by side without a lock); a process
      killed at any instant leaves every committed batch whole and no part of an uncommitted one.
      Rows still in the queue at a kill are lost (at most ``max_delay_s`` worth); ``flush`` waits
      until everything submitted before it is committed.
    - One bad row never blocks the rows behind it: a batch the database refuses is written again row
      by row (one savepoint each), and a row refused on its own goes to ``usage_quarantine`` with the
      reason, while every other row of the batch commits.
    - Only transient errors (database locked or busy, disk full, I/O error) are retried, a bounded
      number of times; rows that still cannot be written go to the quarantine file next to the
      database (0600, JSON lines), which the next writer on that database replays. ``close`` stops
      retrying at once and spills what is left, so shutdown is prompt and loses no row.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenancy.database import Database, DatabaseTarget, DatabaseUnavailableError, ErrorKind
from tenancy.db import is_transient  # noqa: F401 - re-exported (the SQLite classification)
from tenancy.storable import storable_row, storable_text

log = logging.getLogger("tenancy.ledger")

USAGE_COLUMNS: tuple[str, ...] = (
    "request_id", "tenant_id", "key_id", "model", "backend", "prompt_tokens", "cached_tokens",
    "completion_tokens", "ttft_s", "latency_s", "status", "created_at", "cost_usd", "saved_usd",
    "priced_as", "miss_rule", "miss_position", "miss_detail", "miss_tokens", "miss_family", "miss_context",
    "miss_usd", "cache_creation_tokens",
)
QUARANTINE_FILENAME = "ledger-quarantine.jsonl"

# Not INSERT OR IGNORE: that also skips, silently, a row failing a CHECK or NOT NULL constraint. Only
# a second row for a request id is ignored; every other refusal is seen and the row quarantined.
_INSERT = (f"INSERT INTO usage ({', '.join(USAGE_COLUMNS)}) "
           f"VALUES ({', '.join('?' for _ in USAGE_COLUMNS)}) ON CONFLICT(request_id) DO NOTHING")
_STOP = object()


@dataclass(frozen=True)
class LedgerStats:
    """Counters of one writer since it started (``prefixgate`` exposes them as metrics and in stats).

    ``quarantined``: rows the database refused, kept in ``usage_quarantine``. ``spilled``: rows written
    to the quarantine file because the database stayed unavailable. ``lost``: rows that could not be
    kept anywhere (logged with their request ids). ``retries``: transient failures retried.
    """

    committed: int
    quarantined: int
    spilled: int
    replayed: int
    lost: int
    retries: int
    queued: int


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries of transient errors: ``attempts`` tries, sleeping ``first_delay_s`` doubling."""

    attempts: int = 4
    first_delay_s: float = 0.05
    busy_timeout_ms: int = 2000  # per attempt: the writer waits this long for another writer's lock


class LedgerWriter:
    """A daemon thread that commits submitted usage rows in batched transactions."""

    def __init__(self, target: DatabaseTarget | Path, *, spill_path: Path | None = None, batch_max: int = 256,
                 max_delay_s: float = 0.05, retry: RetryPolicy | None = None) -> None:
        """``target``: the database (a Path is an SQLite file). ``spill_path``: the quarantine file
        (default: next to an SQLite file; a PostgreSQL target must name one, under ``--home``)."""
        if isinstance(target, Path):
            target = DatabaseTarget(sqlite_path=target)
        if spill_path is None:
            assert target.sqlite_path is not None, "a PostgreSQL ledger needs a spill_path"
            spill_path = target.sqlite_path.with_name(QUARANTINE_FILENAME)
        self._target = target
        self._spill_path = spill_path
        self._batch_max = batch_max
        self._max_delay_s = max_delay_s
        self._retry = retry or RetryPolicy()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._wake = threading.Event()  # cuts the batching delay short (flush, close, full batch)
        self._hurry = threading.Event()  # set by close: stop retrying, spill what cannot be written
        self._lock = threading.Lock()
        self._db: Database | None = None  # the writer thread's connection, opened on its first batch (see _database)
        self._spill_pending = self._spill_path.exists()
        self._unavailable = False  # the last batch could not be written (transient): close() stops trying  # rows in the file wait for the database to work
        self._counts = {"committed": 0, "quarantined": 0, "spilled": 0, "replayed": 0, "lost": 0, "retries": 0}
        self._thread = threading.Thread(target=self._run, name="prefixgate-ledger", daemon=True)
        self._thread.start()

    @property
    def rows_committed(self) -> int:
        return self._counts["committed"]

    def stats(self) -> LedgerStats:
        return LedgerStats(**self._counts, queued=self._queue.qsize())

    def submit(self, row: Mapping[str, Any]) -> None:
        """Queue one usage row (a dict over ``USAGE_COLUMNS``). Never blocks on the database.

        The row is made storable here (see ``tenancy.storable``), on the caller's thread, so whatever a
        client sent cannot fail a batch.
        """
        if self._closed:
            raise RuntimeError("ledger writer is closed")
        self._queue.put(storable_row(row))
        if self._queue.qsize() >= self._batch_max:
            self._wake.set()

    def flush(self, timeout: float | None = 30.0) -> None:
        """Block until every row submitted before this call is committed, quarantined or spilled
        (or raise TimeoutError)."""
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(done)
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError(f"ledger flush did not finish within {timeout} s")

    def close(self, grace_s: float = 2.0) -> None:
        """Commit what is queued, then stop the thread. Idempotent.

        Past ``grace_s`` (the database stays locked) retries stop and the remaining rows go to the
        quarantine file: shutdown takes about one busy timeout more at worst, and keeps every row.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._wake.set()
        self._thread.join(grace_s)
        if self._thread.is_alive():
            self._hurry.set()
            self._thread.join(self._retry.busy_timeout_ms / 1000 + 5.0)
        # Rows the thread will not take: it is wedged inside SQLite, or a submit raced with close
        # and queued behind the stop marker. They go to the file, which the next start replays.
        rest = [item for item in _drain(self._queue) if isinstance(item, dict)]
        self._spill(rest, "writer did not stop in time" if self._thread.is_alive() else "submitted during close")

    # -- writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._spill_pending:  # a previous process left rows in the file
                self._spill_pending = False
                self._guarded(self._replay_spill_file, [])
            stop = False
            while not stop:
                rows, events, stop = self._collect()
                if rows:
                    self._guarded(functools.partial(self._commit, rows), rows)
                for ev in events:
                    ev.set()
        finally:
            if self._db is not None:
                self._db.close()

    def _guarded(self, work: Callable[[], None], rows: list[dict[str, Any]]) -> None:
        try:
            work()
        except Exception as exc:  # the thread must outlive anything: it holds every tenant's rows
            log.exception("ledger writer error")
            self._spill(rows, f"{type(exc).__name__}: {exc}")

    def _database(self) -> Database:
        """The writer's connection, opened lazily so that a locked database at start is one more
        transient failure, not a dead writer thread; a connection broken by a transient error (the
        PostgreSQL server restarted) is replaced on the next attempt."""
        if self._db is not None and self._db.broken:
            self._db.close()
            self._db = None
        if self._db is None:
            # May raise "database is locked" (a migration waits for the write lock): a transient failure.
            self._db = self._target.connect(busy_timeout_s=self._retry.busy_timeout_ms / 1000)
        return self._db

    def _is_transient(self, exc: BaseException) -> bool:
        if self._db is not None:
            return self._db.classify(exc) is ErrorKind.TRANSIENT
        # No connection yet: SQLite's "locked", or a PostgreSQL server not answering (start-up).
        return is_transient(exc) or _is_unavailable(exc)

    def _collect(self) -> tuple[list[dict[str, Any]], list[threading.Event], bool]:
        """Block for one item, let a batch accumulate for up to ``max_delay_s``, then drain the queue.

        The thread wakes once per batch, not once per row: waking per row makes it fight the request
        threads for the GIL on every ``submit``. A full batch, ``flush`` or ``close`` cuts the wait short.
        """
        rows: list[dict[str, Any]] = []
        events: list[threading.Event] = []
        item = self._queue.get()
        if (item is not _STOP and not isinstance(item, threading.Event)
                and self._queue.qsize() < self._batch_max - 1):  # a backlog is written at once
            self._wake.wait(self._max_delay_s)
        self._wake.clear()  # set()s before this point are safe: their items are already queued
        while True:
            if item is _STOP:
                return rows, events, True
            if isinstance(item, threading.Event):
                events.append(item)
            else:
                rows.append(item)
            if len(rows) >= self._batch_max:
                return rows, events, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return rows, events, False

    def _commit(self, rows: list[dict[str, Any]]) -> None:
        """Write ``rows``: bounded retries of transient errors, then the quarantine file. Never raises."""
        if self._hurry.is_set() and self._unavailable:  # shutting down and the database is not answering
            self._spill(rows, "database unavailable at shutdown")
            return
        delay = self._retry.first_delay_s
        reason = "unknown"
        for attempt in range(1, self._retry.attempts + 1):
            try:
                refused = write_rows(self._database(), rows)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                if not self._is_transient(exc):
                    break  # not the rows (each was tried alone) and not going away: the file keeps them
                self._counts["retries"] += 1
                if attempt == self._retry.attempts or self._hurry.is_set():
                    break
                log.warning("ledger write of %d rows failed (%s); retry %d in %.2f s",
                            len(rows), exc, attempt, delay)
                self._hurry.wait(delay)
                delay *= 2
                continue
            self._unavailable = False
            self._counts["committed"] += len(rows) - len(refused)
            self._counts["quarantined"] += len(refused)
            for row, why in refused:
                log.error("ledger row %s of tenant %s refused (%s); kept in usage_quarantine",
                          row.get("request_id"), row.get("tenant_id"), why)
            if self._spill_pending:  # the database works again: bring back what was spilled
                self._spill_pending = False
                self._replay_spill_file()
            return
        self._unavailable = True
        log.error("ledger write of %d rows failed (%s); spilling them to %s", len(rows), reason, self._spill_path)
        self._spill(rows, reason)

    def _spill(self, rows: list[dict[str, Any]], reason: str) -> None:
        if not rows:
            return
        try:
            append_spill_file(self._spill_path, rows, reason)
            self._counts["spilled"] += len(rows)
            self._spill_pending = True
        except OSError as exc:
            self._counts["lost"] += len(rows)
            log.error("ledger rows lost (%s): %s", exc, ", ".join(str(r.get("request_id")) for r in rows))

    def _replay_spill_file(self) -> None:
        """Write the rows spilled earlier (by this writer or a previous process), then remove them.
        Rows that fail again are spilled again, to a fresh file."""
        if not self._spill_path.exists():
            return
        taken = self._spill_path.with_name(self._spill_path.name + f".replay{os.getpid()}")
        try:
            os.replace(self._spill_path, taken)  # later spills of this writer start a new file
            rows = read_spill_file(taken)
        except OSError as exc:
            log.error("cannot read the ledger quarantine file %s: %s", self._spill_path, exc)
            return
        before = self._counts["spilled"]
        self._commit(rows)
        if self._counts["spilled"] == before:
            self._counts["replayed"] += len(rows)
        taken.unlink(missing_ok=True)


def write_rows(db: Database, rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """Insert ``rows`` in one transaction; rows whose request_id exists already are skipped.

    Returns the rows the database refused on their own, with the reason; they are stored in
    ``usage_quarantine`` in the same transaction, and every other row commits. Raises only for an
    error of the database itself (transient or not), with nothing committed.
    """
    params = [tuple(r.get(c) for c in USAGE_COLUMNS) for r in rows]
    try:
        # Not exclusive: ON CONFLICT makes concurrent batches from several gateways safe without a lock.
        with db.transaction(exclusive=False):
            db.executemany(_INSERT, params)
        return []
    except Exception as exc:
        if db.classify(exc) is not ErrorKind.REFUSED:
            raise
    refused: list[tuple[dict[str, Any], str]] = []
    with db.transaction(exclusive=False):
        for row, values in zip(rows, params, strict=True):
            try:
                with db.savepoint():
                    db.execute(_INSERT, values)
            except Exception as exc:
                if db.classify(exc) is not ErrorKind.REFUSED:
                    raise
                refused.append((row, f"{type(exc).__name__}: {exc}"))
        db.executemany(
            "INSERT INTO usage_quarantine (request_id, tenant_id, reason, row_json, created_at) VALUES (?, ?, ?, ?, ?)",
            [(storable_text(r.get("request_id"), 200), storable_text(r.get("tenant_id"), 64),
              storable_text(why, 500), _row_json(r), time.time()) for r, why in refused],
        )
    return refused


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, DatabaseUnavailableError)


def _row_json(row: Mapping[str, Any]) -> str:
    # ensure_ascii: a lone surrogate becomes the escape "\ud800", which any UTF-8 store accepts.
    return json.dumps(dict(row), ensure_ascii=True, default=repr, allow_nan=True)


def append_spill_file(path: Path, rows: list[dict[str, Any]], reason: str) -> None:
    """Append ``rows`` to the quarantine file (created 0600: it holds usage like the database)."""
    lines = "".join(json.dumps({"reason": reason, "row": json.loads(_row_json(r))}, ensure_ascii=True) + "\n"
                    for r in rows)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, lines.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_spill_file(path: Path) -> list[dict[str, Any]]:
    """The rows of a quarantine file, made storable again; a line cut by a crash is skipped."""
    rows = []
    for line in path.read_text("ascii", errors="replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("row"), dict):
            rows.append(storable_row(item["row"]))
    return rows


def _drain(q: queue.Queue[Any]) -> list[Any]:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
