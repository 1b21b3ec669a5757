"""The CUDA path (GPU machines only): same parity checks on the device, bf16 sanity, cache sizing."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from tests.engine_model.driver import GREEDY, BlockAllocator, Seq, blocks_needed, hf_greedy, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _hf(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "qwen2_dir"])
def test_cuda_fp32_matches_transformers(model_fixture, request):
    model_dir = request.getfixturevalue(model_fixture)
    runner = ModelRunner(EngineConfig(model_dir=model_dir, device="cuda", dtype="float32", num_kv_blocks=64,
                                      block_size=16))
    oracle = _hf(model_dir, torch.float32)
    prompt = list(range(1000, 1037))
    logits = runner.forward(ScheduledBatch([SequenceChunk("l", prompt, 0, [5, 9, 2], True, GREEDY)]),
                            all_logits=True)
    with torch.no_grad():
        ref = oracle(torch.tensor([prompt], device="cuda")).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=0)

    alloc = BlockAllocator(64, seed=0)
    ps = [list(range(7, 12)), list(range(300, 340)), list(range(4000, 4019))]
    seqs = [Seq(f"g{i}", list(p), alloc.take(blocks_needed(len(p) + 10, 16))) for i, p in enumerate(ps)]
    outs = run(runner, seqs, 10, chunk=16)
    for p, out in zip(ps, outs, strict=True):
        assert out == hf_greedy(oracle.cpu().float(), p, 10)


def test_cuda_bf16_close_and_kv_sized_from_free_memory(tiny_model_dir):
    runner = ModelRunner(EngineConfig(model_dir=tiny_model_dir, device="cuda", kv_memory_fraction=0.3))
    assert runner.spec.dtype == "bfloat16" and runner.kv_cache.dtype == torch.bfloat16
    free, total = torch.cuda.mem_get_info()
    assert runner.num_kv_blocks * runner.kv_bytes_per_block < 0.3 * total
    assert runner.num_kv_blocks > 1000
    prompt = list(range(2000, 2050))
    logits = runner.forward(ScheduledBatch([SequenceChunk("b", prompt, 0, [0, 1, 2, 3], True, GREEDY)]),
                            all_logits=True)
    with torch.no_grad():
        ref = _hf(tiny_model_dir, torch.float32)(torch.tensor([prompt], device="cuda")).logits[0]
    assert (logits - ref).abs().max().item() < 0.1
    data = runner.export_blocks([0, 1])
    assert data.device.type == "cpu" and data.shape == (2, runner.kv_bytes_per_block)
    runner.import_blocks([7, 8], data)
    assert torch.equal(runner.export_blocks([7, 8]), data)
    del runner
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8", "int8"])
def test_cuda_head_major_pool_matches_token_pool(kv_dtype, tiny_model_dir):
    # the compiled kernels read the GPU's default pool (each page head by head) as they read token-ordered
    # pages: the same logits within rounding, the same greedy tokens, the same exported bytes
    runners = [ModelRunner(EngineConfig(model_dir=tiny_model_dir, device="cuda", dtype="float32", kv_dtype=kv_dtype,
                                        num_kv_blocks=64, block_size=16, kv_page_layout=layout))
               for layout in ("token", "auto")]
    assert [r.kv_layout.value for r in runners] == ["token", "head"]
    prompt = list(range(1000, 1037))
    logits = [r.forward(ScheduledBatch([SequenceChunk("l", prompt, 0, [5, 9, 2], True, GREEDY)]), all_logits=True)
              for r in runners]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)
    outs = []
    for r in runners:
        alloc = BlockAllocator(64, seed=1)
        ps = [list(range(7, 12)), list(range(300, 340)), list(range(4000, 4019))]
        seqs = [Seq(f"g{i}", list(p), alloc.take(blocks_needed(len(p) + 10, 16))) for i, p in enumerate(ps)]
        outs.append(run(r, seqs, 10, chunk=16))
    assert outs[0] == outs[1]
    assert torch.equal(runners[1].export_blocks([5, 9, 2]), runners[0].export_blocks([5, 9, 2]))
    # the token pool's blocks restored into the head pool (one pass through its token view) come back the same
    data = runners[0].export_blocks([5, 9, 2])
    runners[1].import_blocks([40, 41, 50], data)
    assert torch.equal(runners[1].export_blocks([40, 41, 50]), data)
    # the device-spill gather of blocks not in a run, into the last rows of a staging buffer (KV, then scales)
    for r in runners:
        rows = torch.full((4, r.kv_bytes_per_block), 7, dtype=torch.uint8, device="cuda")
        r.gather_blocks_into([5, 9, 2], rows[1:])
        assert torch.equal(rows[1:].cpu(), data) and set(rows[0].tolist()) == {7}
    del runners
    gc.collect()
    torch.cuda.empty_cache()
