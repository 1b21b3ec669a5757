"""The tiers inside the engine's step loop: evicted prefixes come back from DRAM / NVMe.

Uses the real block pool, scheduler and step loop with a runner double whose KV holds token ids
(``kv_runner_double``): a wrongly restored block changes the output or raises.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine.config import EngineConfig
from engine.kv_types import LowerTier, TierName
from engine.llm_engine import LLMEngine
from engine.protocol import GenerateRequest, SamplingParams
from engine.tiers import TierHook, TierManager
from tests.tiers.conftest import metric, tenant
from tests.tiers.kv_runner_double import TokenKVRunner, reference_generate

BS = 16


def build(tmp_path, registry, *, dram_bytes=0, nvme_bytes=0, num_blocks=12):
    cfg = EngineConfig(model_dir=tmp_path / "double", block_size=BS, num_kv_blocks=num_blocks,
                       dram_bytes=dram_bytes, nvme_dir=tmp_path / "nvme" if nvme_bytes else None,
                       nvme_bytes=nvme_bytes, eviction_policy="lru")
    runner = TokenKVRunner(num_blocks, BS)
    manager = TierManager.from_config(cfg, runner.kv_bytes_per_block, registry=registry, pin_memory=False)
    hook = TierHook(manager, runner, pin_memory=False)
    return LLMEngine(cfg, runner, lower_tier=hook), hook


def run(engine, rid, who, prompt, max_tokens=4):
    engine.add_request(GenerateRequest(request_id=rid, tenant=who, prompt_token_ids=prompt,
                                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    outs, reasons = [], set()
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        outs += engine.step()
        engine.check_integrity()
        reasons |= set(engine.scheduler.queue_reasons())
    final = outs[-1]
    assert final.finished and final.finish_reason == "length"
    return [t for o in outs for t in o.new_token_ids], final.cached_tokens, reasons


@pytest.mark.parametrize("where", ["dram", "nvme"])
def test_evicted_prefix_is_restored_with_identical_output(tmp_path, registry, where):
    sizes = {"dram_bytes": 1 << 20} if where == "dram" else {"nvme_bytes": 1 << 20}
    engine, hook = build(tmp_path, registry, **sizes)
    a = tenant("a")
    rng = random.Random(0)
    p = [rng.randrange(1000, 40_000) for _ in range(100)]  # 6 cacheable full blocks
    q = [rng.randrange(1000, 40_000) for _ in range(170)]  # needs 11 of the 12 blocks
    assert isinstance(hook, LowerTier)  # the engine-side Protocol, structurally
    cold, cached, _ = run(engine, "p1", a, p)
    assert cold == reference_generate(p, 4) and cached == 0
    run(engine, "q", a, q)  # pushes p's tail out of HBM
    hook.manager.drain()
    assert engine.runner.exported >= 5
    warm, cached, reasons = run(engine, "p2", a, p)
    assert warm == cold
    assert cached == 96  # 1 block still in HBM + 5 restored from the tier
    assert engine.runner.imported == 5
    assert metric(registry, "prefixgate_tier_restores_total", tier=where, tenant="a") == 5
    assert engine.cache.num_used == 0  # the restored prefix is held by nobody once p2 is done
    engine.check_integrity()
    hook.close()


def test_tenant_without_cipher_recomputes(tmp_path, registry):
    engine, hook = build(tmp_path, registry, dram_bytes=1 << 20)
    clear = tenant("clear", cipher=None)
    rng = random.Random(1)
    p = [rng.randrange(1000, 40_000) for _ in range(100)]
    cold, _, _ = run(engine, "p1", clear, p)
    run(engine, "q", clear, [rng.randrange(1000, 40_000) for _ in range(170)])
    warm, cached, reasons = run(engine, "p2", clear, p)
    assert warm == cold and cached == 16 and "restoring" not in reasons
    assert engine.runner.imported == 0 and engine.runner.exported == 0  # never even copied out of HBM
    assert metric(registry, "prefixgate_tier_demotions_skipped_total", tier="dram", reason="no_cipher") >= 5
    hook.close()


def test_tampered_tier_block_is_recomputed_not_served(tmp_path, registry):
    engine, hook = build(tmp_path, registry, nvme_bytes=1 << 20)
    a = tenant("a")
    rng = random.Random(2)
    p = [rng.randrange(1000, 40_000) for _ in range(100)]
    cold, _, _ = run(engine, "p1", a, p)
    run(engine, "q", a, [rng.randrange(1000, 40_000) for _ in range(170)])
    hook.manager.drain()
    for f in hook.manager.nvme.root.rglob("*.seg"):
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    warm, cached, _ = run(engine, "p2", a, p)
    assert warm == cold and cached == 16  # only the block HBM still had
    assert metric(registry, "prefixgate_tier_auth_failures_total", tier="nvme", tenant="a") >= 1
    hook.close()


def test_a_restoring_request_waits_while_others_keep_running(tmp_path, registry, monkeypatch):
    import threading

    engine, hook = build(tmp_path, registry, dram_bytes=1 << 20, num_blocks=16)
    a, b = tenant("a"), tenant("b")
    rng = random.Random(3)
    p = [rng.randrange(1000, 40_000) for _ in range(100)]
    cold, _, _ = run(engine, "p1", a, p)
    run(engine, "q", a, [rng.randrange(1000, 40_000) for _ in range(230)])  # evicts p's tail
    hook.manager.drain()
    gate = threading.Event()
    real_restore = hook.manager._restore
    monkeypatch.setattr(hook.manager, "_restore", lambda *args: (gate.wait(10), real_restore(*args))[1])
    other = [rng.randrange(1000, 40_000) for _ in range(20)]
    engine.add_request(GenerateRequest(request_id="other", tenant=b, prompt_token_ids=other,
                                       sampling=SamplingParams(max_tokens=30, temperature=0.0)))
    outs = engine.step()
    engine.add_request(GenerateRequest(request_id="p2", tenant=a, prompt_token_ids=p,
                                       sampling=SamplingParams(max_tokens=4, temperature=0.0)))
    for _ in range(5):  # the restore is stuck: p2 waits as "restoring", "other" keeps decoding
        outs += engine.step()
        engine.check_integrity()
        assert engine.scheduler.queue_reasons() == {"restoring": 1}
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "other") == 6
    gate.set()
    while engine.has_unfinished():
        outs += engine.step()
        engine.check_integrity()
    p2 = [t for o in outs if o.request_id == "p2" for t in o.new_token_ids]
    assert p2 == cold
    assert [o for o in outs if o.request_id == "p2"][-1].cached_tokens == 96
    assert [t for o in outs if o.request_id == "other" for t in o.new_token_ids] == reference_generate(other, 30)
    hook.close()


@pytest.mark.gpu
def test_restore_stages_plaintext_in_pinned_memory_on_cuda(tmp_path, registry):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine, hook = build(tmp_path, registry, dram_bytes=1 << 20)
    hook.pin_memory = True
    seen = []
    real_import = engine.runner.import_blocks
    engine.runner.import_blocks = lambda ids, data: (seen.append(data.is_pinned()), real_import(ids, data))
    a = tenant("a")
    rng = random.Random(4)
    p = [rng.randrange(1000, 40_000) for _ in range(100)]
    cold, _, _ = run(engine, "p1", a, p)
    run(engine, "q", a, [rng.randrange(1000, 40_000) for _ in range(170)])
    warm, cached, _ = run(engine, "p2", a, p)
    assert warm == cold and cached == 96 and seen == [True]
    hook.close()


def test_mixed_workload_under_pressure_stays_correct(tmp_path, registry):
    """Three tenants, shared prefix families, a pool far smaller than the working set, a DRAM tier
    that overflows into NVMe: every output must equal the reference and the books must balance."""
    engine, hook = build(tmp_path, registry, dram_bytes=8 * 4 * 64 + 200, nvme_bytes=1 << 20, num_blocks=20)
    hook.manager.max_segment_blocks = 4
    rng = random.Random(5)
    tenants = [tenant(n) for n in "abc"]
    families = [[rng.randrange(1000, 40_000) for _ in range(rng.choice([40, 70, 100]))] for _ in range(6)]
    expected, outs = {}, []
    for wave in range(6):
        for k in range(4):
            who = tenants[(wave + k) % 3]
            prompt = families[rng.randrange(6)] + [rng.randrange(1000, 40_000) for _ in range(rng.randrange(1, 20))]
            rid = f"w{wave}-{k}"
            n = rng.randrange(1, 6)
            expected[rid] = reference_generate(prompt, n)
            engine.add_request(GenerateRequest(request_id=rid, tenant=who, prompt_token_ids=prompt,
                                               sampling=SamplingParams(max_tokens=n, temperature=0.0)))
        for _ in range(rng.randrange(1, 8)):
            outs += engine.step()
            engine.check_integrity()
    while engine.has_unfinished():
        outs += engine.step()
        engine.check_integrity()
    got: dict[str, list[int]] = {}
    for o in outs:
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == expected
    assert engine.cache.restored_blocks > 0  # the tiers were really used, both of them
    for where in ("dram", "nvme"):
        assert sum(metric(registry, "prefixgate_tier_demotions_total", tier=where, tenant=t) for t in "abc") > 0
    assert sum(o.cached_tokens for o in outs if o.finished) > 0
    hook.manager.drain()
    hook.manager.dram.check_integrity()
    hook.manager.nvme.check_integrity()
    hook.close()


def test_tenant_dram_and_nvme_block_quotas_are_enforced(tmp_path, registry):
    """Issue 16.8: ``--kv-blocks-dram 2 --kv-blocks-nvme 2`` held 983 KB in DRAM and 22 MB on NVMe.
    Now the tiers keep at most 2 blocks of the capped tenant each (its leading ones, so a later
    prefix match still restores them), while an uncapped tenant's spill is unaffected."""
    engine, hook = build(tmp_path, registry, dram_bytes=1 << 20, nvme_bytes=1 << 20)
    capped = dataclasses.replace(tenant("capped"), kv_block_quota_dram=2, kv_block_quota_nvme=2)
    free = tenant("free")
    rng = random.Random(8)
    p = [rng.randrange(1000, 40_000) for _ in range(100)]  # 6 cacheable full blocks
    filler = [rng.randrange(1000, 40_000) for _ in range(170)]  # needs 11 of the 12 blocks
    run(engine, "p1", capped, p)
    run(engine, "q1", capped, filler)  # pushes p's blocks out of HBM: 5+ spilled, 4 may stay below
    hook.manager.drain()
    stats = hook.manager.stats()
    assert stats["dram"]["blocks"] == 2 and stats["nvme"]["blocks"] == 2
    warm, cached, _ = run(engine, "p2", capped, p)
    assert warm == reference_generate(p, 4)
    hook.manager.drain()
    stats = hook.manager.stats()
    assert stats["dram"]["blocks"] <= 2 and stats["nvme"]["blocks"] <= 2
    hook.manager.dram.check_integrity()
    hook.manager.nvme.check_integrity()
    # the same workload of an uncapped tenant spills everything HBM gave up
    engine.cache.evict_all_cached()
    hook.manager.drain()
    before = hook.manager.stats()["dram"]["blocks"]
    run(engine, "p3", free, p)
    run(engine, "q3", free, filler)
    hook.manager.drain()
    assert hook.manager.stats()["dram"]["blocks"] - before >= 5
    hook.close()


def test_quotas_set_in_tenancy_reach_the_tiers(tmp_path, registry):
    """The path of ``tenant quota set X --kv-blocks-dram 2 --kv-blocks-nvme 2``: the quota stored by
    tenancy arrives on the authenticated context (a ``TenantScope`` with its real AES-GCM cipher)
    and the tiers keep no more than 2 blocks of X each."""
    pytest.importorskip("sqlite_utils", reason="tenancy's store (a GPU host may carry only the engine's packages)")
    from tenancy.service import TenancyService

    svc = TenancyService.open(tmp_path / "home")
    try:
        key = svc.create_tenant("x").api_key
        svc.update_tenant("x", kv_blocks_dram=2, kv_blocks_nvme=2)
        ctx = svc.authenticate(key)
        assert (ctx.kv_block_quota_dram, ctx.kv_block_quota_nvme) == (2, 2) and ctx.cipher is not None
        engine, hook = build(tmp_path, registry, dram_bytes=1 << 20, nvme_bytes=1 << 20)
        rng = random.Random(9)
        p = [rng.randrange(1000, 40_000) for _ in range(100)]
        run(engine, "p1", ctx, p)
        run(engine, "q1", ctx, [rng.randrange(1000, 40_000) for _ in range(170)])
        hook.manager.drain()
        stats = hook.manager.stats()
        assert stats["dram"]["blocks"] == 2 and stats["nvme"]["blocks"] == 2
        hook.close()
    finally:
        svc.close()


def test_use_per_tenant_and_tier_is_published_as_a_gauge(tmp_path, registry):
    """The panel's "used / quota": blocks a tenant holds in each tier are what its block quota of
    that tier counts, per metrics label, and ``prefixgate_kv_tenant_blocks`` says the same after
    the engine publishes its state; a tenant that holds nothing anymore reads 0, not a stale value."""
    engine, hook = build(tmp_path, registry, dram_bytes=1 << 20, nvme_bytes=1 << 20)
    capped = dataclasses.replace(tenant("capped"), kv_block_quota_dram=2, kv_block_quota_nvme=3)
    rng = random.Random(8)
    p = [rng.randrange(1000, 40_000) for _ in range(100)]  # 6 cacheable full blocks
    run(engine, "p1", capped, p)
    run(engine, "q1", capped, [rng.randrange(1000, 40_000) for _ in range(170)])  # p's blocks spill
    hook.manager.drain()
    # demotions finish on the tiers' workers after the last step: the gauge catches up at the next
    # publish (an empty step here; any step or abort in a serving engine)
    engine.step()
    gauge = engine.metrics.registry
    used = engine.cache.blocks_by_tenant()
    assert used[TierName.DRAM] == {"capped": 2} and used[TierName.NVME] == {"capped": 3}
    assert used[TierName.HBM] == {}  # nothing runs: no block is referenced
    for tier, n in (("hbm", 0), ("dram", 2), ("nvme", 3)):
        assert metric(gauge, "prefixgate_kv_tenant_blocks", tenant="capped", tier=tier) == n
    assert engine.stats()["kv_blocks_by_tenant"] == {"hbm": {}, "dram": {"capped": 2}, "nvme": {"capped": 3}}
    # while a request runs, its referenced HBM blocks count for its tenant
    engine.add_request(GenerateRequest(request_id="r", tenant=capped, prompt_token_ids=p,
                                       sampling=SamplingParams(max_tokens=4, temperature=0.0)))
    engine.step()
    assert metric(gauge, "prefixgate_kv_tenant_blocks", tenant="capped", tier="hbm") == engine.cache.used_by(
        capped.namespace) > 0
    while engine.has_unfinished():
        engine.step()
    hook.manager.drain()
    hook.manager.delete_tenant(capped.namespace)
    engine.step()
    assert engine.cache.blocks_by_tenant()[TierName.DRAM] == {}
    assert metric(gauge, "prefixgate_kv_tenant_blocks", tenant="capped", tier="dram") == 0
    assert metric(gauge, "prefixgate_kv_tenant_blocks", tenant="capped", tier="hbm") == 0
    hook.close()


def test_a_spilled_run_lingers_for_its_chain_only_while_nothing_waits(tmp_path, registry):
    """``flush_spills(due_only=True)`` (no request waiting) keeps a run that may still grow, so a
    chain evicted a block per step becomes one segment; it is handed down once it is as old as
    ``spill_linger_s`` or as long as a segment, and at once by a plain flush (a request waits)."""
    from engine.kv_types import BlockHash, EvictedBlock

    cfg = EngineConfig(model_dir=tmp_path / "double", block_size=BS, num_kv_blocks=64, dram_bytes=1 << 20)
    runner = TokenKVRunner(64, BS)
    manager = TierManager.from_config(cfg, runner.kv_bytes_per_block, registry=registry, pin_memory=False,
                                      max_segment_blocks=4)
    now = [100.0]
    hook = TierHook(manager, runner, pin_memory=False, spill_linger_s=0.05, clock=lambda: now[0])
    a = tenant("a")

    def evict(depth: int) -> None:  # one step's eviction: the chain's deepest block left goes
        hook.spill(a, EvictedBlock(BlockHash(bytes([depth]) * 32), a.namespace, depth, block_id=depth))

    def segments() -> int:
        manager.drain()
        return manager.stats()["dram"]["segments"]

    for depth in (9, 8, 7):  # three steps, 10 ms apart, nobody waiting
        evict(depth)
        hook.flush_spills(due_only=True)
        now[0] += 0.01
    assert segments() == 0
    now[0] += 0.03  # the run's first block is now 50 ms old
    hook.flush_spills(due_only=True)
    assert segments() == 1 and manager.stats()["dram"]["blocks"] == 3

    for depth in (6, 5, 4, 3):  # a segment's worth, in one step: handed down without waiting
        evict(depth)
    hook.flush_spills(due_only=True)
    assert segments() == 2

    evict(2)
    hook.flush_spills(due_only=True)
    assert segments() == 2
    hook.flush_spills()  # a request waits: everything goes down now
    assert segments() == 3 and manager.stats()["dram"]["blocks"] == 8
    hook.close()
