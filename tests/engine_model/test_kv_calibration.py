"""fp8 KV calibration: the key bias leaves attention unchanged, scales are powers of two, the
recording stand-in attends like the reference."""

from __future__ import annotations

import math

import torch

from engine.kv_calibration import AmaxRecorder, fp8_scales_from_amax
from engine.models.attention import AttentionMetadata, LayerCache, paged_attention
from prefixgate_kernels import reference


def _prefill_case(seed=0, n=21, hkv=2, group=3, d=16, bs=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hkv * group, d, generator=gen)
    k = torch.randn(n, hkv, d, generator=gen) + 5.0  # a large shared offset, like real keys
    v = torch.randn(n, hkv, d, generator=gen)
    nb = -(-n // bs)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(nb, dtype=torch.int32).unsqueeze(0),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        decode_only=False,
    )
    def cache(bias=None):
        return LayerCache(torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d), k_bias=bias)
    return q, k, v, meta, cache, gen


def test_key_bias_does_not_change_attention():
    q, k, v, meta, cache, gen = _prefill_case()
    plain = paged_attention(reference, q, k, v, cache(), meta, 0.25)
    bias = torch.randn(k.shape[1:], generator=gen) * 3
    biased = paged_attention(reference, q, k, v, cache(bias), meta, 0.25)
    torch.testing.assert_close(biased, plain, rtol=1e-4, atol=1e-5)


def test_recorder_attends_like_the_reference_and_centres_keys():
    q, k, v, meta, cache, _ = _prefill_case(seed=1)
    want = paged_attention(reference, q, k, v, cache(), meta, 0.25)
    rec = AmaxRecorder()
    got = paged_attention(rec, q, k, v, cache(), meta, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rec.k_mean[0], k.mean(0))
    assert math.isclose(rec.k_amax[0], float((k - k.mean(0)).abs().amax()), rel_tol=1e-6)


def test_scales_are_powers_of_two_with_headroom():
    scales = fp8_scales_from_amax([17.0, 0.0], [0.6, 300.0])  # [2 layers, k|v, 1]
    assert scales.shape == (2, 2, 1)
    log2 = torch.log2(scales)
    assert torch.equal(log2, log2.round())
    assert float(scales[0, 0]) * 448 >= 4 * 17.0 and float(scales[1, 1]) * 448 >= 4 * 300.0


def test_fp8_runner_is_calibrated_at_load(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_dir=tiny_model_dir, kv_dtype="fp8", num_kv_blocks=64))
    arch = runner.arch
    assert runner.fp8_key_bias is not None and runner.fp8_key_bias.shape == (arch.num_layers, arch.num_kv_heads,
                                                                             arch.head_dim)
    assert runner.fp8_key_bias.abs().sum() > 0 and not torch.equal(runner.fp8_scales, torch.ones_like(runner.fp8_scales))
    assert runner.layer_caches[1].k_bias is not None
