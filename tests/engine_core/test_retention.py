"""Explicit cache control in the block pool: retained blocks outlive a flood of unmarked ones,
only go when nothing else can, stop being special at their deadline, and are bounded per tenant."""

from __future__ import annotations

import pytest
from engine_core_fakes import FakeRunner, make_request, scope

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.prefix_index import block_hashes
from engine.protocol import GenerateRequest, Retention, SamplingParams

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fill(pool: BlockPool, ns: bytes, tokens: list[int]) -> list[int]:
    hashes = block_hashes(ns, tokens, BS)
    table = pool.allocate(len(hashes), ns)
    assert table is not None
    for i, h in enumerate(hashes):
        table[i] = pool.register(table[i], h, i, table[i - 1] if i else None)
    return table


def resident(pool: BlockPool, ns: bytes, tokens: list[int]) -> int:
    return pool.index.match_hashes(block_hashes(ns, tokens, BS), len(tokens) + 1).num_blocks


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_retained_prefix_survives_a_flood_that_evicts_an_unmarked_one(policy):
    clock = FakeClock()
    pool = BlockPool(8, BS, policy, clock=clock)
    kept, plain = list(range(8)), list(range(100, 108))  # 2 blocks each
    t_kept = fill(pool, b"a", kept)
    assert pool.retain(t_kept, clock() + 3600, limit=4) == 2
    pool.free(t_kept)
    pool.free(fill(pool, b"a", plain))
    for k in range(10):  # a flood of other prompts, one block each, far more than the pool holds
        pool.free(fill(pool, b"b", [1000 + 10 * k + j for j in range(BS)]))
    assert resident(pool, b"a", kept) == 2 and resident(pool, b"a", plain) == 0
    pool.check_integrity([])
    clock.t += 3601  # retention over: an ordinary evictable prefix again
    for k in range(10):
        pool.free(fill(pool, b"b", [5000 + 10 * k + j for j in range(BS)]))
    assert resident(pool, b"a", kept) == 0
    pool.check_integrity([])


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_retention_never_makes_an_allocation_fail(policy):
    """With only retained blocks evictable, they go (tail first, demoted through the tier hook)."""
    clock = FakeClock()
    pool = BlockPool(4, BS, policy, clock=clock)
    table = fill(pool, b"a", list(range(16)))
    pool.retain(table, clock() + 60, limit=4)
    pool.free(table)
    new = pool.allocate(4, b"b")
    assert new is not None and sorted(new) == sorted(table)
    assert pool.retained_by(b"a") == 0
    pool.check_integrity([new])


def test_one_tenant_retains_at_most_its_limit():
    clock = FakeClock()
    pool = BlockPool(16, BS, "cost", clock=clock)
    table = fill(pool, b"a", list(range(8 * BS)))
    assert pool.retain(table, clock() + 60, limit=3) == 3  # the chain's head: what a later prompt shares
    assert pool.retained_by(b"a") == 3
    clock.t += 61
    assert pool.retained_by(b"a") == 0
    assert pool.retain(table, clock() + 60, limit=3) == 3  # expired retentions no longer count
    pool.free(table)


def test_retention_extends_never_shortens():
    clock = FakeClock()
    pool = BlockPool(8, BS, "lru", clock=clock)
    table = fill(pool, b"a", list(range(8)))
    pool.retain(table, clock() + 3600, limit=8)
    pool.retain(table, clock() + 300, limit=8)
    clock.t += 400
    assert pool.retained_by(b"a") == 2
    pool.free(table)


# ---------------------------------------------------------------- through the cache manager and engine


def test_manager_retain_keeps_a_span_bounded_by_a_quarter_of_the_pool():
    clock = FakeClock()
    cache = KVCacheManager(16, BS, eviction_policy="cost", clock=clock)
    a = make_request("a", range(8 * BS), tenant=scope("a"), block_size=BS)
    table = cache.admit(a, cache.match(a), 8)
    assert isinstance(table, list)
    table[:] = cache.commit("a", a.tenant, table, a.block_hashes[:8], 0)
    # a span of 5 full blocks, but without an HBM quota a tenant retains at most 16 // 4 blocks
    assert cache.retain(a.tenant, table, 8, (Retention(5 * BS + 2, 60.0),)) == 4
    assert cache.cached_blocks(b"a") == {"hbm": 8, "retained": 4}
    cache.free("a", a.tenant, table)
    clock.t += 61
    assert cache.retained_by(b"a") == 0
    cache.check_integrity([])


EBS = 8  # the engine's smallest block size


def _run(engine: LLMEngine, request: GenerateRequest) -> int:
    engine.add_request(request)
    cached = None
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                cached = out.cached_tokens
        engine.check_integrity()
    assert cached is not None
    return cached


def test_engine_retention_outlives_a_flood_that_evicts_an_unmarked_prefix():
    """The scheduler hands a request's retention spans to the cache manager when it lets the blocks go."""
    runner = FakeRunner(num_kv_blocks=16, block_size=EBS)
    config = EngineConfig(model_dir="fake", block_size=EBS, max_num_batched_tokens=256, max_num_seqs=4)
    engine = LLMEngine(config, runner)
    t = scope("t")
    kept, plain = list(range(1, 25)), list(range(30, 54))  # 3 full blocks each
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    _run(engine, GenerateRequest("kept", t, greedy, prompt_token_ids=kept + [200],
                                 retention=(Retention(len(kept), 3600.0),)))
    _run(engine, GenerateRequest("plain", t, greedy, prompt_token_ids=plain + [201]))
    assert engine.cached_blocks(b"t")["retained"] == 3
    for k in range(12):  # other prompts, far more than the 16 blocks hold
        _run(engine, GenerateRequest(f"flood{k}", t, greedy,
                                     prompt_token_ids=[60 + k, *range(100, 124)]))
    assert _run(engine, GenerateRequest("kept2", t, greedy, prompt_token_ids=kept + [202])) == len(kept)
    assert _run(engine, GenerateRequest("plain2", t, greedy, prompt_token_ids=plain + [203])) == 0
