"""The tiled prefill GEMM (prefixgate_kernels/tiled_gemm.py) against the fp32 product, rounded once, on
fresh random inputs: ragged row and column counts (partial tiles), several tile shapes and group sizes
(the grouped program order must still visit every tile once), 16-bit and fp32 operands."""

from __future__ import annotations

import pytest
import torch

from prefixgate_kernels import tiled_gemm
from prefixgate_kernels.tiled_gemm import GemmTiles
from tests.kernels.kernel_cases import INTERPRET

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")

SMALL = [GemmTiles(16, 16, 16, 4, 2, group_m=2), GemmTiles(32, 16, 32, 4, 3, group_m=1), GemmTiles(16, 32, 16, 4, 2, group_m=8)]


@needs_interpreter
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (37, 50, 64), (64, 48, 96), (100, 33, 32)])
@pytest.mark.parametrize("tiles", SMALL, ids=lambda t: f"m{t.block_m}n{t.block_n}k{t.block_k}g{t.group_m}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tiled_linear_matches_the_product(m, n, k, tiles, dtype):
    if k % tiles.block_k:
        pytest.skip("K must be a multiple of block_k")
    gen = torch.Generator().manual_seed(m * 7 + n * 13 + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    want = (x.double() @ w.double().T)
    got = tiled_gemm.tiled_linear(x, w, tiles)
    assert got.shape == (m, n) and got.dtype == dtype
    # one rounding of the fp32 sum to the output dtype (the interpreter's fp16 rounding may truncate)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * float(want.abs().max())), float(
        (got.double() - want).abs().max())


@needs_interpreter
def test_tiled_linear_checks_its_inputs():
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match="multiple of block_k"):
        tiled_gemm.tiled_linear(x, torch.randn(8, 48), GemmTiles(16, 16, 32, 4, 2))
    with pytest.raises(ValueError, match=r"weight must be \[N, 48\]"):
        tiled_gemm.tiled_linear(x, torch.randn(8, 32), GemmTiles(16, 16, 16, 4, 2))
    assert tiled_gemm.tiled_linear(x[:0], torch.randn(8, 48), GemmTiles(16, 16, 16, 4, 2)).shape == (0, 8)
