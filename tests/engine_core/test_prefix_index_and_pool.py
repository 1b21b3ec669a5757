"""Prefix hashing, the block pool's free queue, eviction order and integrity checking."""

import hashlib
from array import array

import pytest

from engine.block_pool import BlockPool, IntegrityError
from engine.eviction import Block, CostPolicy, FreeBlockQueue
from engine.kv_types import EvictedBlock
from engine.prefix_index import BlockHash, PrefixIndex, block_hashes, extend_block_hashes, packed_block_hashes

BS = 4


def test_hash_chain_definition_and_namespace_seed():
    toks = list(range(8))
    hashes = block_hashes(b"ns", toks, BS)
    h0 = hashlib.sha256(b"ns" + array("q", toks[:4]).tobytes()).digest()
    h1 = hashlib.sha256(h0 + array("q", toks[4:]).tobytes()).digest()
    assert hashes == [h0, h1]
    assert block_hashes(b"other", toks, BS)[0] != h0
    # only full blocks are hashed
    assert len(block_hashes(b"ns", toks + [1, 2, 3], BS)) == 2


def test_incremental_hashes_equal_full_hashes():
    toks = list(range(23))
    inc: list[BlockHash] = []
    for n in range(1, len(toks) + 1):
        extend_block_hashes(b"ns", toks[:n], BS, inc)
    assert inc == block_hashes(b"ns", toks, BS)
    assert extend_block_hashes(b"ns", toks, BS, inc) == 0


def test_hashes_of_packed_ids_equal_the_hashes_of_the_ids():
    import random

    rng = random.Random(4)
    for n in (0, 3, 4, 17, 64, 513):
        toks = [rng.randrange(-(2**40), 2**40) for _ in range(n)]
        for bs in (1, 4, 16):
            assert packed_block_hashes(b"ns", array("q", toks).tobytes(), bs) == block_hashes(b"ns", toks, bs)
    with pytest.raises(ValueError, match="multiple of 8"):
        packed_block_hashes(b"ns", b"\x00" * 12, BS)


def test_match_never_covers_the_last_token_and_stops_at_first_miss():
    idx = PrefixIndex(BS)
    toks = list(range(12))
    for i, h in enumerate(block_hashes(b"ns", toks, BS)):
        idx.insert(h, 100 + i)
    m = idx.match(b"ns", toks)  # 12 tokens = 3 full blocks, but the last token must be computed
    assert m.block_ids == (100, 101) and m.cached_tokens == 8
    assert idx.match(b"ns", toks + [99]).cached_tokens == 12
    assert idx.match(b"other", toks + [99]).cached_tokens == 0
    changed = toks[:5] + [777] + toks[6:] + [1]
    assert idx.match(b"ns", changed).block_ids == (100,)
    assert not idx.insert(block_hashes(b"ns", toks, BS)[0], 5)


def test_free_block_queue_is_linked_both_ways():
    q = FreeBlockQueue()
    blocks = [Block(i) for i in range(5)]
    for b in blocks:
        q.append(b)
    q.remove(blocks[2])
    assert [b.block_id for b in q.check()] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q.check()] == [1, 3, 4, 2]
    with pytest.raises(AssertionError):
        q.append(blocks[3])  # already queued


def fill(pool: BlockPool, ns: bytes, tokens: list[int]) -> list[int]:
    """Allocate and index the full blocks of ``tokens`` as a request would; returns the table."""
    hashes = block_hashes(ns, tokens, BS)
    table = pool.allocate(len(hashes), ns)
    assert table is not None
    for i, h in enumerate(hashes):
        table[i] = pool.register(table[i], h, i, table[i - 1] if i else None)
    return table


def test_allocate_free_counts_and_reuse_of_uncached_first():
    pool = BlockPool(6, BS, "lru")
    a = pool.allocate(4, b"x")
    assert a == [0, 1, 2, 3] and pool.num_free == 2 and pool.used_by(b"x") == 4
    assert pool.allocate(3, b"x") is None and pool.num_free == 2  # all-or-nothing
    pool.free(a)
    assert pool.num_free == 6 and pool.num_used == 0 and pool.used_by(b"x") == 0
    pool.check_integrity([])
    with pytest.raises(ValueError, match="double free"):
        pool.free([0])


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_tail_blocks_are_evicted_before_their_parents(policy):
    pool = BlockPool(4, BS, policy)
    table = fill(pool, b"x", list(range(16)))  # 4 blocks, chain 0 <- 1 <- 2 <- 3
    pool.free(table)
    assert pool.num_evictable == 4 and pool.num_free == 4
    order = [pool.allocate(1, b"y")[0] for _ in range(4)]
    assert order == [table[3], table[2], table[1], table[0]]
    assert pool.num_evictions == 4 and len(pool.index) == 0


def test_cost_and_lru_pick_different_victims():
    """Chain A (2 blocks) was used by 3 requests long ago; chain B (2 blocks) once, recently.
    LRU evicts A's tail (older); cost keeps A (reused more) and evicts B's tail."""
    victims = {}
    for policy in ("lru", "cost"):
        pool = BlockPool(5, BS, policy)
        a = fill(pool, b"x", list(range(8)))
        pool.touch(a, b"x")
        pool.touch(a, b"x")  # two more requests hit chain A
        pool.free(a)
        pool.free(a)
        pool.free(a)
        b = fill(pool, b"x", list(range(100, 108)))
        pool.free(b)
        tables = {"a": a, "b": b}
        victim = pool.allocate(2, b"y")  # one uncached block, then one eviction
        victims[policy] = [name for name, t in tables.items() if victim[1] == t[1]]
        pool.check_integrity([victim])
    assert victims == {"lru": ["a"], "cost": ["b"]}


def test_cost_policy_keeps_the_deeper_block_at_equal_reuse():
    pool = BlockPool(8, BS, "cost")
    long = fill(pool, b"x", list(range(20)))  # 5 blocks
    short = fill(pool, b"x", list(range(50, 54)))  # 1 block, depth 0
    pool.free(short)  # released first: LRU would evict the long chain's tail first only if older
    pool.free(long)
    assert pool.allocate(3, b"y")[2] == short[0]  # 2 uncached, then the cheap shallow block
    policy = pool.policy
    assert isinstance(policy, CostPolicy)
    assert policy.recompute_cost(10) > policy.recompute_cost(0)


def test_prefix_hit_revives_evictable_blocks_and_register_adopts_duplicates():
    pool = BlockPool(8, BS, "cost")
    toks = list(range(8))
    a = fill(pool, b"x", toks)
    pool.free(a)
    assert pool.num_evictable == 2
    m = pool.index.match(b"x", toks + [1])
    assert m.block_ids == tuple(a)
    pool.touch(m.block_ids, b"x")
    assert pool.num_evictable == 0 and pool.used_by(b"x") == 2
    # a second request computed the same prefix into its own blocks: they collapse onto a
    dup = pool.allocate(2, b"x")
    h = block_hashes(b"x", toks, BS)
    assert pool.register(dup[0], h[0], 0, None) == a[0]
    assert pool.register(dup[1], h[1], 1, a[0]) == a[1]
    pool.check_integrity([a, a])
    assert pool.num_used == 2
    with pytest.raises(ValueError, match="namespace"):
        pool.touch([a[0]], b"other")


def test_two_namespaces_never_share_a_block():
    pool = BlockPool(8, BS, "lru")
    toks = list(range(9))
    a = fill(pool, b"tenant-a", toks)
    assert pool.index.match(b"tenant-b", toks).cached_tokens == 0
    assert pool.index.match(b"tenant-a", toks).cached_tokens == 8
    b = fill(pool, b"tenant-b", toks)
    assert set(a).isdisjoint(b)
    assert pool.indexed_by(b"tenant-a") == 2 and pool.indexed_by(b"tenant-b") == 2


def test_on_evict_sees_each_eviction_before_reuse():
    seen: list[EvictedBlock] = []

    def on_evict(block: EvictedBlock) -> None:
        assert pool.blocks[block.block_id].block_hash == block.block_hash  # still intact
        seen.append(block)

    pool = BlockPool(2, BS, "lru", on_evict=on_evict)
    a = fill(pool, b"x", list(range(8)))
    pool.free(a)
    pool.allocate(1, b"y")
    assert seen == [EvictedBlock(block_hashes(b"x", list(range(8)), BS)[1], b"x", 1, a[1], holder=b"x")]


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(4, BS, "cost", enable_caching=False)
    a = fill(pool, b"x", list(range(8)))
    assert len(pool.index) == 0
    pool.free(a)
    assert pool.num_evictable == 0 and pool.num_free == 4
    pool.check_integrity([])


def test_check_integrity_catches_corruption():
    pool = BlockPool(4, BS, "lru")
    a = fill(pool, b"x", list(range(8)))
    pool.check_integrity([a])
    with pytest.raises(IntegrityError, match="ref_cnt"):
        pool.check_integrity([])  # the caller reports no holder
    pool.blocks[a[0]].ref_cnt += 1
    with pytest.raises(IntegrityError):
        pool.check_integrity([a])
    pool.blocks[a[0]].ref_cnt -= 1
    pool.blocks[a[1]].num_children = 3
    with pytest.raises(IntegrityError, match="num_children"):
        pool.check_integrity([a])
    pool.blocks[a[1]].num_children = 0
    pool.index._blocks[pool.blocks[a[1]].block_hash] = a[0]
    with pytest.raises(IntegrityError, match="holds another"):
        pool.check_integrity([a])


def test_cost_policy_heap_stays_bounded_under_hits_without_evictions():
    """Every free pushes a heap entry and every hit leaves it stale; with no memory pressure nothing
    is ever popped, so stale entries must be dropped some other way or the heap grows forever."""
    pool = BlockPool(4, BS, eviction_policy="cost")
    toks = list(range(2 * BS + 1))
    hashes = block_hashes(b"ns", toks, BS)
    table = pool.allocate(2, b"ns")
    assert table is not None
    pool.register(table[0], hashes[0], 0, None)
    pool.register(table[1], hashes[1], 1, table[0])
    pool.free(table)
    for _ in range(10_000):  # the same prefix hit and released again and again
        pool.touch(table, b"ns")
        pool.free(table)
    policy = pool.policy
    assert isinstance(policy, CostPolicy)
    assert len(policy._heap) <= 4 * max(len(policy), 64)
    pool.check_integrity([])
    assert pool.allocate(4, b"other") is not None and pool.num_evictions == 2  # still evicts both


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_packed_chain_equals_the_block_by_block_reference(block_size):
    """extend_block_hashes packs all new blocks at once and hashes slices of the bytes: each hash
    must equal hash_block's (the per-block definition) for every resume point and tail length."""
    import random

    from engine.prefix_index import hash_block

    rng = random.Random(block_size)
    toks = [rng.randrange(-(2**63), 2**63) if i % 7 == 0 else rng.randrange(200_000) for i in range(5 * block_size + 3)]
    ref: list[bytes] = []
    parent = b"tenant-ns"
    for i in range(len(toks) // block_size):
        parent = hash_block(parent, toks[i * block_size : (i + 1) * block_size])
        ref.append(parent)
    for resume in range(len(ref) + 1):
        got: list[BlockHash] = list(ref[:resume])  # blocks hashed before, as a request keeps them
        assert extend_block_hashes(b"tenant-ns", toks, block_size, got) == len(ref) - resume
        assert got == ref


def test_free_and_touch_keep_per_namespace_use_exact_when_they_fail_midway():
    """free and touch update the namespace's use once per call: a call that raises half-way must
    still count exactly the blocks it changed (check_integrity compares with the refcounts)."""
    pool = BlockPool(8, BS)
    a = pool.allocate(3, b"a")
    b = pool.allocate(1, b"b")
    assert a is not None and b is not None
    parent = None
    for i, h in enumerate(block_hashes(b"a", list(range(3 * BS)), BS)):
        parent = pool.register(a[i], h, i, parent)
    pool.free(a)
    with pytest.raises(ValueError):
        pool.touch([a[0], a[1], b[0]], b"a")  # b[0] is not an indexed block of namespace a
    assert pool.used_by(b"a") == 2
    pool.check_integrity([[a[0], a[1]], b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[2], a[0], a[1]])  # freed in reverse: a[1], a[0], then a[2] is not held
    assert pool.used_by(b"a") == 0 and pool.used_by(b"b") == 1
    pool.check_integrity([b])
