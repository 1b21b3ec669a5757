"""A tiled GEMM for prefill-sized row counts, ``x [M, K] @ weight[N, K].T -> [M, N]``.

cuBLAS picks one tile shape per problem from its heuristics, and for some of a prefill chunk's
projections that shape leaves SMs idle or pads rows: the prefix hit's 512-row step of the
Llama-8B shape spends 1.18 ms of its 17 ms in 32 launches of one projection at ~465 TFLOP/s where
its other GEMMs run at 800-850 (the engine benchmark's hit profile, session 20). This kernel is
the plain Hopper form (wgmma through Triton's pipeliner, tiles in L2-friendly groups of rows) with
the tile shape a caller chooses, so that a shape cuBLAS serves badly can be served by a measured one.

The accumulator is fp32 and the output is rounded once to the input dtype, as cuBLAS does; K must
be a multiple of ``block_k`` (every Llama projection's K is a multiple of 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import cdiv
from prefixgate_kernels._dot import exact_dot_acc

_DOT_TY = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles per group: consecutive programs share a column tile of the weight in L2


@triton.jit
def _tiled_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, DOT_TY: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles run over one column tile before the next (its weight stays in L2)
    per_group = GROUP_M * tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc = exact_dot_acc(a, tl.trans(b), acc, DOT_TY)  # fp32 operands stay IEEE, not TF32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tiles: GemmTiles) -> torch.Tensor:
    """``x @ weight.T`` with the given tiles. x [M, K] and weight [N, K] of one 16-bit (or fp32) dtype,
    rows contiguous, K a multiple of ``tiles.block_k``."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight rows must be contiguous")
    if x.dtype not in _DOT_TY or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float16 / bfloat16 / float32 dtype, got {x.dtype} and {weight.dtype}")
    if k % tiles.block_k:
        raise ValueError(f"K = {k} is not a multiple of block_k = {tiles.block_k}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n),)
    _tiled_gemm_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                             BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                             GROUP_M=tiles.group_m, DOT_TY=_DOT_TY[x.dtype], num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return y
