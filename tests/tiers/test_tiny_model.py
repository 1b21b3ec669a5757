"""End to end with the real model runner: a prefix evicted from HBM comes back from DRAM / NVMe.

The tiny offline model (random weights, real tokenizer) on the CPU reference path. The restored
request must decode greedily like the cold run and report the restored tokens as cached. "Like"
is judged against transformers' greedy tokens on the same checkpoint (tests/greedy_reference.py):
the cold run prefills 200 tokens where the warm one prefills 8, and fp32 rounding may differ
between the two shapes, which matters only at a near tie.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.launch import build_llm_engine
from engine.protocol import GenerateRequest, SamplingParams
from tests.greedy_reference import assert_greedy_agrees, hf_greedy
from tests.tiers.conftest import metric, tenant


def generate(engine, rid, who, prompt, max_tokens=8):
    engine.add_request(GenerateRequest(request_id=rid, tenant=who, prompt_token_ids=prompt,
                                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        engine.check_integrity()
    return [t for o in outs for t in o.new_token_ids], outs[-1].cached_tokens


@pytest.mark.parametrize("where", ["dram", "nvme"])
def test_evicted_prefix_restored_gives_cold_run_tokens(tiny_model_dir, tmp_path, registry, where):
    sizes = {"dram_bytes": 64 << 20} if where == "dram" else {"nvme_dir": tmp_path / "nvme", "nvme_bytes": 64 << 20}
    cfg = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=24, max_model_len=1024, **sizes)
    engine = build_llm_engine(cfg, registry)
    hook = engine.lower_tier
    assert hook is not None and hook.manager.tiers[0].name == where
    a = tenant("a")
    rng = random.Random(7)
    p = [rng.randrange(1000, 90_000) for _ in range(200)]  # 12 cacheable blocks
    cold, cached = generate(engine, "p1", a, p)
    assert cached == 0
    generate(engine, "q", a, [rng.randrange(1000, 90_000) for _ in range(340)], max_tokens=4)  # evicts p
    hook.flush_spills()
    hook.manager.drain()
    assert metric(registry, "prefixgate_tier_demotions_total", tier=where, tenant="a") == engine.cache.num_evictions > 0
    warm, cached = generate(engine, "p2", a, p)
    oracle = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference = hf_greedy(oracle, p, 8)
    assert_greedy_agrees(cold, reference)
    assert_greedy_agrees(warm, reference)
    assert cached == 192  # all 12 blocks: whatever HBM lost came back from the tier
    restored = metric(registry, "prefixgate_tier_restores_total", tier=where, tenant="a")
    assert restored >= 1 and engine.cache.restored_blocks == restored
    assert engine.stats()["prompt_tokens_hit"] == 192
    hook.close()
