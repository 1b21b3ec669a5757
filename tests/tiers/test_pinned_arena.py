"""The DRAM tier's page-locked arena: extents never overlap while any view of them lives, come back
(coalesced) when the last one dies, and a request no extent holds falls back and is counted."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch

from engine.kv_types import BlockHash
from engine.tiers.base import SegmentMeta
from engine.tiers.dram import DramTier, PinnedBlob
from engine.tiers.pinned_arena import ALIGN, PinnedArena


def span(a: np.ndarray) -> tuple[int, int]:
    return a.ctypes.data, a.ctypes.data + a.nbytes


def test_extents_come_back_coalesced_when_their_arrays_die():
    arena = PinnedArena(64 * ALIGN, pin=False)
    parts = [arena.allocate(7 * ALIGN + 1) for _ in range(7)]  # 8 aligned units each: 56 of 64
    assert arena.stats().used_bytes == 7 * 8 * ALIGN
    del parts[1], parts[3]  # two holes, not adjacent
    gc.collect()
    assert arena.stats().used_bytes == 5 * 8 * ALIGN
    parts.clear()
    gc.collect()
    s = arena.stats()
    assert s.used_bytes == 0 and s.fallbacks == 0
    whole = arena.allocate(64 * ALIGN)  # only possible if every extent merged back into one
    assert arena.stats().fallbacks == 0 and whole.nbytes == 64 * ALIGN


def test_an_extent_is_not_handed_out_while_a_view_of_it_lives():
    arena = PinnedArena(4 * ALIGN, pin=False)
    a = arena.allocate(4 * ALIGN)
    a[:] = 0xAB
    mv = memoryview(a).toreadonly()
    t = torch.frombuffer(mv, dtype=torch.uint8)[10:20]  # what a restore's H2D copy reads from
    del a, mv
    gc.collect()
    b = arena.allocate(ALIGN)
    assert arena.stats().fallbacks == 1  # the whole arena is still held by `t`
    b[:] = 0
    assert bool((t == 0xAB).all())
    del t
    gc.collect()
    arena.allocate(4 * ALIGN)
    assert arena.stats().fallbacks == 1


def test_a_request_larger_than_any_free_extent_falls_back_and_is_counted():
    arena = PinnedArena(8 * ALIGN, pin=False)
    keep = arena.allocate(5 * ALIGN)
    other = arena.allocate(4 * ALIGN)  # 4 units: only 3 are free
    assert other.nbytes == 4 * ALIGN and arena.stats().fallbacks == 1
    other[:] = 1  # a usable array all the same
    assert keep.nbytes == 5 * ALIGN


def test_random_allocations_never_overlap_and_account_exactly():
    rng = random.Random(7)
    arena = PinnedArena(256 * ALIGN, pin=False)
    base, end = span(np.frombuffer(arena._map, dtype=np.uint8))  # noqa: SLF001 - the test checks placement
    live: list[np.ndarray] = []
    for _ in range(2_000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))
        else:
            live.append(arena.allocate(rng.randrange(1, 24 * ALIGN)))
        inside = sorted(span(a) for a in live if base <= a.ctypes.data < end)
        assert all(x[1] <= y[0] for x, y in zip(inside, inside[1:], strict=False))
        units = sum(-(-(e - s) // ALIGN) * ALIGN for s, e in inside)
        assert arena.stats().used_bytes == units
    live.clear()
    gc.collect()
    assert arena.stats().used_bytes == 0
    whole = arena.allocate(256 * ALIGN)
    assert span(whole) == (base, end)
    before = arena.stats().fallbacks
    extra = arena.allocate(1)
    assert not base <= extra.ctypes.data < end and arena.stats().fallbacks == before + 1


def test_the_dram_tier_keeps_pinned_blobs_in_its_arena_and_frees_them_on_eviction():
    # no CUDA here: an arena in plain memory, the same code path; the slack holds the blob a put
    # copies in before it evicts
    tier = DramTier(4 * 1024, pin_memory=True, arena_slack_bytes=1024)
    stats = tier.arena_stats()
    assert stats is not None and stats.used_bytes == 0
    blobs = {}
    for i in range(6):  # 6 x 1 KiB into 4 KiB: the two oldest are evicted
        data = bytes([i]) * 1024
        meta = SegmentMeta(f"s{i}", b"ns", "t", (BlockHash(bytes([i]) * 32),), 1024, 1024, 0.0, 0.0, None)
        assert tier.put(meta, data).stored
        blobs[f"s{i}"] = data
    gc.collect()
    s = tier.arena_stats()
    assert s is not None and s.used_bytes == 4 * 1024 and s.fallbacks == 0
    for sid in ("s2", "s3", "s4", "s5"):
        got = tier.get(sid)
        assert got is not None and bytes(got[1]) == blobs[sid]


def test_a_sealer_blob_adopts_an_arena_array():
    arena = PinnedArena(8 * ALIGN, pin=False)
    host = arena.allocate(3 * ALIGN)
    torch.from_numpy(host).fill_(5)  # the sealer's D2H writes through a tensor over the array
    blob = PinnedBlob.adopt(host)
    del host
    assert len(blob) == 3 * ALIGN and set(bytes(blob.view())) == {5}
    with pytest.raises(ValueError):
        PinnedBlob.adopt(np.zeros((2, 2), dtype=np.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: page-locking through the driver")
def test_the_arena_is_page_locked_on_a_cuda_host():
    arena = PinnedArena(1 << 20, pin=True)
    assert arena.pinned
    host = arena.allocate(4096)
    assert torch.from_numpy(host).is_pinned()  # so a non_blocking D2H into it is a real DMA
    dev = torch.arange(4096, device="cuda", dtype=torch.int32).to(torch.uint8)
    torch.from_numpy(host).copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert bytes(host) == bytes(dev.cpu().numpy())
