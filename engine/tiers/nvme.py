"""The cold tier: one file per encrypted segment plus a SQLite index, bounded in bytes.

Layout under ``root`` (the manager picks ``<nvme_dir>/kv-v<format>/<model slug>``, so two models
never read each other's blocks)::

    root/index.sqlite            one row per segment (namespace, hashes, sizes, times, hits)
    root/segments/ab/<id>.seg    the blob: nonce || ciphertext || tag, as the cipher made it
    root/segments/ab/.<id>.tmp   a write in progress (deleted at start-up if a crash left it)

Crash safety: a segment is written to a temp file, fsync'ed, renamed into place, the directory
fsync'ed, and only then is its index row committed. Eviction deletes the row first, then the
file. So the index never names a file that is not complete on disk; a crash can at worst leave a
file with no row, which start-up deletes. SQLite runs in WAL mode with ``synchronous=NORMAL``:
a power cut may lose the last rows, which again only orphans files.

A new ``NvmeTier`` on the same ``root`` finds every segment the last one committed (and that is
complete on disk), so an engine restarted on the same directory finds its cold blocks again.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.kv_types import BlockHash, TierName
from engine.tiers.base import (
    BlockLocation,
    PutResult,
    SegmentMeta,
    TenantCap,
    TenantCapFn,
    TierWriteError,
)
from engine.tiers.indexed import IndexedTierQueries
from engine.tiers.placement import ScoreFn, SegmentIndex, lru_score

_SCHEMA = """
CREATE TABLE IF NOT EXISTS segments (
    id            TEXT PRIMARY KEY,
    namespace     BLOB NOT NULL,
    tenant_label  TEXT NOT NULL,
    hash_len      INTEGER NOT NULL,
    hashes        BLOB NOT NULL,      -- hash_len-byte hashes, concatenated in chain order
    block_bytes   INTEGER NOT NULL,
    nbytes        INTEGER NOT NULL,
    created_s     REAL NOT NULL,
    last_access_s REAL NOT NULL,
    expires_s     REAL,
    hits          INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS segments_by_namespace ON segments(namespace);
"""


def write_durably(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync of the directory.

    Raises OSError (ENOSPC, EROFS, EIO ...) with nothing left behind at ``path`` or the temp path.
    """
    tmp = path.with_name(f".{path.stem}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        for p in (tmp, path):
            p.unlink(missing_ok=True)
        raise


class NvmeTier(IndexedTierQueries):
    """``Tier`` on a local disk. See ``engine.tiers.base.Tier`` for the contract."""

    name = TierName.NVME

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        *,
        score: ScoreFn = lru_score,
        tenant_cap: TenantCapFn = lambda ns: TenantCap(),
        floor_fraction: float = 1.0,
        clock: Callable[[], float] = time.time,
    ):
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self._seg_dir = self.root / "segments"
        self._seg_dir.mkdir(parents=True, exist_ok=True)
        self._index = SegmentIndex(capacity_bytes, floor_fraction=floor_fraction, score=score)
        self._tenant_cap = tenant_cap
        self._clock = clock
        self._lock = threading.Lock()
        # One connection shared by the worker threads, always used under self._lock.
        self._db = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.recovered_segments, self.discarded_on_recovery = self._recover()

    # ---- start-up ------------------------------------------------------------------------------
    def _path(self, segment_id: str) -> Path:
        return self._seg_dir / segment_id[:2] / f"{segment_id}.seg"

    def _recover(self) -> tuple[int, int]:
        """Rebuild the in-memory index from SQLite; drop rows whose file is missing or short,
        files with no row, and leftovers of interrupted writes. Returns (kept, discarded)."""
        kept, discarded, bad_rows = 0, 0, []
        rows = self._db.execute(
            "SELECT id, namespace, tenant_label, hash_len, hashes, block_bytes, nbytes, created_s,"
            " last_access_s, expires_s, hits FROM segments ORDER BY created_s").fetchall()
        for (sid, ns, label, hlen, hashes, bb, nbytes, created, last, expires, hits) in rows:
            path = self._path(sid)
            try:
                ok = path.stat().st_size == nbytes
            except FileNotFoundError:
                ok = False
            hs = tuple(bytes(hashes[i:i + hlen]) for i in range(0, len(hashes), hlen))
            if not ok or not hs:
                bad_rows.append(sid)
                continue
            self._index.add(SegmentMeta(sid, bytes(ns), label, hs, bb, nbytes, created, last, expires, hits))
            kept += 1
        if bad_rows:
            self._db.executemany("DELETE FROM segments WHERE id = ?", [(s,) for s in bad_rows])
            discarded += len(bad_rows)
        known = set(self._index.segments)
        for path in self._seg_dir.glob("*/*"):
            if path.name.endswith(".tmp") or path.stem not in known:
                path.unlink(missing_ok=True)
        # Capacity may have shrunk since the last run: shed the lowest-valued segments.
        if self._index.used_bytes > self.capacity_bytes:
            now = self._clock()
            for meta in sorted(self._index.segments.values(), key=lambda m: self._index.score(m, now)):
                if self._index.used_bytes <= self.capacity_bytes:
                    break
                self._remove_locked(meta.segment_id)
                kept -= 1
                discarded += 1
        return kept, discarded

    # ---- Tier ----------------------------------------------------------------------------------
    def contains(self, namespace: bytes, block_hash: BlockHash) -> BlockLocation | None:
        with self._lock:
            return self._index.lookup(namespace, block_hash, self._clock())

    def get(self, segment_id: str) -> tuple[SegmentMeta, bytes] | None:
        with self._lock:
            meta = self._index.segments.get(segment_id)
            now = self._clock()
            if meta is None or meta.expired(now):
                return None
            try:
                # Open under the lock: once open, a concurrent eviction's unlink cannot take the
                # bytes away from this reader.
                f = open(self._path(segment_id), "rb")  # noqa: SIM115 - closed below, outside the lock
            except FileNotFoundError:
                self._remove_locked(segment_id)
                return None
            meta.hits += 1
            meta.last_access_s = now
            self._db.execute("UPDATE segments SET hits = ?, last_access_s = ? WHERE id = ?",
                             (meta.hits, now, segment_id))
        with f:
            # A short read (truncated file) is returned as is: the cipher rejects it as a failed
            # tag, which the manager counts as an authentication failure.
            return meta, f.read()

    def put(self, meta: SegmentMeta, blob: bytes | memoryview) -> PutResult:
        if len(blob) != meta.nbytes:
            raise ValueError(f"blob has {len(blob)} bytes, meta says {meta.nbytes}")
        with self._lock:  # cheap early refusal: no point writing a file that cannot be kept
            cap = self._tenant_cap(meta.namespace)
            plan = self._index.plan_room(meta.namespace, meta.nbytes, cap.bytes, self._clock(),
                                         need_blocks=meta.num_blocks, tenant_cap_blocks=cap.blocks)
        if isinstance(plan, str):
            return PutResult(stored=False, reason=plan)
        path = self._path(meta.segment_id)
        try:
            path.parent.mkdir(exist_ok=True)
            write_durably(path, blob)
        except OSError as exc:
            raise TierWriteError(f"cannot write {path}: {exc.strerror or exc}") from exc
        with self._lock:
            # Re-plan: other writers may have filled the tier while this file was written.
            cap = self._tenant_cap(meta.namespace)
            plan = self._index.plan_room(meta.namespace, meta.nbytes, cap.bytes, self._clock(),
                                         need_blocks=meta.num_blocks, tenant_cap_blocks=cap.blocks)
            if isinstance(plan, str):
                path.unlink(missing_ok=True)
                return PutResult(stored=False, reason=plan)
            evicted = [self._remove_locked(sid) for sid in plan]
            hlen = len(meta.hashes[0])
            self._db.execute(
                "INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (meta.segment_id, meta.namespace, meta.tenant_label, hlen, b"".join(meta.hashes),
                 meta.block_bytes, meta.nbytes, meta.created_s, meta.last_access_s, meta.expires_s,
                 meta.hits))
            orphans = self._index.add(meta)
            evicted += [self._remove_locked(sid) for sid in orphans]
            return PutResult(stored=True, evicted=tuple(e for e in evicted if e is not None))

    def evict(self, segment_id: str) -> tuple[SegmentMeta, bytes | None] | None:
        with self._lock:
            return self._remove_locked(segment_id)

    def _remove_locked(self, segment_id: str) -> tuple[SegmentMeta, None] | None:
        meta = self._index.remove(segment_id)
        if meta is None:
            return None
        self._db.execute("DELETE FROM segments WHERE id = ?", (segment_id,))  # row first, then file
        self._path(segment_id).unlink(missing_ok=True)
        return meta, None

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()
            ids = {r[0] for r in self._db.execute("SELECT id FROM segments")}
            assert ids == set(self._index.segments), "SQLite rows and the in-memory index differ"
            for sid, meta in self._index.segments.items():
                assert self._path(sid).stat().st_size == meta.nbytes, sid
            on_disk = {p.stem for p in self._seg_dir.glob("*/*.seg")}
            assert on_disk == ids, "segment files and index rows differ"

    def close(self) -> None:
        with self._lock:
            self._db.close()
