"""Retention below HBM (#24.3): a block under a live retention leaves DRAM / NVMe only after
unretained ones, within its tenant's caps; the end of the retention ends the favour.

On the bare index (exact eviction order), on the NVMe index (persisted, migrated), and through the
real engine step loop with real DRAM and NVMe tiers (a flood through HBM -> DRAM -> NVMe).
"""

from __future__ import annotations

import random
import sqlite3

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.protocol import GenerateRequest, Retention, SamplingParams
from engine.tiers import TierHook, TierManager
from engine.tiers.base import SegmentMeta
from engine.tiers.nvme import NvmeTier
from engine.tiers.placement import SegmentIndex
from tests.tiers.conftest import tenant
from tests.tiers.kv_runner_double import TokenKVRunner


def seg(sid: str, ns: bytes, nbytes: int, last: float, retain_until: float | None = None) -> SegmentMeta:
    hashes = tuple(f"{sid}-h{i}".encode() for i in range(2))
    return SegmentMeta(sid, ns, ns.decode(), hashes, 8, nbytes, last, last, retain_until_s=retain_until)


# ---- the eviction rule ----------------------------------------------------------------------------
def test_retained_segments_go_after_every_unretained_one_whatever_their_score():
    idx = SegmentIndex(400)
    idx.add(seg("old_kept", b"A", 100, last=1, retain_until=50))  # the oldest: LRU's first victim
    idx.add(seg("a2", b"A", 100, last=2))
    idx.add(seg("a3", b"A", 100, last=3))
    idx.add(seg("a4", b"A", 100, last=4))
    assert idx.plan_room(b"A", 200, None, now_s=10) == ["a2", "a3"]
    assert idx.plan_room(b"A", 400, None, now_s=10) == ["a2", "a3", "a4", "old_kept"]  # last, not never
    # the retention is over: plain score order again
    assert idx.plan_room(b"A", 200, None, now_s=50) == ["old_kept", "a2"]
    idx.check_integrity()


def test_retention_stays_inside_the_tenants_cap_and_the_others_floor():
    idx = SegmentIndex(1000)
    idx.add(seg("b0", b"B", 100, last=0))  # B under its floor: never a candidate for A
    for i in range(4):
        idx.add(seg(f"a{i}", b"A", 100, last=10 + i, retain_until=100))
    idx.add(seg("a_plain", b"A", 100, last=20))
    # A over its own cap of 400: its unretained one first, then its own retained, never B's
    assert idx.plan_room(b"A", 200, 400, now_s=30) == ["a_plain", "a0", "a1"]
    # a newcomer C (floors of 333) may take A's retained bytes above A's floor: retention is no quota
    assert idx.plan_room(b"C", 600, None, now_s=30) == ["a_plain", "a0"]
    assert idx.plan_room(b"C", 750, None, now_s=30) == "quota"  # not below A's floor, nor B's
    idx.check_integrity()


def test_retain_extends_the_segments_holding_the_blocks_and_never_shortens():
    idx = SegmentIndex(1000)
    idx.add(seg("s", b"A", 100, last=0))
    assert idx.retain(b"A", [b"s-h1", b"nope"], 40.0) == (1, ["s"])
    assert idx.retain(b"A", [b"s-h0"], 20.0) == (1, [])
    assert idx.retain(b"B", [b"s-h0"], 90.0) == (0, [])  # another namespace finds nothing
    assert idx.segments["s"].retain_until_s == 40.0


# ---- NVMe: persisted, and an index of the previous version keeps its rows -------------------------
def _nvme(root, clock):
    return NvmeTier(root, 10_000, clock=clock, index_key=b"k" * 32)


def test_nvme_keeps_retention_across_a_restart_and_migrates_a_v2_index(tmp_path):
    now = [1000.0]
    tier = _nvme(tmp_path, lambda: now[0])
    tier.put(seg("aa" * 8, b"A", 100, last=1000.0, retain_until=5000.0), b"x" * 100)
    tier.put(seg("bb" * 8, b"A", 100, last=1000.0), b"y" * 100)
    assert tier.retain(b"A", [b"bb" * 8 + b"-h0"], 3000.0) == 1
    tier.close()
    again = _nvme(tmp_path, lambda: now[0])
    assert again.segments_of(b"A")  # unsealed by its namespace
    metas = {sid: again.get(sid)[0] for sid in again.segments_of(b"A")}
    assert {sid: m.retain_until_s for sid, m in metas.items()} == {"aa" * 8: 5000.0, "bb" * 8: 3000.0}
    again.check_integrity()
    again.close()
    # the index as version 2 wrote it: no retention (v3) nor owner (v4) column, user_version 2
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("ALTER TABLE segments DROP COLUMN retain_until_s")
    db.execute("ALTER TABLE segments DROP COLUMN owner_tag")
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()
    migrated = _nvme(tmp_path, lambda: now[0])
    assert sorted(migrated.segments_of(b"A")) == ["aa" * 8, "bb" * 8]  # rows kept, not reset
    assert migrated.damage.total == 0
    assert all(migrated.get(s)[0].retain_until_s is None for s in migrated.segments_of(b"A"))
    migrated.check_integrity()
    migrated.close()


# ---- the whole path: HBM -> DRAM -> NVMe under a flood --------------------------------------------
BS = 16


def _engine(tmp_path, registry):
    cfg = EngineConfig(model_dir=tmp_path / "double", block_size=BS, num_kv_blocks=12,
                       dram_bytes=6 * (3 * BS * 4 + 28), nvme_dir=tmp_path / "nvme",
                       nvme_bytes=6 * (3 * BS * 4 + 28), eviction_policy="cost")
    runner = TokenKVRunner(12, BS)
    # 3-block segments: the retained prefix is one segment, each flood prompt spills a few
    manager = TierManager.from_config(cfg, runner.kv_bytes_per_block, registry=registry, pin_memory=False,
                                      max_segment_blocks=3)
    hook = TierHook(manager, runner, pin_memory=False)
    return LLMEngine(cfg, runner, lower_tier=hook), hook


def _run(engine, hook, rid, who, prompt, retention=()):
    engine.add_request(GenerateRequest(request_id=rid, tenant=who, prompt_token_ids=prompt, retention=retention,
                                       sampling=SamplingParams(max_tokens=1, temperature=0.0)))
    cached = None
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                cached = out.cached_tokens
        engine.check_integrity()
    hook.manager.drain()
    assert cached is not None
    return cached


@pytest.mark.parametrize("retained", [True, False])
def test_a_retained_prefix_survives_a_flood_through_every_tier_while_unmarked_ones_go(tmp_path, registry, retained):
    engine, hook = _engine(tmp_path, registry)
    a = tenant("a")
    rng = random.Random(7)
    kept = [rng.randrange(1000, 40_000) for _ in range(3 * BS)]  # 3 full blocks: the pool's retain limit
    plain = [rng.randrange(1000, 40_000) for _ in range(3 * BS)]
    span = (Retention(len(kept), 3600.0),) if retained else ()
    _run(engine, hook, "kept", a, [*kept, 1], span)
    _run(engine, hook, "plain", a, [*plain, 2])
    # each flood prompt needs 11 of the 12 HBM blocks (retained ones too) and spills 3-block runs
    # that fill DRAM (6 segments), cascade to NVMe (6 segments) and push out of NVMe
    for k in range(12):
        _run(engine, hook, f"flood{k}", a, [rng.randrange(1000, 40_000) for _ in range(10 * BS + 5)])
    stats = hook.manager.stats()
    assert stats["dram"]["segments"] == 6 and stats["nvme"]["segments"] == 6  # both tiers full
    assert hook.manager.metrics.drops.labels("nvme", "evicted")._value.get() > 0  # and NVMe dropped blocks
    got_kept = _run(engine, hook, "kept2", a, [*kept, 3])
    got_plain = _run(engine, hook, "plain2", a, [*plain, 4])
    assert got_plain == 0  # the unmarked prefix went
    assert got_kept == (len(kept) if retained else 0)  # restored from a lower tier, all 3 blocks
    for t in hook.manager.tiers:
        t.check_integrity()
    hook.close()


def test_retention_below_hbm_ends_at_its_deadline(tmp_path, registry):
    now = [1000.0]
    manager = TierManager(model_id="m", block_size=BS, block_bytes=64, dram_bytes=3 * (64 + 28),
                          registry=registry, pin_memory=False, clock=lambda: now[0])
    a = tenant("a")
    chain_of = [bytes([i]) * 32 for i in range(4)]
    manager.demote(a, chain_of[:1], b"\0" * 64, retain_for_s=60.0)
    for h in chain_of[1:3]:
        # One at a time, a second apart: the demotion pool has several workers, so two demotions in
        # flight together land in either order, and "the oldest unretained" must be chain_of[1].
        manager.drain()
        now[0] += 1
        manager.demote(a, [h], b"\1" * 64)
    manager.drain()
    manager.demote(a, chain_of[3:], b"\2" * 64)  # full: the oldest unretained goes
    manager.drain()
    assert manager.lookup(a.namespace, chain_of[:1]).num_blocks == 1
    assert manager.lookup(a.namespace, chain_of[1:2]).num_blocks == 0
    now[0] += 61  # the retention is over: the retained block is the oldest, so next to go
    manager.demote(a, [bytes([9]) * 32], b"\3" * 64)
    manager.drain()
    assert manager.lookup(a.namespace, chain_of[:1]).num_blocks == 0
    assert manager.lookup(a.namespace, chain_of[2:3]).num_blocks == 1
    manager.close()


def test_nvme_keeps_segment_owners_across_a_restart_and_charges_v3_rows_to_their_namespace(tmp_path):
    now = [1000.0]
    tier = _nvme(tmp_path, lambda: now[0])
    owned = SegmentMeta("cc" * 8, b"A/alice", "t", (b"cc-h0",), 8, 100, 1000.0, 1000.0, owner=b"T")
    tier.put(owned, b"z" * 100)
    tier.close()
    again = _nvme(tmp_path, lambda: now[0])
    assert again.segments_of(b"A/alice") == ["cc" * 8]
    assert again._index.segments["cc" * 8].owner != b"T"  # a stand-in until T spills again
    again.put(SegmentMeta("dd" * 8, b"A/bob", "t", (b"dd-h0",), 8, 100, 1000.0, 1000.0, owner=b"T"), b"w" * 100)
    assert {m.owner for m in again._index.segments.values()} == {b"T"}
    assert again._index.usage == {b"T": 200}  # both end users' segments count against T's caps
    again.check_integrity()
    again.close()
    # the index as version 3 wrote it: no owner column; its rows are charged to their namespace
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("ALTER TABLE segments DROP COLUMN owner_tag")
    db.execute("PRAGMA user_version = 3")
    db.commit()
    db.close()
    migrated = _nvme(tmp_path, lambda: now[0])
    assert migrated.segments_of(b"A/alice") == ["cc" * 8] and migrated.damage.total == 0
    assert migrated._index.segments["cc" * 8].owner == b"A/alice"
    migrated.check_integrity()
    migrated.close()
