"""The eviction rule of one tier, on the bare index (no I/O): caps, fair-share floor, score order."""

from __future__ import annotations

import pytest

from engine.tiers.base import SegmentMeta
from engine.tiers.placement import SegmentIndex


def seg(sid: str, ns: bytes, nbytes: int, last: float, hashes=None) -> SegmentMeta:
    hashes = tuple(hashes or (f"{sid}-h{i}".encode() for i in range(2)))
    return SegmentMeta(sid, ns, ns.decode(), hashes, 8, nbytes, last, last)


def test_lowest_score_goes_first_and_nothing_moves_when_room():
    idx = SegmentIndex(300)
    idx.add(seg("a1", b"A", 100, last=3))
    idx.add(seg("a2", b"A", 100, last=1))
    assert idx.plan_room(b"A", 100, None, now_s=10) == []
    idx.add(seg("a3", b"A", 100, last=2))
    assert idx.plan_room(b"A", 150, None, now_s=10) == ["a2", "a3"]  # LRU order, just enough
    assert idx.plan_room(b"A", 301, None, now_s=10) == "too_large"
    idx.check_integrity()


def test_flooding_tenant_cannot_push_another_below_its_fair_share():
    idx = SegmentIndex(1000)
    for i in range(3):  # B's working set: 300 bytes, under its fair share of 500
        idx.add(seg(f"b{i}", b"B", 100, last=i))
    for i in range(7):  # A fills the rest, and its entries are all newer than B's
        idx.add(seg(f"a{i}", b"A", 100, last=100 + i))
    # A wants more room: B's older entries are not candidates, A's own oldest go.
    assert idx.plan_room(b"A", 200, None, now_s=200) == ["a0", "a1"]
    # A newcomer C (floor 333) may take from A (700 > 333) but not from B (300 <= 333).
    assert idx.plan_room(b"C", 300, None, now_s=200) == ["a0", "a1", "a2"]


def test_tenant_over_its_own_cap_evicts_only_its_own():
    idx = SegmentIndex(1000)
    idx.add(seg("b0", b"B", 100, last=0))
    idx.add(seg("a0", b"A", 100, last=5))
    idx.add(seg("a1", b"A", 100, last=6))
    assert idx.plan_room(b"A", 100, 250, now_s=10) == ["a0"]  # cap 250: 300 -> 200 + 100
    assert idx.plan_room(b"A", 300, 250, now_s=10) == "too_large"


def test_tenant_over_its_block_quota_gives_up_its_own_oldest_blocks():
    """``kv_block_quota_dram`` / ``_nvme`` count blocks, not bytes: room in bytes is not enough."""
    idx = SegmentIndex(10_000)
    idx.add(seg("b0", b"B", 100, last=0))  # 2 blocks each
    idx.add(seg("a0", b"A", 100, last=5))
    idx.add(seg("a1", b"A", 100, last=6))
    assert idx.plan_room(b"A", 50, None, now_s=10, need_blocks=1, tenant_cap_blocks=5) == []
    assert idx.plan_room(b"A", 50, None, now_s=10, need_blocks=2, tenant_cap_blocks=5) == ["a0"]
    assert idx.plan_room(b"A", 50, None, now_s=10, need_blocks=4, tenant_cap_blocks=4) == ["a0", "a1"]
    assert idx.plan_room(b"A", 50, None, now_s=10, need_blocks=5, tenant_cap_blocks=4) == "too_large"
    assert idx.block_usage == {b"A": 4, b"B": 2}
    idx.check_integrity()


def test_a_tenant_may_always_replace_its_own_entries():
    idx = SegmentIndex(400)
    for name in (b"B", b"C", b"D", b"E"):  # four tenants at exactly their floor (100)
        idx.add(seg(name.decode(), name, 100, last=0))
    assert idx.plan_room(b"B", 100, None, now_s=1) == ["B"]  # nobody else is over its floor
    assert idx.plan_room(b"B", 200, None, now_s=1) == "quota"  # and others' floor is untouchable


def test_newest_wins_and_fully_shadowed_segment_is_reported():
    idx = SegmentIndex(1000)
    idx.add(seg("old", b"A", 100, last=0, hashes=[b"h1", b"h2"]))
    assert idx.add(seg("mid", b"A", 100, last=1, hashes=[b"h2", b"h3"])) == []
    assert idx.lookup(b"A", b"h1", 0).segment_id == "old"
    assert idx.lookup(b"A", b"h2", 0).segment_id == "mid"
    assert idx.add(seg("new", b"A", 100, last=2, hashes=[b"h1"])) == ["old"]
    idx.remove("old")
    idx.check_integrity()
    assert idx.lookup(b"B", b"h1", 0) is None  # namespaces never share an entry


def test_integrity_check_catches_corruption():
    idx = SegmentIndex(1000)
    idx.add(seg("a", b"A", 100, last=0))
    idx.used_bytes += 1
    with pytest.raises(AssertionError):
        idx.check_integrity()


def owned(sid: str, ns: bytes, owner: bytes, nbytes: int, last: float) -> SegmentMeta:
    return SegmentMeta(sid, ns, owner.decode(), (f"{sid}-h0".encode(),), 8, nbytes, last, last, owner=owner)


def test_caps_and_floors_count_by_owner_not_by_namespace():
    idx = SegmentIndex(1000)
    # tenant T's two end users (two namespaces) share T's block cap of 2: the third block is over it
    idx.add(owned("u1", b"T/alice", b"T", 100, last=1))
    idx.add(owned("u2", b"T/bob", b"T", 100, last=2))
    assert idx.plan_room(b"T", 100, None, now_s=10, need_blocks=1, tenant_cap_blocks=2) == ["u1"]
    # two tenants of one namespace (a share group) each have their own cap: G2 is not over G1's
    idx.add(owned("g1", b"group", b"G1", 100, last=3))
    idx.add(owned("g1b", b"group", b"G1", 100, last=4))
    assert idx.plan_room(b"G2", 100, None, now_s=10, need_blocks=1, tenant_cap_blocks=2) == []
    # one floor per owner: 3 owners with data + newcomer N -> floor 250; T (200) and G1 (200) are
    # under it, so N cannot evict them even though their namespaces are many
    idx.add(owned("x", b"X", b"X", 500, last=0))
    assert idx.plan_room(b"N", 300, None, now_s=10) == ["x"]
    idx.rekey_owner("x", b"T")
    assert idx.usage[b"T"] == 700 and b"X" not in idx.usage
    idx.check_integrity()
