"""The engine-side numbers the break-even needs: cache-management time per phase and prefill accounting.

Uses the engine-core team's deterministic fake runner, so token counts are exact; times are only
checked for presence (> 0 where work happened, 0 where none can have), never for speed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from engine.config import EngineConfig
from engine.kv_types import CachePhase
from engine.llm_engine import LLMEngine
from engine.metrics import CACHE_PHASES, CacheTimer, EngineMetrics
from engine.protocol import GenerateRequest, SamplingParams
from gateway.bench.replay import msum, parse_metrics
from tests.engine_core.engine_core_fakes import FakeRunner, scope

BS = 8
PROMPT = list(range(1, 33))  # 32 tokens = 4 full blocks


def _run(caching: bool, num_blocks: int = 64) -> tuple[LLMEngine, CollectorRegistry]:
    registry = CollectorRegistry()
    runner = FakeRunner(num_kv_blocks=num_blocks, block_size=BS)
    config = EngineConfig(model_dir="fake", block_size=BS, max_num_batched_tokens=64, enable_prefix_caching=caching)
    engine = LLMEngine(config, runner, EngineMetrics(registry))
    for rid in ("a", "b"):  # one after the other: b can reuse a's blocks
        engine.add_request(GenerateRequest(rid, scope(), SamplingParams(max_tokens=2, temperature=0.0),
                                           prompt_token_ids=PROMPT))
        while engine.has_unfinished():
            engine.step()
    return engine, registry


def test_prefill_and_decode_tokens_are_counted_exactly_and_hits_skip_prefill():
    on, reg_on = _run(caching=True)
    off, reg_off = _run(caching=False)
    # a computes 32 prompt tokens; b hits 3 blocks (the last prompt token is always computed)
    assert on.stats()["prompt_tokens_hit"] == 24
    assert on.prefill_tokens == 32 + 8 and off.prefill_tokens == 64
    assert on.decode_tokens == off.decode_tokens == 2  # second output token of each request
    assert on.prefill_time_s > 0 and on.execute_time_s >= on.prefill_time_s
    snap = parse_metrics(generate_latest(reg_on).decode())
    assert msum(snap, "prefixgate_prefill_tokens_total") == 40
    assert msum(snap, "prefixgate_decode_tokens_total") == 2
    assert msum(snap, "prefixgate_kv_block_size") == BS
    assert msum(snap, "prefixgate_prefill_seconds_total") == on.prefill_time_s


def test_cache_phases_are_timed_and_exported():
    on, reg_on = _run(caching=True)
    off, _ = _run(caching=False)
    stats = on.stats()
    assert set(stats["cache_time_s"]) == set(CACHE_PHASES)
    assert on.cache_time_s["hash"] > 0 and on.cache_time_s["match"] > 0 and on.cache_time_s["register"] > 0
    assert on.cache_time_s["evict"] == 0 and on.cache_time_s["tier"] == 0  # nothing evicted, no tier hook
    assert off.cache_time_s["match"] == 0  # the scheduler never looks up with caching off
    assert off.cache_time_s["hash"] > 0  # ... but every request is still hashed
    snap = parse_metrics(generate_latest(reg_on).decode())
    for phase in CACHE_PHASES:
        assert msum(snap, "prefixgate_cache_manage_seconds_total", phase=phase) == on.cache_time_s[phase]


def test_eviction_is_timed_when_the_pool_is_full():
    registry = CollectorRegistry()
    runner = FakeRunner(num_kv_blocks=6, block_size=BS)
    config = EngineConfig(model_dir="fake", block_size=BS, max_num_batched_tokens=64)
    engine = LLMEngine(config, runner, EngineMetrics(registry))
    for rid, first in (("a", 1), ("b", 100)):  # different prompts: b evicts a's cached blocks
        engine.add_request(GenerateRequest(rid, scope(), SamplingParams(max_tokens=2, temperature=0.0),
                                           prompt_token_ids=list(range(first, first + 32))))
        while engine.has_unfinished():
            engine.step()
    assert engine.cache.num_evictions > 0 and engine.cache_time_s["evict"] > 0


def test_tier_time_excludes_the_pool_work_it_does_so_phases_sum_once():
    """The cache manager's tier work looks up, evicts and registers, which are timed into their own
    phases: "tier" must not count those seconds again (the break-even sums all phases). A fake
    clock makes the seconds exact."""
    now = [0.0]
    timer = CacheTimer(clock=lambda: now[0])
    with timer.phase(CachePhase.TIER):
        with timer.phase(CachePhase.MATCH):
            now[0] += 3.0  # 3 s of prefix matching
        now[0] += 1.0  # 1 s of the tier's own work
    assert timer.seconds()[CachePhase.MATCH] == 3.0
    assert timer.seconds()[CachePhase.TIER] == 1.0
