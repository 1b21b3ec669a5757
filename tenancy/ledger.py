"""The usage ledger writer: one row per request, written off the request path.

::

    request threads ──submit(row)──► queue ──► writer thread ──► BEGIN; INSERT OR IGNORE x N; COMMIT
                                                  (own SQLite connection, batches of <= batch_max rows
                                                   or whatever arrived within max_delay_s)

Guarantees:
    - Idempotent: ``request_id`` is the primary key and rows go in with ``INSERT OR IGNORE``, so a
      retried record (the gateway may record twice after a reconnect) is stored once, first wins.
    - Crash-safe: a batch is one SQLite transaction in WAL mode with ``synchronous=FULL``; a process
      killed at any instant leaves every committed batch whole and no part of an uncommitted one.
      Rows still in the queue at a kill are lost (at most ``max_delay_s`` worth); ``flush`` waits
      until everything submitted before it is committed.
    - A failing write (database locked for longer than busy_timeout, disk full) is retried with
      backoff; rows are kept, never dropped, while the writer runs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

from tenancy import db as dbmod

log = logging.getLogger("tenancy.ledger")

USAGE_COLUMNS: tuple[str, ...] = (
    "request_id", "tenant_id", "key_id", "model", "backend", "prompt_tokens", "cached_tokens",
    "completion_tokens", "ttft_s", "latency_s", "status", "created_at", "cost_usd", "saved_usd",
    "priced_as", "miss_rule", "miss_position", "miss_detail", "miss_tokens", "miss_family", "miss_context",
    "miss_usd",
)

_STOP = object()


class LedgerWriter:
    """A daemon thread that commits submitted usage rows in batched transactions."""

    def __init__(self, db_path: Path, *, batch_max: int = 256, max_delay_s: float = 0.05) -> None:
        self._db_path = db_path
        self._batch_max = batch_max
        self._max_delay_s = max_delay_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._wake = threading.Event()  # cuts the batching delay short (flush, close, full batch)
        self._lock = threading.Lock()
        self.rows_committed = 0
        self._thread = threading.Thread(target=self._run, name="prefixgate-ledger", daemon=True)
        self._thread.start()

    def submit(self, row: dict[str, Any]) -> None:
        """Queue one usage row (a dict over ``USAGE_COLUMNS``). Never blocks on the database."""
        if self._closed:
            raise RuntimeError("ledger writer is closed")
        self._queue.put(row)
        if self._queue.qsize() >= self._batch_max:
            self._wake.set()

    def flush(self, timeout: float | None = 30.0) -> None:
        """Block until every row submitted before this call is committed (or raise TimeoutError)."""
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(done)
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError(f"ledger flush did not finish within {timeout} s")

    def close(self, timeout: float | None = 30.0) -> None:
        """Commit what is queued, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._wake.set()
        self._thread.join(timeout)

    # -- writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        db = dbmod.connect(self._db_path)
        try:
            stop = False
            while not stop:
                rows, events, stop = self._collect()
                if rows:
                    self._write_with_retry(db, rows)
                for ev in events:
                    ev.set()
        finally:
            db.close()

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

    def _write_with_retry(self, db: Any, rows: list[dict[str, Any]]) -> None:
        delay = 0.05
        while True:
            try:
                write_rows(db, rows)
                self.rows_committed += len(rows)
                return
            except Exception as exc:  # keep the rows; a locked/full disk may recover
                log.error("ledger write of %d rows failed (%s); retrying in %.2f s", len(rows), exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)


def write_rows(db: Any, rows: list[dict[str, Any]]) -> None:
    """Insert ``rows`` in one transaction; rows whose request_id exists already are skipped."""
    with dbmod.write_transaction(db):
        db.conn.executemany(
            f"INSERT OR IGNORE INTO usage ({', '.join(USAGE_COLUMNS)}) "
            f"VALUES ({', '.join('?' for _ in USAGE_COLUMNS)})",
            [tuple(r.get(c) for c in USAGE_COLUMNS) for r in rows],
        )
