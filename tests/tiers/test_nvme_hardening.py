"""Issue 16 items 6 and 12: the NVMe index lets nobody test a guessed prompt without the keys, and
damage under the tier directory is a counted cache miss, never a failed start. Real files, real SQLite."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
from pathlib import Path

from engine.tiers.base import SegmentMeta
from engine.tiers.nvme import NvmeTier

from .conftest import chain, kv_bytes, tenant
from .test_manager import restore_all, spill

KEY = b"k" * 32


def _tier(root: Path, key: bytes = KEY, capacity: int = 1 << 20) -> NvmeTier:
    return NvmeTier(root, capacity, index_key=key)


def _meta(ns: bytes, hashes: list[bytes], sid: str) -> SegmentMeta:
    return SegmentMeta(sid, ns, "tenant-a", tuple(hashes), 64, 100, 1.0, 1.0)


def _fill(root: Path, ns: bytes, n: int = 4) -> list[bytes]:
    hs = chain(ns, n * 4)
    t = _tier(root)
    for i in range(n):
        assert t.put(_meta(ns, hs[4 * i:4 * i + 4], f"{i:032x}"), os.urandom(100)).stored
    t.close()
    return hs


def _all_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_the_index_on_disk_holds_no_namespace_and_no_block_hash(tmp_path: Path) -> None:
    ns = hashlib.sha256(b"tenant a").digest()
    root = tmp_path / "kv"
    hs = _fill(root, ns)
    disk = _all_bytes(root)
    assert ns not in disk and ns.hex().encode() not in disk
    for h in hs:  # a thief with the public tokenizer computes these for a guess: none is there
        assert h not in disk and h.hex().encode() not in disk
    # files 0600, directories 0700
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_every_directory_the_tier_creates_is_0700_and_one_it_did_not_create_is_left_alone(tmp_path: Path) -> None:
    """Audit finding 5: ``<nvme_dir>`` and ``kv-v1`` (the parents of the tier's own directory,
    created on first use) were 0755 under the usual umask; a mount point that exists keeps its mode."""
    mount = tmp_path / "mnt"
    mount.mkdir(mode=0o755)
    mount.chmod(0o755)
    old_umask = os.umask(0o022)
    try:
        _tier(mount / "nvme" / "kv-v1" / "tiny").close()
    finally:
        os.umask(old_umask)
    for d in (mount / "nvme", mount / "nvme" / "kv-v1", mount / "nvme" / "kv-v1" / "tiny"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(mount.stat().st_mode) == 0o755


def test_blocks_are_found_after_a_restart_only_with_the_same_key_and_namespace(tmp_path: Path) -> None:
    ns, other = b"n" * 32, b"o" * 32
    root = tmp_path / "kv"
    hs = _fill(root, ns)
    t = _tier(root)
    assert t.recovered_segments == 4
    assert t.contains(other, hs[0]) is None  # sealed segments answer no other namespace
    loc = t.contains(ns, hs[5])
    assert loc is not None and loc.position == 1
    got = t.get(loc.segment_id)
    assert got is not None and got[0].namespace == ns and list(got[0].hashes) == hs[4:8]
    t.check_integrity()
    t.close()
    wrong = _tier(root, key=b"x" * 32)  # another index key: nothing matches, the bytes are still counted
    assert wrong.contains(ns, hs[0]) is None and wrong.used_bytes == 400
    wrong.close()


def test_a_sealed_segment_is_deleted_with_its_tenant(tmp_path: Path) -> None:
    ns = b"n" * 32
    root = tmp_path / "kv"
    _fill(root, ns)
    t = _tier(root)
    for sid in t.segments_of(ns):
        t.evict(sid)
    assert t.used_bytes == 0 and not list(root.rglob("*.seg"))
    t.check_integrity()


def test_a_directory_and_junk_under_segments_do_not_stop_the_start(tmp_path: Path) -> None:
    ns = b"n" * 32
    root = tmp_path / "kv"
    hs = _fill(root, ns)
    (root / "segments" / "zz" / "junkdir" / "deeper").mkdir(parents=True)
    (root / "segments" / "zz" / "junkdir" / "deeper" / "f").write_bytes(b"x")
    (root / "segments" / "stray-file").write_bytes(b"x")
    (root / "segments" / "ab").mkdir(exist_ok=True)
    os.symlink("/etc/passwd", root / "segments" / "ab" / "link.seg")
    t = _tier(root)
    assert t.recovered_segments == 4 and t.damage.junk_entries == 3
    assert t.contains(ns, hs[0]) is not None
    assert not (root / "segments" / "zz" / "junkdir").exists() and not (root / "segments" / "stray-file").exists()
    assert Path("/etc/passwd").exists()
    t.check_integrity()


def test_garbage_over_the_index_header_starts_empty_and_is_counted(tmp_path: Path) -> None:
    ns = b"n" * 32
    root = tmp_path / "kv"
    hs = _fill(root, ns)
    with open(root / "index.sqlite", "r+b") as f:
        f.write(os.urandom(4096))
    t = _tier(root)
    assert t.damage.index_reset == 1 and t.recovered_segments == 0
    assert t.contains(ns, hs[0]) is None and not list(root.rglob("*.seg"))  # orphans of the lost index
    assert list(root.glob("index.sqlite.damaged-*"))
    assert t.put(_meta(ns, hs[:4], "f" * 32), os.urandom(100)).stored  # and the tier works
    t.check_integrity()


def test_impossible_rows_are_dropped_and_never_reach_a_path(tmp_path: Path) -> None:
    ns = b"n" * 32
    root = tmp_path / "kv"
    _fill(root, ns, n=1)
    victim = tmp_path / "victim.seg"
    victim.write_bytes(b"must survive")
    db = sqlite3.connect(root / "index.sqlite")
    good = db.execute("SELECT * FROM segments").fetchone()
    db.execute("INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
               ("../../victim", *good[1:]))
    db.execute("INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
               ("ab" * 16, good[1], good[2], 0, good[4], 64, 100, 1.0, 1.0, None, 0, None, None))  # hash_len 0
    db.execute("INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
               ("cd" * 16, "text", good[2], 32, "not bytes", 64, 100, 1.0, 1.0, None, 0, None, None))
    db.commit()
    db.close()
    t = _tier(root)
    assert t.recovered_segments == 1 and t.damage.bad_rows == 3
    assert victim.read_bytes() == b"must survive"
    t.check_integrity()


def test_an_index_of_the_old_raw_format_is_deleted_not_kept(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    (root / "segments").mkdir(parents=True)
    ns = b"n" * 32
    db = sqlite3.connect(root / "index.sqlite")
    db.execute("CREATE TABLE segments (id TEXT PRIMARY KEY, namespace BLOB, hashes BLOB)")
    db.execute("INSERT INTO segments VALUES ('00', ?, ?)", (ns, ns))
    db.commit()
    db.close()
    t = _tier(root)
    assert t.damage.index_reset == 0 and t.recovered_segments == 0
    assert ns not in _all_bytes(root) and not list(root.glob("index.sqlite.damaged-*"))
    t.check_integrity()


def test_a_manager_restart_after_sealing_restores_the_tenants_prefix(make_manager) -> None:
    a = tenant("a")
    hs, data = chain(a.namespace, 8), kv_bytes(8)
    m1 = make_manager(nvme_bytes=1 << 20)
    spill(m1, a, hs, data)
    m1.close()
    m2 = make_manager(nvme_bytes=1 << 20)
    match, res = restore_all(m2, a, hs)
    assert match.num_blocks == 8 and res.data == data
    assert m2.lookup(tenant("b").namespace, chain(tenant("b").namespace, 8)).num_blocks == 0


def test_a_segment_file_replaced_by_a_directory_while_serving_is_a_miss(tmp_path: Path) -> None:
    ns = b"n" * 32
    root = tmp_path / "kv"
    hs = _fill(root, ns, n=2)
    t = _tier(root)
    loc = t.contains(ns, hs[0])
    path = next(p for p in root.rglob("*.seg") if p.stem == loc.segment_id)
    path.unlink()
    (path / "inner").mkdir(parents=True)  # the file's place taken by a directory
    assert t.get(loc.segment_id) is None
    assert t.contains(ns, hs[0]) is None and t.contains(ns, hs[4]) is not None
    assert not path.exists()
    t.check_integrity()


def test_what_start_up_set_aside_is_a_metric(make_manager, registry) -> None:
    from prometheus_client import CollectorRegistry

    first = make_manager(nvme_bytes=1 << 20)
    spill(first, tenant("acme"), chain(b"ns-acme", 2), kv_bytes(2))
    first.close()
    root = first.nvme.root
    (root / "segments" / "stray-file").write_bytes(b"x")
    (root / "segments" / "zz" / "junkdir").mkdir(parents=True)
    fresh = CollectorRegistry()
    second = make_manager(nvme_bytes=1 << 20, registry=fresh)

    def damage(kind: str) -> float | None:
        return fresh.get_sample_value("prefixgate_tier_nvme_damage_total", {"kind": kind})

    assert damage("junk_entries") == 2 and damage("index_reset") == 0 and damage("bad_rows") == 0
    assert registry.get_sample_value("prefixgate_tier_nvme_damage_total", {"kind": "junk_entries"}) == 0
    second.close()
