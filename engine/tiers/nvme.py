"""The cold tier: one file per encrypted segment plus a SQLite index, bounded in bytes.

Layout under ``root`` (the manager picks ``<nvme_dir>/kv-v<format>/<model slug>``, so two models
never read each other's blocks)::

    root/index.sqlite            one row per segment (keyed namespace tag, sealed hashes, sizes, times, hits)
    root/segments/ab/<id>.seg    the blob: nonce || ciphertext || tag, as the cipher made it
    root/segments/ab/.<id>.tmp   a write in progress (deleted at start-up if a crash left it)

Nothing on disk names a namespace or a block hash in clear (``engine.tiers.index_seal``): rows
recovered at start-up stay *sealed* (counted in capacity, matched by nothing) until a lookup for
their namespace unseals them. A row's owner (the tenant key its caps count it against) is kept as
a tag too (``owner_tag``); a recovered segment counts against a stand-in owner until its tenant's
next spill into this tier names the key again (rows from before owners were kept: their namespace). Files are 0600 and directories 0700.

Damage is a cache miss and a count, never a failed start: an index SQLite cannot open (garbage over
its header, a newer or older schema) is moved aside to ``index.sqlite.damaged-<time>`` and rebuilt
empty; a row with impossible values is dropped; anything under ``segments/`` that is not a
complete segment file of a row (a directory, a link, a leftover) is removed.

Crash safety: a segment is written to a temp file, fsync'ed, renamed into place, the directory
fsync'ed, and only then is its index row committed. Eviction deletes the row first, then the
file. So the index never names a file that is not complete on disk; a crash can at worst leave a
file with no row, which start-up deletes. SQLite runs in WAL mode with ``synchronous=NORMAL``:
a power cut may lose the last rows, which again only orphans files.

A new ``NvmeTier`` on the same ``root`` finds every segment the last one committed (and that is
complete on disk), so an engine restarted on the same directory finds its cold blocks again.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from engine.kv_types import BlockHash, TierName
from engine.tiers.base import (
    BlockLocation,
    PutResult,
    SegmentMeta,
    TenantCap,
    TenantCapFn,
    TierWriteError,
)
from engine.tiers.index_seal import IndexSealer
from engine.tiers.indexed import IndexedTierQueries
from engine.tiers.placement import ScoreFn, SegmentIndex, lru_score

log = logging.getLogger("engine.tiers.nvme")

INDEX_VERSION = 4  # PRAGMA user_version; 0/1 = the old index with raw namespaces and hashes
_ADDED_IN = {  # v2 -> v3 -> v4 keep every row
    3: "ALTER TABLE segments ADD COLUMN retain_until_s REAL",
    4: "ALTER TABLE segments ADD COLUMN owner_tag BLOB",
}
_SCHEMA = """
CREATE TABLE IF NOT EXISTS segments (
    id            TEXT PRIMARY KEY,
    ns_tag        BLOB NOT NULL,      -- IndexSealer.tag(namespace)
    tenant_label  TEXT NOT NULL,
    hash_len      INTEGER NOT NULL,
    sealed        BLOB NOT NULL,      -- IndexSealer.seal(namespace, id, hashes)
    block_bytes   INTEGER NOT NULL,
    nbytes        INTEGER NOT NULL,
    created_s     REAL NOT NULL,
    last_access_s REAL NOT NULL,
    expires_s     REAL,
    hits          INTEGER NOT NULL DEFAULT 0,
    retain_until_s REAL,               -- explicit retention (SegmentMeta.retain_until_s)
    owner_tag     BLOB                 -- IndexSealer.tag(owner); NULL (v3 rows): the namespace
);
CREATE INDEX IF NOT EXISTS segments_by_tag ON segments(ns_tag);
"""
_SEGMENT_ID = re.compile(r"[0-9a-f]{8,64}")  # also a file name: nothing else may reach a path
_SEALED_PREFIX = b"sealed:"  # the in-memory namespace of a segment whose namespace is not known yet
_OWNER_PREFIX = b"owner-tag:"  # the in-memory owner of a recovered segment whose tenant key is not known yet
_CHECKED_MAX = 100_000


class IndexDamage:
    """What start-up found wrong below the engine (each a cache miss, never a failed start)."""

    def __init__(self) -> None:
        self.index_reset = 0  # index.sqlite moved aside and rebuilt
        self.bad_rows = 0  # rows with impossible values, or no complete file
        self.junk_entries = 0  # directories, links and stray files removed from segments/

    @property
    def total(self) -> int:
        return self.index_reset + self.bad_rows + self.junk_entries


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
        index_key: bytes = b"",
    ):
        """``index_key`` keys what the index stores (see ``engine.tiers.index_seal``); give the same
        key on every start, or the blocks stored before are unreachable (and shed as capacity needs)."""
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self._seg_dir = self.root / "segments"
        _private_dir(self._seg_dir, up_to=self.root.parent)
        self._index = SegmentIndex(capacity_bytes, floor_fraction=floor_fraction, score=score)
        self._tenant_cap = tenant_cap
        self._clock = clock
        self._sealer = IndexSealer(index_key)
        self._lock = threading.Lock()
        # Recovered segments not yet matched to a namespace: ns tag -> their ids, and the raw rows.
        self._sealed: dict[bytes, list[str]] = {}
        self._sealed_rows: dict[str, tuple[bytes, int]] = {}  # id -> (sealed hashes, hash_len)
        self._checked: set[bytes] = set()  # namespaces known to have no sealed segment
        self._owner_sealed: dict[bytes, list[str]] = {}  # owner tag -> recovered segments charged to it
        self.damage = IndexDamage()
        # One connection shared by the worker threads, always used under self._lock.
        self._db = self._open_index()
        self.recovered_segments, self.discarded_on_recovery = self._recover()

    # ---- start-up ------------------------------------------------------------------------------
    def _path(self, segment_id: str) -> Path:
        return self._seg_dir / segment_id[:2] / f"{segment_id}.seg"

    def _open_index(self) -> sqlite3.Connection:
        """The index database; one that is damaged or of another version is set aside, not trusted."""
        path = self.root / "index.sqlite"
        try:
            return _connect_index(path)
        except (sqlite3.DatabaseError, _OldIndex) as exc:
            old = isinstance(exc, _OldIndex)
            for suffix in ("", "-wal", "-shm"):
                p = path.with_name(path.name + suffix)
                if not p.exists():
                    continue
                if old:  # the old format holds raw namespaces and hashes: do not keep it around
                    p.unlink()
                else:
                    p.replace(p.with_name(f"{p.name}.damaged-{int(time.time())}"))
            if not old:
                self.damage.index_reset += 1
                log.warning("kv tier nvme: %s is damaged (%s); moved aside, starting with an empty index",
                            path, exc)
            return _connect_index(path)

    def _recover(self) -> tuple[int, int]:
        """Rebuild the in-memory index from SQLite; drop rows whose file is missing or short, rows
        with impossible values, files with no row, leftovers of interrupted writes and anything else
        under ``segments/``. Returns (kept, discarded)."""
        kept, bad_rows = 0, []
        try:
            rows = self._db.execute(
                "SELECT id, ns_tag, tenant_label, hash_len, sealed, block_bytes, nbytes, created_s,"
                " last_access_s, expires_s, hits, retain_until_s, owner_tag FROM segments"
                " ORDER BY created_s").fetchall()
        except sqlite3.DatabaseError as exc:  # damage past the header: found only when read
            self._db.close()
            (self.root / "index.sqlite").replace(self.root / f"index.sqlite.damaged-{int(time.time())}")
            self.damage.index_reset += 1
            log.warning("kv tier nvme: index unreadable (%s); moved aside, starting empty", exc)
            self._db = _connect_index(self.root / "index.sqlite")
            rows = []
        for row in rows:
            meta = self._sealed_meta(row)
            if meta is None:
                bad_rows.append(row[0])
                continue
            self._index.add(meta)
            self._sealed.setdefault(bytes(row[1]), []).append(meta.segment_id)
            self._sealed_rows[meta.segment_id] = (bytes(row[4]), int(row[3]))
            if meta.owner.startswith(_OWNER_PREFIX):
                self._owner_sealed.setdefault(meta.owner[len(_OWNER_PREFIX):], []).append(meta.segment_id)
            kept += 1
        if bad_rows:
            self._db.executemany("DELETE FROM segments WHERE id = ?", [(s,) for s in bad_rows])
            self.damage.bad_rows += len(bad_rows)
        discarded = len(bad_rows)
        self._clean_segment_dir()
        # Capacity may have shrunk since the last run: shed the lowest-valued segments.
        if self._index.used_bytes > self.capacity_bytes:
            now = self._clock()
            for meta in self._index.eviction_order(now):
                if self._index.used_bytes <= self.capacity_bytes:
                    break
                self._remove_locked(meta.segment_id)
                kept -= 1
                discarded += 1
        return kept, discarded

    def _sealed_meta(self, row: tuple) -> SegmentMeta | None:
        """The in-memory stand-in of a recovered row, or None when the row cannot be right."""
        sid, tag, label, hlen, sealed, bb, nbytes, created, last, expires, hits, retain, owner_tag = row
        try:
            if not (isinstance(sid, str) and _SEGMENT_ID.fullmatch(sid) and isinstance(tag, bytes)
                    and isinstance(sealed, bytes) and isinstance(hlen, int) and 0 < hlen <= 64
                    and sealed and len(sealed) % hlen == 0 and isinstance(label, str)
                    and isinstance(bb, int) and bb > 0 and isinstance(nbytes, int) and nbytes > 0
                    and isinstance(hits, int) and (retain is None or isinstance(retain, int | float))
                    and (owner_tag is None or (isinstance(owner_tag, bytes) and owner_tag))):
                return None
            if self._path(sid).stat().st_size != nbytes:
                return None
            # masked stand-ins in the hashes' place, under the sealed namespace: no lookup finds them
            # until _unseal_locked gives the segment its real namespace and hashes
            masked = cast("tuple[BlockHash, ...]",
                          tuple(sealed[i:i + hlen] for i in range(0, len(sealed), hlen)))
            return SegmentMeta(sid, _SEALED_PREFIX + tag, label, masked, bb, nbytes, float(created),
                               float(last), None if expires is None else float(expires), hits,
                               None if retain is None else float(retain),
                               owner=b"" if owner_tag is None else _OWNER_PREFIX + owner_tag)
        except (OSError, TypeError, ValueError):
            return None

    def _clean_segment_dir(self) -> None:
        """Remove everything under ``segments/`` that is not the file of a kept segment."""
        known = set(self._index.segments)
        for entry in self._seg_dir.iterdir():
            if entry.is_dir() and not entry.is_symlink() and len(entry.name) == 2:
                for path in entry.iterdir():
                    regular = path.is_file() and not path.is_symlink()
                    if regular and path.suffix == ".seg" and path.stem in known:
                        continue
                    # a file of ours with no row is a crash leftover (expected); anything else is damage
                    ours = regular and (path.name.endswith(".tmp") or path.suffix == ".seg")
                    self._remove_junk(path, counted=not ours)
            else:
                self._remove_junk(entry, counted=True)

    def _remove_junk(self, path: Path, *, counted: bool) -> None:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:  # unremovable: leave it, it is never read
            log.warning("kv tier nvme: cannot remove %s: %s", path, exc)
        if counted:
            self.damage.junk_entries += 1
            log.warning("kv tier nvme: removed %s (not a segment of the index)", path)

    def _unseal_locked(self, namespace: bytes) -> None:
        """Give the recovered segments of ``namespace`` their real namespace and hashes (once)."""
        if not self._sealed or namespace in self._checked:
            return
        if len(self._checked) >= _CHECKED_MAX:
            self._checked.clear()
        self._checked.add(namespace)
        ids = self._sealed.pop(self._sealer.tag(namespace), None)
        for sid in ids or ():
            sealed, hlen = self._sealed_rows.pop(sid)
            masked = self._index.remove(sid)
            if masked is None:  # evicted while sealed
                continue
            hashes = self._sealer.unseal(namespace, sid, sealed, hlen)
            if any(self._index.lookup(namespace, h, masked.created_s) is not None for h in hashes):
                # a newer copy of these blocks exists already: this older one would shadow it
                self._forget_locked(sid)
                continue
            # a row without an owner tag is charged to its namespace, now known
            owner = namespace if masked.owner == masked.namespace else masked.owner
            meta = SegmentMeta(sid, namespace, masked.tenant_label, hashes, masked.block_bytes, masked.nbytes,
                               masked.created_s, masked.last_access_s, masked.expires_s, masked.hits,
                               masked.retain_until_s, owner=owner)
            for orphan in self._index.add(meta):
                self._remove_locked(orphan)

    # ---- Tier ----------------------------------------------------------------------------------
    def contains(self, namespace: bytes, block_hash: BlockHash) -> BlockLocation | None:
        with self._lock:
            self._unseal_locked(namespace)
            return self._index.lookup(namespace, block_hash, self._clock())

    def segments_of(self, namespace: bytes) -> list[str]:
        with self._lock:
            self._unseal_locked(namespace)
            return self._index.of_namespace(namespace)

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
            except OSError as exc:  # gone, or replaced by something unreadable (a directory, no access)
                if not isinstance(exc, FileNotFoundError):
                    log.warning("kv tier nvme: cannot open segment %s (%s); dropped", segment_id, exc)
                self._remove_locked(segment_id)
                return None
            meta.hits += 1
            meta.last_access_s = now
            self._persist("UPDATE segments SET hits = ?, last_access_s = ? WHERE id = ?",
                          (meta.hits, now, segment_id))
        with f:
            # A short read (truncated file) is returned as is: the cipher rejects it as a failed
            # tag, which the manager counts as an authentication failure. An I/O error is a miss.
            try:
                return meta, f.read()
            except OSError as exc:
                log.warning("kv tier nvme: cannot read segment %s (%s)", segment_id, exc)
                return None

    def put(self, meta: SegmentMeta, blob: bytes | memoryview) -> PutResult:
        if len(blob) != meta.nbytes:
            raise ValueError(f"blob has {len(blob)} bytes, meta says {meta.nbytes}")
        if not _SEGMENT_ID.fullmatch(meta.segment_id):
            raise ValueError(f"segment id {meta.segment_id!r} is not lower-case hex")
        with self._lock:  # cheap early refusal: no point writing a file that cannot be kept
            self._adopt_owner_locked(meta.owner)  # its recovered segments count against its caps
            cap = self._tenant_cap(meta.owner)
            plan = self._index.plan_room(meta.owner, meta.nbytes, cap.bytes, self._clock(),
                                         need_blocks=meta.num_blocks, tenant_cap_blocks=cap.blocks)
        if isinstance(plan, str):
            return PutResult(stored=False, reason=plan)
        path = self._path(meta.segment_id)
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            write_durably(path, blob)
        except OSError as exc:
            raise TierWriteError(f"cannot write {path}: {exc.strerror or exc}") from exc
        with self._lock:
            # Re-plan: other writers may have filled the tier while this file was written.
            cap = self._tenant_cap(meta.owner)
            plan = self._index.plan_room(meta.owner, meta.nbytes, cap.bytes, self._clock(),
                                         need_blocks=meta.num_blocks, tenant_cap_blocks=cap.blocks)
            if isinstance(plan, str):
                path.unlink(missing_ok=True)
                return PutResult(stored=False, reason=plan)
            self._unseal_locked(meta.namespace)  # recovered copies of these blocks are older: found first
            evicted = [self._remove_locked(sid) for sid in plan]
            hlen = len(meta.hashes[0])
            try:
                self._db.execute(
                    "INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (meta.segment_id, self._sealer.tag(meta.namespace), meta.tenant_label, hlen,
                     self._sealer.seal(meta.namespace, meta.segment_id, meta.hashes),
                     meta.block_bytes, meta.nbytes, meta.created_s, meta.last_access_s, meta.expires_s,
                     meta.hits, meta.retain_until_s, self._sealer.tag(meta.owner)))
            except sqlite3.Error as exc:  # the index went bad under us: this segment is not kept
                path.unlink(missing_ok=True)
                raise TierWriteError(f"cannot index {path.name}: {exc}") from exc
            orphans = self._index.add(meta)
            evicted += [self._remove_locked(sid) for sid in orphans]
            return PutResult(stored=True, evicted=tuple(e for e in evicted if e is not None))

    def evict(self, segment_id: str) -> tuple[SegmentMeta, bytes | None] | None:
        with self._lock:
            return self._remove_locked(segment_id)

    def retain(self, namespace: bytes, hashes: Sequence[BlockHash], until_s: float) -> int:
        with self._lock:  # recovered segments of this tenant become findable first
            self._unseal_locked(namespace)
        return super().retain(namespace, hashes, until_s)

    def _retention_moved(self, segment_ids: list[str]) -> None:
        for sid in segment_ids:  # a restart on the same directory keeps the retention
            self._persist("UPDATE segments SET retain_until_s = ? WHERE id = ?",
                          (self._index.segments[sid].retain_until_s, sid))

    def _adopt_owner_locked(self, owner: bytes) -> None:
        """Charge the recovered segments whose owner tag is ``owner``'s to ``owner`` itself (once)."""
        if not self._owner_sealed:
            return
        for sid in self._owner_sealed.pop(self._sealer.tag(owner), ()):
            if sid in self._index.segments:
                self._index.rekey_owner(sid, owner)

    def _remove_locked(self, segment_id: str) -> tuple[SegmentMeta, None] | None:
        meta = self._index.remove(segment_id)
        if meta is None:
            return None
        if meta.owner.startswith(_OWNER_PREFIX):
            pending = self._owner_sealed.get(meta.owner[len(_OWNER_PREFIX):])
            if pending is not None and segment_id in pending:
                pending.remove(segment_id)
        if meta.namespace.startswith(_SEALED_PREFIX):  # never unsealed: drop its bookkeeping too
            sealed = self._sealed.get(meta.namespace[len(_SEALED_PREFIX):])
            if sealed is not None and segment_id in sealed:
                sealed.remove(segment_id)
            self._sealed_rows.pop(segment_id, None)
        self._forget_locked(segment_id)
        return meta, None

    def _forget_locked(self, segment_id: str) -> None:
        self._persist("DELETE FROM segments WHERE id = ?", (segment_id,))  # row first, then file
        path = self._path(segment_id)
        try:
            path.unlink(missing_ok=True)
        except OSError:  # something else took the file's place: the next start removes it
            self._remove_junk(path, counted=True)

    def _persist(self, sql: str, params: tuple) -> None:
        """Write bookkeeping to the index; a failure is logged, never raised: memory is authoritative
        while running, and start-up reconciles rows with files (a stale row only costs a miss)."""
        try:
            self._db.execute(sql, params)
        except sqlite3.Error as exc:
            log.warning("kv tier nvme: index write failed (%s); continuing from memory", exc)

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


class _OldIndex(Exception):
    """The index was written by another version of this tier."""


def _connect_index(path: Path) -> sqlite3.Connection:
    if not path.exists():  # SQLite gives the -wal and -shm files the mode of the database file
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        if tables and 2 <= version < INDEX_VERSION:  # same sealing, fewer columns: add them
            for v in range(version + 1, INDEX_VERSION + 1):
                db.execute(_ADDED_IN[v])
            db.execute(f"PRAGMA user_version = {INDEX_VERSION}")
            version = INDEX_VERSION
        if tables and version != INDEX_VERSION:
            raise _OldIndex(f"index version {version}, this tier writes {INDEX_VERSION}")
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version = {INDEX_VERSION}")
        db.execute("SELECT count(*) FROM segments").fetchone()
    except BaseException:
        db.close()
        raise
    return db


def _private_dir(path: Path, *, up_to: Path) -> None:
    """Create ``path`` and every missing parent as 0700 (``mkdir(parents=True)`` gives the parents
    the default mode: ``<nvme_dir>`` and ``kv-v1`` would be 0755); tighten the existing ones below
    ``up_to``. Existing directories above it (``nvme_dir`` may be a mount point) are left alone."""
    for missing in [p for p in (*reversed(path.parents), path) if not p.exists()]:
        try:
            missing.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first: tightened below if it is ours
            continue
        os.chmod(missing, 0o700)  # exact, whatever the umask
    p = path
    while p != up_to and up_to in p.parents:
        os.chmod(p, 0o700)
        p = p.parent
