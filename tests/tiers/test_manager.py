"""TierManager end to end on real parts: AES-256-GCM, files on disk, a SQLite index."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from engine.config import EngineConfig
from engine.tiers import InsecureNullCipher, TenantTierPolicy, TierManager, TierRates
from tests.tiers.conftest import BLOCK_BYTES, FakeClock, chain, kv_bytes, metric, tenant

SEG_BYTES = 4 * BLOCK_BYTES + 28  # a 4-block segment: plaintext + 12-byte nonce + 16-byte tag


def spill(m: TierManager, who, hashes, data):
    report = m.demote(who, hashes, data).result(timeout=30)
    m.drain(timeout=30)
    return report


def restore_all(m: TierManager, who, hashes):
    match = m.lookup(who.namespace, hashes)
    return match, m.restore(who, match).result(timeout=30)


@pytest.mark.parametrize("where", ["dram", "nvme"])
def test_round_trip_per_tier(make_manager, registry, where):
    m = make_manager(dram_bytes=1 << 20) if where == "dram" else make_manager(nvme_bytes=1 << 20)
    a = tenant("a")
    hs, data = chain(a.namespace, 10), kv_bytes(10)
    report = spill(m, a, hs, data)
    assert report.stored == {where: 10}
    match, res = restore_all(m, a, hs + chain(a.namespace, 3, seed=9))  # extra blocks are not there
    assert match.num_blocks == 10 and match.tiers == (where,) * 10
    assert res.num_blocks == 10 and res.data == data and res.blocks_by_tier == {where: 10}
    # A restore of a middle slice reads only what it needs from the segment.
    match = m.lookup(a.namespace, hs[3:7])
    assert m.restore(a, match).result().data == data[3 * BLOCK_BYTES:7 * BLOCK_BYTES]
    assert metric(registry, "prefixgate_tier_demotions_total", tier=where, tenant="a") == 10
    assert metric(registry, "prefixgate_tier_restores_total", tier=where, tenant="a") == 14
    assert metric(registry, "prefixgate_tier_restore_seconds_count", tier=where) == 2
    assert metric(registry, "prefixgate_tier_bytes_used", tier=where) > 10 * BLOCK_BYTES
    # Spilled bytes are ciphertext: the plaintext appears nowhere in the tier.
    if where == "nvme":
        files = [p for p in (m.nvme.root / "segments").rglob("*.seg")]
        assert files and all(data[:64] not in p.read_bytes() for p in files)
    m.dram.check_integrity() if m.dram else m.nvme.check_integrity()


def test_tensor_export_is_accepted_and_long_runs_are_chunked(make_manager):
    torch = pytest.importorskip("torch")
    m = make_manager(dram_bytes=1 << 20, max_segment_blocks=4)
    a = tenant("a")
    hs = chain(a.namespace, 10)
    t = torch.randint(0, 256, (10, BLOCK_BYTES), dtype=torch.uint8)  # [N, block_bytes] as exported
    spill(m, a, hs, t)
    assert m.stats()["dram"]["segments"] == 3  # 4 + 4 + 2
    _, res = restore_all(m, a, hs)
    assert torch.equal(torch.frombuffer(bytearray(res.data), dtype=torch.uint8).view(10, BLOCK_BYTES), t)
    with pytest.raises(ValueError, match="bytes"):
        m.demote(a, hs, b"short")
    # a tensor still on a device is refused before anything is queued (no host view of it exists)
    with pytest.raises(ValueError, match="CPU buffer"):
        m.demote(a, hs, torch.empty(10, BLOCK_BYTES, dtype=torch.uint8, device="meta"))
    # a non-contiguous CPU export (every other block) is read in its logical order
    two = torch.randint(0, 256, (4, BLOCK_BYTES), dtype=torch.uint8)
    hs2 = chain(a.namespace, 2, seed=7)
    spill(m, a, hs2, two[::2])
    _, res = restore_all(m, a, hs2)
    assert bytes(res.data) == two[::2].contiguous().numpy().tobytes()


def test_dram_overflow_cascades_to_nvme_and_restore_spans_both(make_manager, registry):
    m = make_manager(dram_bytes=2 * SEG_BYTES, nvme_bytes=1 << 20, max_segment_blocks=4)
    a = tenant("a")
    hs, data = chain(a.namespace, 16), kv_bytes(16)
    for k in range(4):  # evicted one 4-block run at a time, oldest first
        spill(m, a, hs[4 * k:4 * k + 4], data[4 * k * BLOCK_BYTES:(4 * k + 4) * BLOCK_BYTES])
    match, res = restore_all(m, a, hs)
    assert match.tiers == ("nvme",) * 8 + ("dram",) * 8
    assert res.num_blocks == 16 and res.data == data
    assert res.blocks_by_tier == {"nvme": 8, "dram": 8}
    assert metric(registry, "prefixgate_tier_demotions_total", tier="nvme", tenant="a") == 8
    assert metric(registry, "prefixgate_tier_drops_total", tier="dram", reason="evicted") == 0
    # Spilling blocks DRAM already holds writes nothing new.
    again = spill(m, a, hs[8:12], data[8 * BLOCK_BYTES:12 * BLOCK_BYTES])
    assert again.stored == {} and again.skipped == {"present": 4}
    m.dram.check_integrity()
    m.nvme.check_integrity()


def test_nvme_restart_recovers_blocks_and_cleans_leftovers(make_manager, tmp_path):
    cipher = tenant("a").cipher
    a = tenant("a", cipher=cipher)
    hs, data = chain(a.namespace, 8), kv_bytes(8)
    m1 = make_manager(nvme_bytes=1 << 20)
    spill(m1, a, hs, data)
    root = m1.nvme.root
    m1.close()
    # Leftovers of a crash: a half-written temp file and a segment file with no index row.
    (root / "segments" / "zz").mkdir()
    (root / "segments" / "zz" / ".deadbeef.tmp").write_bytes(b"partial")
    (root / "segments" / "zz" / "zzorphan.seg").write_bytes(b"no row")
    m2 = make_manager(nvme_bytes=1 << 20)
    assert m2.nvme.recovered_segments == 1
    match, res = restore_all(m2, a, hs)
    assert match.num_blocks == 8 and res.data == data
    assert not list((root / "segments").rglob("*.tmp")) and not list((root / "segments").rglob("zzorphan*"))
    m2.nvme.check_integrity()
    # A row whose file vanished is dropped at the next start instead of being served.
    seg_file = next((root / "segments").rglob("*.seg"))
    m2.close()
    seg_file.unlink()
    m3 = make_manager(nvme_bytes=1 << 20)
    assert m3.nvme.recovered_segments == 0 and m3.nvme.discarded_on_recovery == 1
    assert m3.lookup(a.namespace, hs).num_blocks == 0


def _only_segment(m: TierManager):
    (path,) = list((m.nvme.root / "segments").rglob("*.seg"))
    return path


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_tenant", "other_key"])
def test_bad_ciphertext_is_a_counted_miss_never_served(make_manager, registry, damage):
    m = make_manager(nvme_bytes=1 << 20)
    a = tenant("a")
    hs, data = chain(a.namespace, 4), kv_bytes(4)
    spill(m, a, hs, data)
    path = _only_segment(m)
    reader = a
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0x01
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    elif damage == "other_tenant":
        # Tenant b's blob (same size, its own key and namespace) planted under a's entry.
        b = tenant("b")
        b_stored = make_manager(dram_bytes=1 << 20, registry=None)
        spill(b_stored, b, chain(b.namespace, 4), kv_bytes(4, seed=5))
        (sid,) = list(b_stored.dram._blobs)
        path.write_bytes(bytes(b_stored.dram._blobs[sid]))
    else:  # same namespace, another data key (e.g. after key rotation or crypto-shredding)
        reader = tenant("a", cipher=tenant("x").cipher)
    match, res = restore_all(m, reader, hs)
    assert match.num_blocks == 4
    assert res.num_blocks == 0 and res.data == b""
    assert metric(registry, "prefixgate_tier_auth_failures_total", tier="nvme", tenant="a") == 1
    assert metric(registry, "prefixgate_tier_drops_total", tier="nvme", reason="auth_failure") == 4
    assert m.lookup(a.namespace, hs).num_blocks == 0  # dropped, not retried
    assert not path.exists()


def test_tampered_dram_segment_ends_the_restore_at_the_last_good_block(make_manager, registry):
    m = make_manager(dram_bytes=1 << 20, max_segment_blocks=4)
    a = tenant("a")
    hs, data = chain(a.namespace, 8), kv_bytes(8)
    spill(m, a, hs, data)
    second = m.lookup(a.namespace, hs).locations[4].segment_id
    blob = bytearray(m.dram._blobs[second])
    blob[-1] ^= 0x80  # the tag
    m.dram._blobs[second] = bytes(blob)
    _, res = restore_all(m, a, hs)
    assert res.num_blocks == 4 and res.data == data[:4 * BLOCK_BYTES]
    assert metric(registry, "prefixgate_tier_auth_failures_total", tier="dram", tenant="a") == 1


def test_namespaces_are_isolated(make_manager):
    m = make_manager(dram_bytes=1 << 20)
    a, b = tenant("a"), tenant("b")
    hs = chain(a.namespace, 4)
    spill(m, a, hs, kv_bytes(4))
    assert m.lookup(b.namespace, hs).num_blocks == 0
    with pytest.raises(ValueError, match="namespace"):
        m.restore(b, m.lookup(a.namespace, hs))


def test_tenant_without_cipher_never_spills(make_manager, registry):
    m = make_manager(dram_bytes=1 << 20, nvme_bytes=1 << 20)
    c = tenant("clear", cipher=None)
    report = spill(m, c, chain(c.namespace, 4), kv_bytes(4))
    assert report.stored == {} and report.skipped == {"no_cipher": 4}
    assert metric(registry, "prefixgate_tier_demotions_skipped_total", tier="dram", reason="no_cipher") == 4
    assert m.stats()["dram"]["used_bytes"] == 0 and not list(m.nvme.root.rglob("*.seg"))


def test_disk_too_small_skips_demotion_and_serving_continues(make_manager, registry):
    m = make_manager(dram_bytes=1 << 20, nvme_bytes=SEG_BYTES - 1, max_segment_blocks=4)
    a = tenant("a")
    # Straight to NVMe by making DRAM refuse: tenant cap of 0 bytes in DRAM.
    m.set_tenant_policy(a.namespace, TenantTierPolicy(dram_bytes=0))
    hs, data = chain(a.namespace, 4), kv_bytes(4)
    report = spill(m, a, hs, data)
    assert report.stored == {} and report.skipped == {"too_large": 8}  # refused by both tiers
    assert metric(registry, "prefixgate_tier_demotions_skipped_total", tier="nvme", reason="too_large") == 4
    assert m.lookup(a.namespace, hs).num_blocks == 0
    b = tenant("b")  # another tenant still spills to DRAM
    assert spill(m, b, chain(b.namespace, 4), kv_bytes(4)).stored == {"dram": 4}


def test_enospc_on_write_skips_demotion_leaves_nothing_and_recovers(make_manager, registry, monkeypatch):
    m = make_manager(nvme_bytes=1 << 20)
    a = tenant("a")
    real_write = os.write
    calls = {"n": 0}

    def full_disk(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:  # a partial write first, then the disk is full
            return real_write(fd, bytes(data)[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("engine.tiers.nvme.os.write", full_disk)
    hs, data = chain(a.namespace, 4), kv_bytes(4)
    report = spill(m, a, hs, data)
    assert report.skipped == {"io_error": 4}
    assert metric(registry, "prefixgate_tier_demotions_skipped_total", tier="nvme", reason="io_error") == 4
    assert not [p for p in (m.nvme.root / "segments").rglob("*") if p.is_file()]  # no temp, no partial
    assert m.lookup(a.namespace, hs).num_blocks == 0
    monkeypatch.setattr("engine.tiers.nvme.os.write", real_write)
    assert spill(m, a, hs, data).stored == {"nvme": 4}  # the disk has room again: spilling resumes
    assert restore_all(m, a, hs)[1].data == data
    m.nvme.check_integrity()


def test_quota_holds_when_one_tenant_floods(make_manager, registry):
    m = make_manager(dram_bytes=10 * SEG_BYTES, max_segment_blocks=4)
    a, b = tenant("a"), tenant("b")
    b_hs = chain(b.namespace, 12)  # b's working set: 3 segments, under its fair share of 5
    b_data = kv_bytes(12, seed=3)
    spill(m, b, b_hs, b_data)
    for k in range(30):  # a floods with 30 distinct prefixes
        spill(m, a, chain(a.namespace, 4, seed=100 + k), kv_bytes(4, seed=k))
    match, res = restore_all(m, b, b_hs)
    assert match.num_blocks == 12 and res.data == b_data  # b's working set survived intact
    by_tenant = m.stats()["dram"]["bytes_by_tenant"]
    assert by_tenant == {"a": 7 * SEG_BYTES, "b": 3 * SEG_BYTES}
    assert metric(registry, "prefixgate_tier_drops_total", tier="dram", reason="evicted") == 23 * 4
    # An explicit per-tenant cap binds below the fair share.
    m.set_tenant_policy(a.namespace, TenantTierPolicy(dram_bytes=2 * SEG_BYTES))
    spill(m, a, chain(a.namespace, 4, seed=999), kv_bytes(4))
    assert m.stats()["dram"]["bytes_by_tenant"]["a"] == 2 * SEG_BYTES
    m.dram.check_integrity()


def test_ttl_expiry_deletes_spilled_blocks(make_manager, registry):
    clock = FakeClock()
    m = make_manager(dram_bytes=1 << 20, nvme_bytes=1 << 20, clock=clock, max_segment_blocks=4,
                     default_ttl_s=3600, sweep_interval_s=1e9)  # sweeps only when called here
    a, b = tenant("a"), tenant("b")
    m.set_tenant_policy(a.namespace, TenantTierPolicy(ttl_s=10))
    a_hs, b_hs = chain(a.namespace, 8), chain(b.namespace, 8)
    spill(m, a, a_hs, kv_bytes(8))
    spill(m, b, b_hs, kv_bytes(8))
    m.dram.evict(m.lookup(a.namespace, a_hs).locations[0].segment_id)  # put one of a's segments on disk
    m.nvme.put(*_nvme_copy(m, a, a_hs[:4]))
    assert m.lookup(a.namespace, a_hs).num_blocks == 8
    clock.t += 11
    assert m.lookup(a.namespace, a_hs).num_blocks == 0  # expired: never served, even before a sweep
    assert m.lookup(b.namespace, b_hs).num_blocks == 8  # b's retention is the default hour
    assert m.sweep_expired() == 8
    assert metric(registry, "prefixgate_tier_drops_total", tier="nvme", reason="ttl") == 4
    assert not list(m.nvme.root.rglob("*.seg"))
    assert m.stats()["dram"]["bytes_by_tenant"] == {"b": 2 * SEG_BYTES}


def _nvme_copy(m: TierManager, who, hashes):
    """A segment for ``hashes`` encrypted as the manager would, expiring with who's TTL."""
    import uuid

    from engine.tiers import SegmentMeta, segment_aad

    blob = who.cipher.encrypt(kv_bytes(len(hashes)), segment_aad(who.namespace, m.model_id, hashes, BLOCK_BYTES))
    now = m._clock()
    meta = SegmentMeta(uuid.uuid4().hex, who.namespace, who.metrics_label, tuple(hashes), BLOCK_BYTES,
                       len(blob), now, now, now + m._ttl(who.namespace))
    return meta, blob


def test_short_runs_are_dropped_when_recompute_beats_a_disk_read(make_manager, registry):
    # Prefill of 16 tokens takes 1.6 ms here; an NVMe read costs 5 ms of latency alone.
    rates = TierRates(prefill_tokens_per_s=10_000, nvme_latency_s=5e-3)
    m = make_manager(nvme_bytes=1 << 20, rates=rates, max_segment_blocks=64)
    a = tenant("a")
    short = spill(m, a, chain(a.namespace, 1), kv_bytes(1))
    assert short.skipped == {"cost": 1}
    long = spill(m, a, chain(a.namespace, 8, seed=1), kv_bytes(8))  # 12.8 ms of prefill: keep
    assert long.stored == {"nvme": 8}
    assert metric(registry, "prefixgate_tier_demotions_skipped_total", tier="nvme", reason="cost") == 1


def test_concurrent_demotes_and_restores_keep_the_books(make_manager):
    m = make_manager(dram_bytes=20 * SEG_BYTES, nvme_bytes=40 * SEG_BYTES, max_segment_blocks=4, max_workers=4)
    tenants = [tenant(n) for n in "abcd"]
    errors = []

    def work(t, k):
        try:
            for i in range(10):
                hs, data = chain(t.namespace, 8, seed=k * 100 + i), kv_bytes(8, seed=i)
                m.demote(t, hs, data).result()
                res = m.restore(t, m.lookup(t.namespace, hs)).result()
                assert res.data == data[:res.num_blocks * BLOCK_BYTES]
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t, k)) for k, t in enumerate(tenants)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    m.drain()
    assert not errors
    m.dram.check_integrity()
    m.nvme.check_integrity()


def test_from_config_and_null_cipher_for_benchmarks_only(tmp_path, registry):
    cfg = EngineConfig(model_dir=tmp_path / "tiny", dram_bytes=1 << 20, nvme_dir=tmp_path / "n", nvme_bytes=1 << 20)
    m = TierManager.from_config(cfg, block_bytes=BLOCK_BYTES, registry=registry, pin_memory=False)
    try:
        assert m.nvme.root == tmp_path / "n" / "kv-v1" / "tiny"
        plain = tenant("bench", cipher=InsecureNullCipher())
        hs, data = chain(plain.namespace, 2), kv_bytes(2)
        spill(m, plain, hs, data)
        assert restore_all(m, plain, hs)[1].data == data
    finally:
        m.close()
    with pytest.raises(ValueError, match="nvme_dir"):
        TierManager(model_id="x", block_size=16, block_bytes=64, nvme_bytes=10)


def test_lookup_right_after_demote_sees_pending_blocks_and_restore_waits(make_manager, monkeypatch):
    m = make_manager(dram_bytes=1 << 20, max_workers=2)
    a = tenant("a")
    hs, data = chain(a.namespace, 4), kv_bytes(4)
    gate = threading.Event()
    real_put = m.dram.put

    def slow_put(meta, blob):
        gate.wait(10)  # the demotion is stuck until the lookup and restore are under way
        return real_put(meta, blob)

    monkeypatch.setattr(m.dram, "put", slow_put)
    m.demote(a, hs, data)
    match = m.lookup(a.namespace, hs)
    assert match.num_blocks == 4 and match.tiers == ("pending",) * 4
    fut = m.restore(a, match)
    gate.set()
    res = fut.result(timeout=30)
    assert res.num_blocks == 4 and res.data == data


@pytest.mark.gpu
def test_dram_blobs_are_pinned_on_cuda_hosts(make_manager):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    m = make_manager(dram_bytes=1 << 20, pin_memory=None)  # None = pinned when CUDA is available
    assert m.dram.pin_memory
    a = tenant("a")
    hs, data = chain(a.namespace, 6), kv_bytes(6)
    spill(m, a, hs, data)
    stats = m.dram.arena_stats()  # every blob is an extent of the tier's page-locked arena
    assert stats is not None and stats.pinned and stats.fallbacks == 0 and stats.used_bytes >= len(data)
    _, res = restore_all(m, a, hs)
    assert res.data == data
    m.dram.check_integrity()


def test_with_tenancys_cipher_and_crypto_shredding(make_manager, registry):
    """The real BlockCipher tenancy hands the engine: spill, restore, then delete the key."""
    from engine.protocol import StaticTenantScope
    from tenancy.crypto import TenantCipher, new_data_key

    cipher = TenantCipher(new_data_key(), owner="acme")
    acme = StaticTenantScope(namespace=b"ns-acme", metrics_label="acme", cipher=cipher)
    m = make_manager(nvme_bytes=1 << 20)
    hs, data = chain(acme.namespace, 6), kv_bytes(6)
    assert spill(m, acme, hs, data).stored == {"nvme": 6}
    assert restore_all(m, acme, hs)[1].data == data
    cipher.destroy()  # tenant deleted: its spilled KV is unreadable from now on
    match, res = restore_all(m, acme, hs)
    assert match.num_blocks == 6 and res.num_blocks == 0
    assert metric(registry, "prefixgate_tier_auth_failures_total", tier="nvme", tenant="acme") == 1


def test_a_tier_smaller_than_one_spill_segment_is_warned_about(caplog):
    """Spills go in segments of up to max_segment_blocks blocks; a tier that cannot hold one refuses
    most of them as too large, which start-up says instead of leaving it to the skipped counter."""
    import logging

    with caplog.at_level(logging.WARNING, logger="engine.tiers.manager"):
        small = TierManager(model_id="x", block_size=16, block_bytes=1 << 16, dram_bytes=1 << 20, pin_memory=False)
        small.close()
    assert any("dram KV tier" in r.getMessage() and "smaller than one spill segment" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.tiers.manager"):
        roomy = TierManager(model_id="x", block_size=16, block_bytes=1 << 16, dram_bytes=8 << 20, pin_memory=False)
        roomy.close()
    assert not [r for r in caplog.records if "spill segment" in r.getMessage()]
