"""``x @ w.T`` for the few-row activations of a decode step: a weight-streaming GEMM.

A decode step multiplies M <= 32 rows by every weight matrix once, so each GEMM is a pass over its
weight bytes (qkv 48 MiB, o 32 MiB, gate|up 224 MiB, down 112 MiB per Llama-8B layer). cuBLAS runs
these at 41-79% of copy bandwidth on the H200 (session 2, run 2: o 41%, qkv 50%, down 64%, gate|up
78%); the weight read is what the hardware bounds, so the kernel is built around it (an experiment:
not yet faster than cuBLAS in the engine, see ``ENGINE_MAX_ROWS``)::

    grid = (N / BLOCK_N, SPLIT_K)        program (n, s): out columns [n*BN, (n+1)*BN), K range s of SPLIT_K
    for each BLOCK_K slice of its range:  w tile [BN, BK] (streamed once, pipelined) . x tile [M, BK]
    SPLIT_K == 1: bf16 out (+ bias);  > 1: fp32 partials [S, M, N], then a reduce kernel sums them

The rows are padded to 16 (the tensor-core minimum): at M <= 32 the arithmetic is free. SPLIT_K
gives a small matrix enough programs to keep every SM streaming (``choose_config``).

Programmatic dependent launch (``SkinnyConfig.pdl``, Hopper and later, compiled only): the H200
streams a decode step's weights at 96-101 % of copy bandwidth in one GEMM but at 83-86 % as the
step's 128 GEMMs (session 8, ``benchmarks/kernels.py --gemm-only``): each kernel boundary idles the
memory system for its ramp and tail. A weight read does not depend on the previous kernel, so with
``pdl`` a program lets the next kernel launch (``griddepcontrol.launch_dependents``, at its start or
after its weight loop) and waits for the previous kernel's writes (``griddepcontrol.wait``) before it
reads ``x``. Measured on the H200 (session 8, the 128-GEMM chain at M = 1): 83 % of copy without PDL,
83 % with the next grid launched after the weight loop, 64 % launched at the start (an L2 prefetch of
the first weight lines before the wait, and no explicit trigger, changed nothing and were dropped).
Session 12 launched the next grid right after each program's wait had returned, so that no more than
one grid waits behind a running one: 63 % again, with or without the L2 prefetch (in the tree at
5ef5902): any grid launched early slows the one it waits on. So PDL stays an option of this
experiment, measured by ``benchmarks/kernels.py --gemm-only``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from prefixgate_kernels._common import cdiv, interpreting, next_pow2

MAX_ROWS = 32  # above this cuBLAS's tiles amortise the weight read well enough
# Rows up to which ``prefixgate_kernels.triton_ops.linear`` (the engine's fused path) takes this kernel,
# at ``chain_config``'s tiles: 0, off.
# Measured on the H200 inside the engine's CUDA graphs (session 2, run 3): the 8B decode step's GPU
# time at batch 32 rose from 7.68 ms (cuBLAS) to 8.97 ms, at batch 1 from 4.87 to 5.45 ms, with the
# untuned 64 x 256 tiles. Session 19 (``chain_config``'s tiles, at <= 16 rows, where a decode step's only
# ``linear`` is q|k|v): +0.02 to +0.06 ms a step at batch 1 and 8 (benchmarks/engine_gpu.py --sections
# decode_skinny). benchmarks/kernels.py keeps measuring it (decode_gemms, graph replays).
ENGINE_MAX_ROWS = 0


class LaunchNext(enum.IntEnum):
    """With programmatic dependent launch: where a program lets the next grid launch. The next
    grid's programs take free SM slots from then on and wait there (``griddepcontrol.wait``)."""

    AT_START = 0  # first thing: the next grid may launch as soon as this one's last wave has started
    AFTER_LOOP = 1  # after the weight stream, before the store: as this one drains


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    pdl: bool = False  # launch with programmatic dependent launch (CUDA, sm_90+; see the module doc)
    launch_next: LaunchNext = LaunchNext.AT_START  # with pdl


@triton.jit
def _skinny_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (rows contiguous)
    bias_ptr,  # [N] or placeholder
    out_ptr,  # [M, N]
    part_ptr,  # [SPLIT_K, M, N] fp32 (SPLIT_K > 1)
    M, N, K_SPLIT,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_TY: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = -1,  # LaunchNext with PDL, -1 without
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_k * K_SPLIT
    if TRIGGER == 0:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()  # x is the previous kernel's output
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_lo + rk)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0).to(DOT_TY)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0).to(DOT_TY)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if TRIGGER == 1:
        gdc_launch_dependents()
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)


@triton.jit
def _split_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                         SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + rn, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


def choose_config(m: int, n: int, k: int, num_sms: int, max_rows: int = MAX_ROWS) -> SkinnyConfig | None:
    """Tiles for an [m, k] x [n, k]^T product, or None where the kernel does not apply (too many
    rows, K not a multiple of the K tile). Shapes only, so it is CUDA-graph safe.

    64-column tiles of 256-wide K slices (32 KiB of bf16 per stage); SPLIT_K is the smallest divisor
    of the K slices that gives at least two programs per SM, at most 8."""
    block_n, block_k = 64, 256
    if m > max_rows or k % block_k:
        return None
    return SkinnyConfig(block_n, block_k, split_for(n, k, block_n, block_k, num_sms))


def chain_config(m: int, n: int, k: int, num_sms: int, max_rows: int = MAX_ROWS) -> SkinnyConfig | None:
    """Session 8's tiles for a GEMM among a decode step's others, which ``triton_ops.linear`` takes up to
    ``ENGINE_MAX_ROWS`` rows: whole-K programs (no reduce kernel: one boundary a GEMM), the widest of
    64 / 32 / 16 output columns that still gives two programs an SM, 256-wide K slices, three stages
    at 64 columns and four otherwise (two programs an SM either way). None where the kernel does not
    apply. ``gate_up_silu`` streams the gate|up projection with the same layout at 96 % of copy."""
    block_k = 256
    if not 0 < m <= max_rows or k % block_k:
        return None
    block_n = next((b for b in (64, 32) if cdiv(n, b) >= 2 * num_sms), 16)
    return SkinnyConfig(block_n, block_k, 1, num_stages=3 if block_n == 64 else 4)


def split_for(n: int, k: int, block_n: int, block_k: int, num_sms: int, max_split: int = 8) -> int:
    """The smallest SPLIT_K dividing the K slices with >= 2 programs per SM (else the largest <= max_split)."""
    tiles, slices = cdiv(n, block_n), k // block_k
    split = 1
    for s in range(1, max_split + 1):
        if slices % s == 0:
            split = s
            if tiles * s >= 2 * num_sms:
                break
    return split


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] in x's dtype. Inputs are checked by ``prefixgate_kernels.triton_ops``."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    split = config.split_k
    assert k % (config.block_k * split) == 0, f"K={k} must split into {split} x {config.block_k}-wide slices"
    dot_ty = tl.float32 if interpreting() or x.dtype == torch.float32 else (
        tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else out
    pdl = {}
    if config.pdl:
        assert not interpreting() and x.is_cuda, "programmatic dependent launch needs compiled kernels on CUDA"
        pdl = {"PDL": True, "TRIGGER": int(config.launch_next), "launch_pdl": True}
    _skinny_kernel[(cdiv(n, config.block_n), split)](
        x, weight, b, out, part, m, n, k // split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(16, next_pow2(m)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, DOT_TY=dot_ty, num_warps=config.num_warps, num_stages=config.num_stages, **pdl,
    )
    if split > 1:
        _split_reduce_kernel[(m, cdiv(n, 1024))](part, b, out, m, n, out.stride(0), HAS_BIAS=bias is not None,
                                                         SPLIT_K=split, BLOCK=1024, num_warps=4)
    return out
