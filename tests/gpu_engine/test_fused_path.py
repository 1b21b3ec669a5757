"""The fused forward path (merged projections, fused norm / RoPE+KV write / SiLU ops) computes the
same function as the plain path; its merged weights keep the state dict's names and memory."""

from __future__ import annotations

import pytest
import torch

from engine.batch import ScheduledBatch, SequenceChunk
from prefixgate_kernels import cpu_attention, reference
from tests.gpu_engine.helpers import GREEDY, prefill_then_decode_batch, small_runner


def test_fused_weights_are_views_and_keep_the_state_dict(tmp_path):
    runner = small_runner(tmp_path, "cpu")
    runner.ops = reference  # the fused ops' torch references; CPU serving (prefixgate_kernels.cpu_attention) never fuses
    model = runner.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.fuse_projections()
    model.fuse_projections()  # idempotent
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[attn.q_proj.weight.shape[0]:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[mlp.gate_proj.weight.shape[0]:].data_ptr()
    n = sum(p.numel() for p in model.parameters())
    assert n == sum(v.numel() for v in before.values() if v.dtype.is_floating_point)


def _logits_both_paths(runner, batch_fn):
    """Prefill + one decode step on the plain path, then the same on the fused path (fresh cache)."""
    out = []
    for fused in (False, True):
        runner.model.fused = fused
        runner.kv_cache.zero_()
        decode = batch_fn(runner)
        out.append((runner.forward(decode, all_logits=True).clone(), runner.kv_cache.clone()))
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_fused_path_matches_plain_path_on_cpu(tmp_path, kv_dtype):
    runner = small_runner(tmp_path, "cpu", use_cuda_graphs=False, kv_dtype=kv_dtype)
    runner.ops = reference  # the fused ops' torch references; CPU serving (prefixgate_kernels.cpu_attention) never fuses
    if kv_dtype == "fp8":  # both paths store centred keys: the fused KV write subtracts the same bias
        assert runner.fp8_key_bias is not None and runner.fp8_key_bias.abs().amax() > 0
    runner.model.fuse_projections()
    (plain, plain_kv), (fused, fused_kv) = _logits_both_paths(runner, prefill_then_decode_batch)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_kv.float(), plain_kv.float(), rtol=1e-4, atol=1e-4)
    assert fused.argmax(-1).tolist() == plain.argmax(-1).tolist()


@pytest.mark.parametrize("ops", [reference, cpu_attention], ids=["reference", "cpu_attention"])
def test_fused_path_with_a_cached_prefix(tmp_path, ops):
    """A second request reuses the first one's blocks: the fused prefill attends over the cached part.
    CPU serving never fuses, but ``cpu_attention`` is a whole ops module (its fused ops the reference
    ones, its prefill attention given the ``context_lens`` hint): a fused model runs on it too."""
    runner = small_runner(tmp_path, "cpu", use_cuda_graphs=False)
    runner.ops = ops
    runner.model.fuse_projections()
    prompt = [(5 * i + 1) % 500 for i in range(40)]

    def batch(r):
        r.execute(ScheduledBatch([SequenceChunk("a", prompt[:32], 0, [4, 5], True, GREEDY)]))
        return ScheduledBatch([SequenceChunk("a", prompt[32:], 32, [4, 5, 6], True, GREEDY)])

    (plain, _), (fused, _) = _logits_both_paths(runner, batch)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
