"""End to end with the real tiny model: the engine's greedy tokens equal ``transformers``' on the
same checkpoint, batched, chunked, with prefix hits and after forced preemption; AsyncEngine
streams and frees blocks on abort; ``prefixgate generate --json`` works.

Skipped where the engine extra is not installed.
"""

import asyncio
import json

import pytest

torch = pytest.importorskip("torch", reason="pip install 'prefixgate[engine]' (torch)")
transformers = pytest.importorskip("transformers", reason="pip install 'prefixgate[engine]' (transformers)")

from engine.config import EngineConfig  # noqa: E402
from engine.launch import build_engine, build_llm_engine, build_tiny_checkpoint  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope  # noqa: E402
from tests.greedy_reference import assert_greedy_agrees, hf_greedy  # noqa: E402

N_NEW = 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def base_engine(tiny_dir):
    """One loaded runner (256 blocks of 16) shared by every engine below."""
    return build_llm_engine(EngineConfig(model_dir=tiny_dir, block_size=16, num_kv_blocks=256))


@pytest.fixture(scope="module")
def tokenizer(base_engine):
    return base_engine.runner.tokenizer


@pytest.fixture(scope="module")
def expected(hf_model, tokenizer):
    return {f"r{i}": hf_greedy(hf_model, p, N_NEW) for i, p in enumerate(prompts(tokenizer))}


def engine_like(base, **cfg):
    num_blocks = cfg.pop("num_kv_blocks", None)
    config = EngineConfig(model_dir=base.config.model_dir, block_size=16, **cfg)
    return LLMEngine(config, base.runner, num_blocks=num_blocks)




def prompts(tokenizer):
    system = "You are a careful assistant. Answer briefly and cite the policy section. " * 4
    texts = [system + q for q in ("What is the refund window?", "Can I change my address?", "Who do I call?")]
    texts.append("A short unrelated prompt about the weather in Lisbon")
    return [tokenizer.encode(t) for t in texts]


def run(engine, reqs):
    for rid, ids in reqs.items():
        engine.add_request(
            GenerateRequest(rid, StaticTenantScope(), SamplingParams(max_tokens=N_NEW, temperature=0.0,
                                                                   ignore_eos=True), prompt_token_ids=ids)
        )
    got: dict[str, list[int]] = {rid: [] for rid in reqs}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = out.cached_tokens
        engine.check_integrity()
    return got, cached


@pytest.mark.parametrize(
    "label,cfg",
    [
        ("chunked", dict(max_num_batched_tokens=32)),
        ("preempted", dict(max_num_batched_tokens=64, num_kv_blocks=6)),
        ("lru-no-cache", dict(eviction_policy="lru", enable_prefix_caching=False)),
    ],
)
def test_engine_greedy_equals_transformers(base_engine, tokenizer, expected, label, cfg):
    ps = prompts(tokenizer)
    engine = engine_like(base_engine, **cfg)
    # first the shared-prefix prompt alone, so the others hit its blocks; then all together
    first, _ = run(engine, {"r0": ps[0]})
    rest, cached = run(engine, {f"r{i}": p for i, p in enumerate(ps) if i})
    got = {**first, **rest}
    assert got.keys() == expected.keys()
    for rid, ref in expected.items():
        assert_greedy_agrees(got[rid], ref)
    if label == "preempted":
        assert engine.scheduler.num_preemptions > 0
    if engine.config.enable_prefix_caching:
        assert cached["r1"] > 0 and cached["r2"] > 0  # served from r0's prefix blocks
    else:
        assert set(cached.values()) == {0}
    assert engine.cache.num_used == 0


def test_prefix_hit_serves_same_tokens_as_cold_run(base_engine, tokenizer, expected):
    ids = prompts(tokenizer)[1]
    engine = engine_like(base_engine)
    cold, c0 = run(engine, {"cold": ids})
    warm, c1 = run(engine, {"warm": ids})
    # the warm run prefills only the uncached suffix (another shape): both agree with the oracle
    assert_greedy_agrees(cold["cold"], expected["r1"])
    assert_greedy_agrees(warm["warm"], expected["r1"])
    assert c0["cold"] == 0 and c1["warm"] == (len(ids) - 1) // 16 * 16


def test_async_engine_streams_and_abort_frees_blocks(tiny_dir):
    engine = build_engine(EngineConfig(model_dir=tiny_dir, num_kv_blocks=64))  # the real composition root

    async def main():
        sampling = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        gen = engine.generate(GenerateRequest("s", StaticTenantScope(), sampling, prompt="Tell me a story"))
        outs = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()
        for _ in range(100):
            stats = await engine.stats()
            if stats["kv_blocks_used"] == 0 and stats["running"] == 0:
                return outs, stats
            await asyncio.sleep(0.02)
        return outs, await engine.stats()

    try:
        outs, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(len(o.new_token_ids) == 1 for o in outs) and not outs[-1].finished
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0


def test_cli_generate_json(tiny_dir, capsys):
    from gateway.cli.main import main

    assert main(["generate", "--model", str(tiny_dir), "--raw", "--max-tokens", "5", "--json", "Hello there"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "prompt_tokens", "cached_tokens"}
    assert 1 <= len(out["token_ids"]) <= 5 and out["prompt_tokens"] == 2 and out["cached_tokens"] == 0
    assert main(["generate", "--model", str(tiny_dir / "nope"), "x"]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_dir), "--max-tokens", "0", "x"]) == 2
    assert main(["generate", "--model", str(tiny_dir), "--temperature", "7", "x"]) == 2
