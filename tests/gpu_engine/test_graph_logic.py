"""CPU: batch-size padding choice, KV sizing arithmetic, and the padded static-buffer decode path."""

from __future__ import annotations

import pytest
import torch

from engine.batch import ScheduledBatch
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, padded_batch_size
from engine.gpu_memory import (
    kv_blocks_for_budget,
    kv_budget_from_free,
    kv_bytes_per_token,
    max_resident_sequences,
)
from engine.model_runner import ModelRunner
from engine.models.random_init import build_random_model
from tests.gpu_engine.helpers import IdTokenizer, prefill_then_decode_batch, small_arch, small_runner


def test_graph_batch_sizes():
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert graph_batch_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padded_batch_size_picks_smallest_fitting():
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 4, 5, 9, 32, 33, 64)] == [1, 4, 4, 8, 16, 32, 40, 64]
    assert padded_batch_size(65, sizes) is None
    with pytest.raises(ValueError):
        padded_batch_size(0, sizes)


def test_kv_sizing_arithmetic():
    gib = 1024**3
    # an H200 after 16 GB of weights: 124 GiB free, 45% of it minus 2 GiB headroom
    assert kv_budget_from_free(124 * gib, 0.45, 2 * gib) == int(124 * gib * 0.45) - 2 * gib
    per_token = kv_bytes_per_token(32, 8, 128, 2)  # Llama-3-8B, bf16
    assert per_token == 131072
    assert kv_bytes_per_token(32, 8, 128, 1) * 2 == per_token  # fp8: half
    assert kv_bytes_per_token(1, 1, 4, 1, scale_bytes_per_head=4) == 16  # int8 + a float32 scale
    block = 16 * per_token
    assert kv_blocks_for_budget(10 * block + block - 1, block) == 10
    with pytest.raises(ValueError, match="raise cpu_kv_bytes"):
        kv_blocks_for_budget(-5, block)
    assert max_resident_sequences(3084, 16, 4112) == 12
    assert max_resident_sequences(6168, 16, 4112) == 24


def test_padded_decode_matches_eager_and_padding_writes_nothing(tmp_path):
    runner = small_runner(tmp_path, "cpu")
    batch = prefill_then_decode_batch(runner)
    before = runner.kv_cache.clone()
    eager = runner.forward(batch, all_logits=True)  # [3, V], writes the 3 new tokens' K/V
    written = (runner.kv_cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    graphs = DecodeGraphs(runner.model, runner.layer_caches, runner.ops, runner.block_size,
                          max_blocks_per_seq=16, sizes=(1, 4, 8), device=torch.device("cpu"))
    after_eager = runner.kv_cache.clone()
    padded = graphs.run(batch.chunks)  # runs at size 4: one padded row
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    # The padded run multiplies 4 rows where the eager one multiplied 3, and fp32 GEMMs may pick
    # another kernel (another summation order) for another row count: the K/V it rewrites into the
    # written blocks is equal only within rounding. Every other block must stay bit-identical:
    # that is what proves the padded row wrote nothing.
    assert written == [3, 8, 12]  # the blocks holding positions 5, 20, 40 (table index 0, 1, 2)
    untouched = torch.ones(runner.kv_cache.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(runner.kv_cache[untouched], after_eager[untouched])
    torch.testing.assert_close(runner.kv_cache[written], after_eager[written], rtol=1e-5, atol=1e-5)
    assert graphs.num_runs == 1
    # a later, narrower batch reuses the buffers: stale table entries past its blocks are not read
    short = ScheduledBatch([batch.chunks[0]])
    torch.testing.assert_close(graphs.run(short.chunks), runner.forward(short, all_logits=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds the largest captured size"):
        graphs.run(list(batch.chunks) * 3)


def test_runner_rejects_a_model_for_another_arch(tmp_path):
    arch = small_arch(tmp_path)
    other = build_random_model(arch.__class__(**{**arch.__dict__, "num_layers": 1}), "cpu", torch.float32)
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="different ArchConfig"):
        ModelRunner(EngineConfig(model_dir=tmp_path, num_kv_blocks=8), arch=arch, tokenizer=IdTokenizer(),
                    model=other)
