"""``x @ w.T`` for a decode step's few rows as a persistent weight stream (an experiment, session 8).

Why: on the H200 one cuBLAS GEMM streams a decode step's 14 GB of weights at 96-101 % of copy
bandwidth, but the step's 128 GEMMs one after another reach 81-86 %: each kernel boundary costs
~7 us at M = 1 while a grid ramps up and drains (``benchmarks/kernels.py --gemm-only``, docs/gpu.md
"Session 8"). Letting the next grid launch early with programmatic dependent launch (PDL) in
``kernels.skinny_gemm`` lost 20 points instead: its programs (one per 16-64 output rows, up to
1,792 of them) took whatever SM slots were free when they launched and streamed from there.

This kernel keeps PDL but fixes where the next grid runs: ``NUM_PROGRAMS`` programs (one or two per
SM) loop over the row tiles ``pid, pid + NUM_PROGRAMS, ...``, the whole K range each, in one
flattened loop so the copies stay pipelined across tiles. A program first lets the next grid launch
(``griddepcontrol.launch_dependents``: the next grid's programs, as few as this one's, take the
slots left beside them), asks L2 for the first ``prefetch_lines`` 128-byte lines of its first
tile's weight rows (weights never depend on the previous kernel), and only then waits for the
previous grid (``griddepcontrol.wait``) before it reads ``x``::

    program p:  launch_dependents; prefetch rows of tile p; wait
                for tile in p, p + P, ...:  acc = x[M, K] . w[tile rows, K]^T  (BLOCK_K slices); store

Rows are padded to 16 (the tensor-core minimum): at M <= 32 the arithmetic is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._common import interpreting, next_pow2

MAX_ROWS = 32  # a weight stream: above this the tiles of a real GEMM amortise the weight read


@dataclass(frozen=True)
class StreamConfig:
    block_n: int = 16  # output rows (weight rows) per tile
    block_k: int = 256
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 4
    pdl: bool = False  # programmatic dependent launch (CUDA sm_90+, compiled kernels only)
    prefetch_lines: int = 0  # with pdl: 128-byte lines of each first-tile weight row put in L2 before the wait


@triton.jit
def _stream_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (rows contiguous)
    bias_ptr,  # [N] or placeholder
    out_ptr,  # [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    DOT_TY: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH_LINES: tl.constexpr = 0,
    LINE_ELEMS: tl.constexpr = 64,  # weight elements in a 128-byte line
):
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(N, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    if PDL:
        gdc_launch_dependents()
        if PREFETCH_LINES > 0:
            # rows clamped into the matrix (a prefetch must name a valid address); a program with no
            # tile prefetches the last rows again, harmlessly
            rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
            lines = tl.arange(0, PREFETCH_LINES) * LINE_ELEMS
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                      [w_ptr + rows[:, None] * stride_wn + lines[None, :]],
                                      dtype=tl.int32, is_pure=False, pack=1)
        gdc_wait()
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=True):
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        w_row = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k + rk)[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_row + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc += tl.dot(x.to(DOT_TY), tl.trans(w.to(DOT_TY)))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: StreamConfig,
                  num_sms: int) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] in x's dtype, M <= MAX_ROWS, K a multiple of
    ``config.block_k``; ``num_sms`` sizes the persistent grid (CUDA-graph safe: shapes only)."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert m <= MAX_ROWS, f"{m} rows: a weight stream is for at most {MAX_ROWS}"
    assert k % config.block_k == 0, f"K={k} must be a multiple of block_k={config.block_k}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "rows of x and weight must be contiguous"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dot_ty = tl.float32 if interpreting() or x.dtype == torch.float32 else (
        tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    programs = max(1, min(triton.cdiv(n, config.block_n), num_sms * config.programs_per_sm))
    pdl = {}
    if config.pdl:
        assert not interpreting() and x.is_cuda, "programmatic dependent launch needs compiled kernels on CUDA"
        line_elems = 128 // weight.element_size()
        lines = config.prefetch_lines
        assert lines == 0 or (lines & (lines - 1) == 0 and lines * line_elems <= k), \
            f"prefetch_lines={lines}: a power of two within a weight row"
        pdl = {"PDL": True, "PREFETCH_LINES": lines, "LINE_ELEMS": line_elems, "launch_pdl": True}
    b = bias if bias is not None else out
    _stream_kernel[(programs,)](
        x, weight, b, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(16, next_pow2(m)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_PROGRAMS=programs, DOT_TY=dot_ty, num_warps=config.num_warps, num_stages=config.num_stages, **pdl,
    )
    return out
