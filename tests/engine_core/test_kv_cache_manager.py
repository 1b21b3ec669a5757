"""The cache manager's API: admission reasons, in-flight prefixes, commit/free bookkeeping.

Exact counts throughout: the manager is torch-free and deterministic.
"""

import random
from collections import Counter

from engine_core_fakes import FakeRunner, make_request, reference_generate, scope

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_types import QueueReason
from engine.llm_engine import LLMEngine
from engine.protocol import GenerateRequest, SamplingParams

BS = 4


def test_admit_grow_commit_free_keep_exact_counts():
    cache = KVCacheManager(8, BS, eviction_policy="lru")
    a = make_request("a", range(12), block_size=BS)  # 3 full blocks
    m = cache.match(a)
    assert m.num_blocks == 0 and not m.computing
    table = cache.admit(a, m, 3)
    assert isinstance(table, list) and len(table) == 3 and cache.num_used == 3
    table[0:3] = cache.commit("a", a.tenant, table, a.block_hashes[0:3], 0)
    extra = cache.grow(a.tenant, 1)
    assert isinstance(extra, list) and cache.num_used == 4
    cache.check_integrity([table + extra])
    cache.free("a", a.tenant, table + extra)
    assert cache.num_used == 0 and cache.num_evictable == 3 and cache.num_indexed == 3
    cache.check_integrity([])
    b = make_request("b", list(range(12)) + [99], block_size=BS)
    assert cache.match(b).cached_tokens == 12  # a's committed blocks


def test_admission_reasons_quota_and_blocks_change_nothing():
    cache = KVCacheManager(4, BS)
    capped = scope("capped", kv_block_quota=2)
    r = make_request("r", range(12), tenant=capped, block_size=BS)
    assert cache.admit(r, cache.match(r), 3) is QueueReason.TENANT_OVER_QUOTA
    big = make_request("big", range(20), block_size=BS)
    assert cache.admit(big, cache.match(big), 5) is QueueReason.NO_KV_BLOCKS
    assert cache.num_used == 0
    assert cache.grow(capped, 3) is QueueReason.TENANT_OVER_QUOTA
    cache.check_integrity([])


def test_a_hit_counts_only_its_evictable_blocks_against_the_pool_and_the_quota():
    """Admission takes out of the free count the fresh blocks plus the hit's evictable ones; hit
    blocks still in use cost nothing. At each edge: exactly fits, one more does not."""
    capped = scope("capped", kv_block_quota=6)
    prompt = list(range(12))  # 3 full blocks

    def cache_with_a(free_a: bool) -> tuple[KVCacheManager, list[int]]:
        cache = KVCacheManager(8, BS, eviction_policy="lru")
        a = make_request("a", prompt, tenant=capped, block_size=BS)
        table = cache.admit(a, cache.match(a), 3)
        assert isinstance(table, list)
        table[0:3] = cache.commit("a", a.tenant, table, a.block_hashes[0:3], 0)
        if free_a:
            cache.free("a", a.tenant, table)
        return cache, table

    def admit_b(cache: KVCacheManager, n: int, tenant=capped) -> object:
        b = make_request("b", prompt + [7], tenant=tenant, block_size=BS)
        m = cache.match(b)
        assert m.num_blocks == 3
        return cache.admit(b, m, n)

    # a still holds its blocks: the hit revives none; free 5, the tenant uses 3 of its 6
    cache, _ = cache_with_a(free_a=False)
    assert isinstance(admit_b(cache, 4, scope("capped")), list) and cache.num_used == 3 + 4  # no quota: 4 <= 5 free
    cache, _ = cache_with_a(free_a=False)
    assert admit_b(cache, 6, scope("capped")) is QueueReason.NO_KV_BLOCKS and cache.num_used == 3
    cache, _ = cache_with_a(free_a=False)
    assert isinstance(admit_b(cache, 3), list) and cache.num_used == 6  # quota: 3 used + 3 new = 6
    cache, _ = cache_with_a(free_a=False)
    assert admit_b(cache, 4) is QueueReason.TENANT_OVER_QUOTA and cache.num_used == 3
    # a freed its blocks: the hit revives all 3; free 8, the tenant uses none
    cache, _ = cache_with_a(free_a=True)
    assert isinstance(admit_b(cache, 3), list) and cache.num_used == 6  # 3 revived + 3 new = 6 = quota
    cache, _ = cache_with_a(free_a=True)
    assert admit_b(cache, 4) is QueueReason.TENANT_OVER_QUOTA and cache.num_used == 0
    cache, _ = cache_with_a(free_a=True)
    assert isinstance(admit_b(cache, 5, scope("capped")), list) and cache.num_used == 8  # 3 + 5 = 8 free
    cache, _ = cache_with_a(free_a=True)
    assert admit_b(cache, 6, scope("capped")) is QueueReason.NO_KV_BLOCKS and cache.num_used == 0
    cache.check_integrity([])


def test_a_prefix_being_computed_makes_a_later_request_wait_then_hit():
    cache = KVCacheManager(32, BS)
    shared = list(range(40))  # 10 full blocks
    a = make_request("a", shared + [1, 2], block_size=BS)
    b = make_request("b", shared + [3, 4], block_size=BS)
    table_a = cache.admit(a, cache.match(a), 11)
    assert isinstance(table_a, list)
    table_a[0:4] = cache.commit("a", a.tenant, table_a, a.block_hashes[0:4], 0)  # first chunk: 4 blocks done
    mb = cache.match(b)
    assert mb.num_blocks == 4 and mb.computing  # block 4 is a's next one
    assert cache.admit(b, mb, 7) is QueueReason.PREFIX_COMPUTING
    table_a[4:10] = cache.commit("a", a.tenant, table_a, a.block_hashes[4:10], 4)
    mb = cache.match(b)
    assert mb.num_blocks == 10 and not mb.computing
    cache.check_integrity([table_a])
    # another tenant's identical tokens never wait on (or hit) a's blocks
    c = make_request("c", shared + [5], tenant=scope("other"), block_size=BS)
    mc = cache.match(c)
    assert mc.num_blocks == 0 and not mc.computing


def test_a_preempted_computer_releases_its_marks():
    cache = KVCacheManager(32, BS)
    a = make_request("a", range(40), block_size=BS)
    b = make_request("b", range(41), block_size=BS)
    table_a = cache.admit(a, cache.match(a), 10)
    assert cache.match(b).computing
    cache.free("a", a.tenant, table_a)  # preempted before committing anything
    assert not cache.match(b).computing
    cache.check_integrity([])


def _shared_prefix_batch():
    """256 requests from 8 tenants, each tenant's requests sharing a 1,500-token prefix."""
    bs = 16
    runner = FakeRunner(num_kv_blocks=2048, block_size=bs)
    config = EngineConfig(model_dir="fake", block_size=bs, max_num_batched_tokens=2048, max_num_seqs=256)
    engine = LLMEngine(config, runner)
    rng = random.Random(0)
    prefixes = {t: [rng.randrange(1, 256) for _ in range(1500)] for t in range(8)}
    prompts = {}
    for i in range(256):
        t = i % 8
        rid = f"t{t}-r{i}"
        prompts[rid] = prefixes[t] + [rng.randrange(1, 256) for _ in range(20)]
        engine.add_request(GenerateRequest(rid, scope(f"tenant-{t}"), SamplingParams(max_tokens=2, temperature=0.0),
                                           prompt_token_ids=prompts[rid]))
    finals, ids, reasons = {}, {rid: [] for rid in prompts}, Counter()
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            ids[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
        reasons.update(engine.scheduler.queue_reasons())
        engine.check_integrity()
    assert len(finals) == 256
    for rid, p in prompts.items():
        assert ids[rid] == reference_generate(p, 2), rid
    return Counter(o.cached_tokens for o in finals.values()), reasons


def test_all_warm_requests_of_a_shared_prefix_batch_hit():
    """Issue 17: one request admitted while its tenant's first one was mid-prefill recomputed the
    prefix ({0: 8, 1056: 1, 1504: 247}). Now it waits, and every warm request hits all 93 full
    prefix blocks (1,488 tokens)."""
    cached, reasons = _shared_prefix_batch()
    assert cached == {0: 8, 1488: 248}
    assert reasons[QueueReason.PREFIX_COMPUTING.value] > 0  # they really waited for the prefix
