"""write_kv (reshape_and_cache) in Triton against prefixgate_kernels.reference.write_kv."""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import reference as ref
from prefixgate_kernels import triton_ops
from tests.kernels.kernel_cases import INTERPRET, make_kv_cache

pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def run_case(kv_dtype, src_dtype, kv_heads, head_dim, block_size, seed, device="cpu"):
    """Write 9 tokens (two skipped with -1) into random slots of a strided cache view; compare whole caches."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 5
    k_cache, v_cache, ks, vs = make_kv_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype, device, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9].to(torch.int64)
    slots[2] = -1
    slots[7] = -1
    key = (torch.randn(9, kv_heads, head_dim, generator=gen) * 3).to(device=device, dtype=src_dtype)
    value = (torch.randn(9, kv_heads, head_dim, generator=gen) * 3).to(device=device, dtype=src_dtype)
    key[4, 0] = 0.0  # an all-zero head: int8 scale falls back to 1e-8 / 127
    slots = slots.to(device)
    want = [t.clone() for t in (k_cache, v_cache)]
    want_s = [s.clone() if s is not None else None for s in (ks, vs)]
    ref.write_kv(key, value, want[0], want[1], slots, want_s[0], want_s[1])
    triton_ops.write_kv(key, value, k_cache, v_cache, slots, ks, vs)
    for got, exp in zip((k_cache, v_cache), want):
        if kv_dtype == torch.int8:
            # Same rounding rule; allow one step where x/scale lands within an ulp of a half.
            assert (got.int() - exp.int()).abs().max() <= 1
            assert (got != exp).float().mean() < 1e-3
        elif kv_dtype == ref.FP8_DTYPE:
            diff = (got.float() - exp.float()).abs()
            assert (diff <= exp.float().abs() * 0.0625 + 1e-6).all(), "fp8 values differ by more than one ulp"
            assert (got.view(torch.uint8) != exp.view(torch.uint8)).float().mean() < 1e-3
        elif src_dtype == kv_dtype:
            assert torch.equal(got, exp)
        else:
            # A cast between float formats: the interpreter's fp32->bf16 rounds differently from torch's.
            torch.testing.assert_close(got, exp, rtol=8e-3, atol=0)
    if kv_dtype == torch.int8:
        for got, exp in zip((ks, vs), want_s):
            torch.testing.assert_close(got, exp, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32, ref.FP8_DTYPE, torch.int8])
def test_write_kv_matches_reference(kv_dtype):
    src = kv_dtype if kv_dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16
    run_case(kv_dtype, src, kv_heads=2, head_dim=64, block_size=16, seed=1)


def test_write_kv_casts_between_float_formats():
    run_case(torch.bfloat16, torch.float16, kv_heads=2, head_dim=64, block_size=16, seed=2)


@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(8, 128, 32), (3, 64, 16)])
def test_write_kv_shapes_quantized(kv_heads, head_dim, block_size):
    run_case(torch.int8, torch.bfloat16, kv_heads, head_dim, block_size, seed=kv_heads)
    run_case(ref.FP8_DTYPE, torch.bfloat16, kv_heads, head_dim, block_size, seed=kv_heads + 1)


def test_int8_rounds_half_to_even():
    # Values whose x / scale is exactly k + 0.5 must round like torch.round (to even).
    k_cache = torch.zeros(1, 16, 1, 16, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    ks = torch.zeros(1, 16, 1)
    vs = torch.zeros(1, 16, 1)
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 0, 0, 0, 0, 0, 0, 0, 0])
    key = row.reshape(1, 1, 16)
    triton_ops.write_kv(key, key.clone(), k_cache, v_cache, torch.tensor([3]), ks, vs)
    assert k_cache[0, 3, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]
    assert ks[0, 3, 0].item() == pytest.approx(1.0)


def test_write_kv_checks_inputs():
    k = torch.zeros(2, 16, 2, 64, dtype=torch.float16)
    key = torch.randn(3, 2, 64, dtype=torch.float16)
    with pytest.raises(AssertionError, match="slot_mapping must have 3 entries"):
        triton_ops.write_kv(key, key, k, k.clone(), torch.tensor([0, 1]))
    with pytest.raises(AssertionError, match="int8 k_scale must be"):
        k8 = torch.zeros(2, 16, 2, 64, dtype=torch.int8)
        triton_ops.write_kv(key, key, k8, k8.clone(), torch.tensor([0, 1, 2]), torch.zeros(2, 16), torch.zeros(2, 16))
