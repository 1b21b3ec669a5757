"""Split-K partials for the projections the next add + RMSNorm sums (prefixgate_kernels/partial_gemm.py)."""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import partial_gemm
from prefixgate_kernels import reference as ref


@pytest.mark.parametrize("m,n,k,slices", [(1, 64, 256, 4), (7, 96, 512, 2), (32, 40, 448, 4)])
def test_sliced_partials_sum_to_the_product(m, n, k, slices):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, dtype=torch.bfloat16)
    parts = partial_gemm.sliced_partials(x, w, slices)
    assert parts.shape == (slices, m, n) and parts.dtype == torch.float32
    want = x.double() @ w.double().T
    assert float((parts.double().sum(0) - want).abs().max()) < 1e-3 * float(want.abs().max())
    # each slice is its own K range
    kk = k // slices
    torch.testing.assert_close(parts[1], (x[:, kk:2 * kk].float() @ w[:, kk:2 * kk].float().T), rtol=1e-5, atol=1e-4)


def test_slices_only_where_measured():
    bf16 = torch.bfloat16
    assert partial_gemm.slices_for(1, 4096, bf16, False, True) == partial_gemm.SLICES
    assert partial_gemm.slices_for(32, 14336, bf16, False, True) == partial_gemm.SLICES
    assert partial_gemm.slices_for(33, 4096, bf16, False, True) == 1  # a prefill chunk: F.linear
    assert partial_gemm.slices_for(0, 4096, bf16, False, True) == 1
    assert partial_gemm.slices_for(8, 4096, bf16, True, True) == 1  # a bias: F.linear adds it
    assert partial_gemm.slices_for(8, 4096, torch.float32, False, True) == 1  # bmm's fp32 out is for 16-bit
    assert partial_gemm.slices_for(8, 4096, bf16, False, False) == 1  # CPU
    assert partial_gemm.slices_for(8, 4000, bf16, False, True) == 1  # slices not 16-aligned


def test_reference_linear_partials_is_linear_on_cpu():
    x, w = torch.randn(3, 64), torch.randn(8, 64)
    torch.testing.assert_close(ref.linear_partials(x, w), torch.nn.functional.linear(x, w))
