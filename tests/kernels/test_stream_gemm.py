"""kernels.stream_gemm (the persistent weight stream for decode GEMMs) against float64 F.linear.

Interpreter cases on CPU: fresh random inputs, grids with fewer programs than row tiles (each program
loops over several tiles in the flattened loop), with more, partial last tiles, bias; the launcher's
refusals. The compiled kernel with programmatic dependent launch: tests/kernels/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels import stream_gemm
from tests.kernels.kernel_cases import INTERPRET
from tests.kernels.test_fused_layer_ops import rel_err

pytestmark = pytest.mark.skipif(not INTERPRET, reason="interpreter tests (TRITON_INTERPRET=1, CPU tensors)")


def run_stream_case(m: int, n: int, k: int, bias: bool, config: stream_gemm.StreamConfig, num_sms: int, seed: int,
                    dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    got = stream_gemm.stream_linear(x, w, b, config, num_sms)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
    assert got.shape == (m, n) and got.dtype == dtype
    return rel_err(got, want)


@pytest.mark.parametrize("m,n,k,bias,num_sms,programs_per_sm", [
    (1, 100, 512, False, 2, 1),   # 7 tiles on 2 programs: 4 and 3 tiles each, the last one partial
    (5, 64, 256, True, 3, 2),     # 4 tiles on 4 programs (6 slots, capped at the tile count)
    (32, 40, 768, False, 1, 1),   # one program walks all 3 tiles, three K slices each
    (17, 16, 256, True, 8, 2),    # one tile, 17 rows padded to 32
])
def test_stream_matches_linear(m, n, k, bias, num_sms, programs_per_sm):
    cfg = stream_gemm.StreamConfig(block_n=16, block_k=256, programs_per_sm=programs_per_sm, num_stages=2)
    assert run_stream_case(m, n, k, bias, cfg, num_sms, seed=m * n + k) < 1e-6


def test_stream_refuses_what_it_cannot_run():
    cfg = stream_gemm.StreamConfig(block_n=16, block_k=256)
    with pytest.raises(AssertionError, match="at most 32"):
        stream_gemm.stream_linear(torch.randn(33, 256), torch.randn(16, 256), None, cfg, 4)
    with pytest.raises(AssertionError, match="multiple of block_k"):
        stream_gemm.stream_linear(torch.randn(2, 300), torch.randn(16, 300), None, cfg, 4)
    with pytest.raises(AssertionError, match="x \\(2, 256\\) vs weight"):
        stream_gemm.stream_linear(torch.randn(2, 256), torch.randn(16, 512), None, cfg, 4)
    with pytest.raises(AssertionError, match="programmatic dependent launch needs compiled kernels"):
        stream_gemm.stream_linear(torch.randn(2, 256), torch.randn(16, 256), None,
                                  stream_gemm.StreamConfig(pdl=True), 4)
    assert stream_gemm.stream_linear(torch.randn(0, 256), torch.randn(16, 256), None, cfg, 4).shape == (0, 16)
