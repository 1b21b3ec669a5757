"""One-sequence prefill steps through the padded static-buffer path (engine/prefill_graphs.py).

CPU: the sizes, the split-count keys against the launcher's own choice, and the padded path (run
eagerly on a CPU) against the runner's eager forward, padding writing nothing. CUDA (marked gpu):
the captured graphs against the eager path at several sizes, contexts and split counts."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.random_init import build_random_model, llama_config_dict
from engine.models.spec import parse_checkpoint_config
from engine.prefill_graphs import PrefillGraphKey, PrefillGraphs, prefill_graph_sizes
from tests.gpu_engine.helpers import GREEDY, SHAPE, IdTokenizer

LONG = 4096  # tokens of context: long enough that a short step's attention splits on a GPU


def long_runner(tmp_path, device: str, dtype: str = "float32", shape: dict | None = None, **config) -> ModelRunner:
    """helpers.small_runner's model (or ``shape``) with a 4K context and a cache that holds one such sequence."""
    dims = {**SHAPE, **(shape or {}), "max_position_embeddings": LONG}
    (tmp_path / "config.json").write_text(json.dumps(llama_config_dict(**dims)), encoding="utf-8")
    arch = parse_checkpoint_config(tmp_path)
    model = build_random_model(arch, device, getattr(torch, dtype), seed=0, std=0.05)
    cfg = EngineConfig(model_dir=tmp_path, device=device, dtype=dtype, num_kv_blocks=LONG // 16 + 8,
                       block_size=16, max_num_seqs=4, **config)
    return ModelRunner(cfg, arch=arch, tokenizer=IdTokenizer(), model=model)


def chunk(tokens: list[int], start: int, table: list[int], rid: str = "r") -> SequenceChunk:
    return SequenceChunk(rid, tokens, start, table, True, GREEDY)


def test_prefill_graph_sizes():
    assert prefill_graph_sizes(512) == (64, 128, 256, 384, 512)
    assert prefill_graph_sizes(600) == (64, 128, 256, 384, 512, 600)
    assert prefill_graph_sizes(100) == (64, 100)
    assert prefill_graph_sizes(64) == (64,)
    assert prefill_graph_sizes(2) == (2,)
    with pytest.raises(ValueError):
        prefill_graph_sizes(1)


def test_config_rejects_a_one_token_graph(tmp_path):
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(model_dir=tmp_path, prefill_graph_tokens=1)
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(model_dir=tmp_path, prefill_graph_tokens=-4)


def test_keys_follow_the_launchers_split_choice():
    """Each size is keyed by the split counts the launcher picks on a doubling ladder of contexts; a
    step's key is its own context's pick (triton_ops' policy on the interpreter's 4-SM machine; one
    query head, so that a 16-row step leaves SMs idle and splits)."""
    # imported here, not at collection: importing the Triton kernels before tests/kernels/conftest.py
    # turns the interpreter on would compile them for a GPU (the policy called here is plain Python)
    from prefixgate_kernels import triton_ops

    cpu = torch.device("cpu")
    graphs = PrefillGraphs(torch.nn.Identity(), [], triton_ops, 16, max_blocks_per_seq=LONG // 16, q_heads=1,
                           sizes=(16, 64), device=cpu)
    splits = {t: sorted({triton_ops.prefill_splits(t, 1, 1, c, cpu) for c in range(t, LONG + 1, 16)})
              for t in graphs.sizes}
    assert max(splits[16]) > 1, "the policy must split somewhere in this range, or the test checks nothing"
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randrange(2, 65)
        context = rng.randrange(n, LONG + 1)
        key = graphs.key_for(chunk([1] * n, context - n, list(range(-(-context // 16)))))
        assert key.tokens == (16 if n <= 16 else 64)
        want = triton_ops.prefill_splits(key.tokens, 1, 1, context, cpu)
        assert key.splits in splits[key.tokens]
        if want in graphs._hints[key.tokens]:
            assert key.splits == want
    assert not graphs.accepts(chunk([1], 10, [0]))  # one token: a decode step
    assert not graphs.accepts(chunk([1] * 65, 0, list(range(5))))  # past the largest size
    with pytest.raises(ValueError, match="does not fit"):
        graphs.fill(chunk([1] * 65, 0, list(range(5))))


def _fresh_kv(runner: ModelRunner, prefix: list[int], table: list[int]) -> torch.Tensor:
    runner.kv_cache.zero_()
    runner.execute(ScheduledBatch([chunk(prefix, 0, table)]))
    return runner.kv_cache.clone()


def test_padded_prefill_matches_eager_and_padding_writes_nothing(tmp_path):
    runner = long_runner(tmp_path, "cpu")
    assert runner.prefill_graphs is None  # a CPU runner runs prefill eagerly; the path is driven directly here
    graphs = PrefillGraphs(runner.model, runner.layer_caches, runner.ops, runner.block_size,
                           max_blocks_per_seq=LONG // 16, q_heads=SHAPE["num_attention_heads"], sizes=(8, 32, 64),
                           device=torch.device("cpu"))
    rng = random.Random(3)
    table = rng.sample(range(runner.num_kv_blocks), 40)  # scattered blocks, 640 tokens
    prefix = [rng.randrange(500) for _ in range(300)]
    for n in (2, 21, 32, 45):
        suffix = [rng.randrange(500) for _ in range(n)]
        step = ScheduledBatch([chunk(suffix, len(prefix), table)])
        before = _fresh_kv(runner, prefix, table)
        eager = runner.forward(step, all_logits=True)[-1:].clone()
        after_eager = runner.kv_cache.clone()
        written = (after_eager != before).flatten(1).any(1).nonzero().flatten().tolist()
        runner.kv_cache.copy_(before)
        padded = graphs.run(step.chunks[0])
        assert padded.shape == eager.shape
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        # the padded rows (up to 64 - n) wrote nothing: every block the eager step left alone is
        # bit-identical, the ones it wrote equal within rounding (another row count, another GEMM)
        untouched = torch.ones(runner.kv_cache.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert written and torch.equal(runner.kv_cache[untouched], after_eager[untouched])
        torch.testing.assert_close(runner.kv_cache[written], after_eager[written], rtol=1e-5, atol=1e-5)
    assert graphs.num_runs == 4



def _check_graph_steps(runner: ModelRunner, steps, tol: float) -> list[PrefillGraphKey]:
    """Each (new tokens, cached tokens) step replayed from its graph against the eager path: logits and
    cache within ``tol``, the graph path taken once, bracketed on the device; returns the steps' keys."""
    graphs = runner.prefill_graphs
    rng = random.Random(11)
    table = rng.sample(range(runner.num_kv_blocks), LONG // 16)
    seen: list[PrefillGraphKey] = []
    for n, cached in steps:
        prefix = [rng.randrange(500) for _ in range(cached)]
        suffix = [rng.randrange(500) for _ in range(n)]
        step = ScheduledBatch([chunk(suffix, cached, table)])
        before = _fresh_kv(runner, prefix, table)
        eager = runner.forward(step, all_logits=True)[-1:].clone()  # all_logits: the eager path
        after_eager = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        runs = graphs.num_runs
        graphs.replay_log = []
        graphed = runner.forward(step).clone()
        assert graphs.num_runs == runs + 1
        (record,) = graphs.replay_log  # one replay, bracketed on the device
        graphs.replay_log = None
        assert record.device_ms() > 0.0 and record.fill_s > 0.0 and record.launch_s > 0.0
        seen.append(graphs.key_for(step.chunks[0]))
        torch.testing.assert_close(graphed, eager, rtol=tol, atol=tol)
        torch.testing.assert_close(runner.kv_cache, after_eager, rtol=tol, atol=tol)
        runner.kv_cache.copy_(before)
        assert runner.execute(step).sampled_token_ids == graphed.argmax(-1).tolist()
    return seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_prefill_equals_eager_gpu(tmp_path):
    """Captured one-sequence prefill steps (2-200 tokens, contexts to 4K, every split count the
    graphs hold) give the eager path's logits and cache, and the runner takes the graph path."""
    runner = long_runner(tmp_path, "cuda", prefill_graph_tokens=256)
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.sizes == (64, 128, 256)
    assert max(max(h) for h in graphs._hints.values()) > 1, "a 4K context must split a 64-row step on a GPU"
    steps = ((2, 100), (21, 700), (64, 3000), (100, 1500), (200, 3800), (5, 4000), (64, 90))
    seen = _check_graph_steps(runner, steps, 1e-4)
    assert len({k.splits for k in seen}) > 1, f"only one split count exercised: {set(seen)}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_prefill_on_the_specialised_kernel_gpu(tmp_path):
    """A bf16 model at head dim 64 with few heads: the graphs' split launches are the warp-specialised
    kernel's at its own split count (prefill_attention.plan_prefill, told the cache's layout by the runner),
    and replay as the eager path computes them."""
    from prefixgate_kernels import prefill_attention as pa

    if not pa.gluon_runs_on(torch.device("cuda")):
        pytest.skip("the Gluon prefills need an sm_90 GPU and Triton 3.6")
    shape = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    runner = long_runner(tmp_path, "cuda", dtype="bfloat16", shape=shape, prefill_graph_tokens=256)
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.layout is not None and graphs.layout.head_dim == 64
    steps = ((64, 3000), (100, 1500), (200, 3800), (128, 2500), (70, 4000))
    keys = _check_graph_steps(runner, steps, 2e-2)
    plans = [pa.plan_prefill(key.tokens, 1, 4, n + cached, torch.device("cuda"), graphs.layout)
             for key, (n, cached) in zip(keys, steps)]
    assert [key.splits for key in keys] == [plan.splits for plan in plans]
    assert any(p.kernel is pa.PrefillKernel.SPECIALIZED and p.splits > 1 for p in plans), plans
