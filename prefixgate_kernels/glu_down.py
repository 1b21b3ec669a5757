"""The decode step's down projection with SiLU(gate) * up applied as it loads its operand.

A Llama MLP at decode runs three kernels after the norm: the gate|up GEMM, ``silu_mul`` (one small
launch a layer: ~1.5 us of work and its launch inside the CUDA graph, 32 a step) and the down GEMM,
whose split-K fp32 partials the next add + RMSNorm sums (``prefixgate_kernels/partial_gemm.py``).
Here the down GEMM reads the gate|up output itself and forms each K slice of the activation in
registers before its dot, so the activation never goes through memory and ``silu_mul``'s launch
goes::

    grid = (N / BLOCK_N, SPLIT_K)         program (n, s): out columns [n*BN, (n+1)*BN), K range s
                                          (the launcher's SPLIT_K is 1: whole-K programs, session 8)
    for each BLOCK_K slice of its range:  act = silu(gate) * up  [M, BK]  (gate_up's two halves)
                                          w tile [BN, BK] (streamed once, pipelined) . act
    fp32 partials [SPLIT_K, M, N]          summed by ``add_rms_norm``, like ``linear_partials``'

The roundings are ``silu_mul``'s (silu in fp32 rounded to the compute dtype, the product rounded
again), so the activation is bit for bit the one the two-kernel path multiplies; only the GEMM's
summation order differs from cuBLAS's. Every N tile recomputes its rows' activation (M x I
exponentials per tile): free at a few rows, which is where the kernel is meant to run
(``MAX_ROWS``; whether the engine takes it: ``mlp_fusion``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import cdiv, interpreting, next_pow2

MAX_ROWS = 16  # the rows a launch may take: one 16-row MMA tile (more double the gate and up tiles)


@dataclass(frozen=True)
class GluDownConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _glu_down_kernel(
    gu_ptr,  # [M, 2I]: gate | up
    w_ptr,  # [N, I] (rows contiguous)
    part_ptr,  # [SPLIT_K, M, N] fp32
    M, N, INTER, K_SPLIT,
    stride_gm, stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_TY: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_k * K_SPLIT
    g_ptrs = gu_ptr + rm[:, None] * stride_gm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_lo + rk)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        gate = tl.load(g_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        up = tl.load(g_ptrs + INTER, mask=m_ok[:, None], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        # silu_mul's roundings: silu rounded to the operand dtype, then the product rounded
        act = (gate / (1.0 + tl.exp(-gate))).to(gu_ptr.dtype.element_ty).to(tl.float32)
        act = (act * up).to(gu_ptr.dtype.element_ty)
        acc += tl.dot(act.to(DOT_TY), tl.trans(w.to(DOT_TY)))
        g_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(part_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)


def choose_config(m: int, n: int, k: int, num_sms: int, max_rows: int = MAX_ROWS) -> GluDownConfig | None:
    """Tiles for silu_mul(gate_up [m, 2k]) x [n, k]^T, or None where the kernel does not apply (no
    rows, too many, K not a multiple of the K tile). Shapes only, so it is CUDA-graph safe.

    Session 8's weight-streaming chain tiles (``benchmarks/kernels.py`` ``pdl_gemm_config``): each
    program takes the whole K range (one partial), 256-wide K slices, and the widest of 64 / 32 / 16
    output columns that still gives two programs an SM (the down projection of a Llama-8B layer: 16,
    256 programs). A stage holds the weight tile and the gate and up tiles of 16 padded rows (16
    columns: 8 + 16 KiB), so four stages keep two programs on an SM."""
    block_k = 256
    if not 0 < m <= max_rows or k % block_k:
        return None
    block_n = next((b for b in (64, 32) if cdiv(n, b) >= 2 * num_sms), 16)
    return GluDownConfig(block_n, block_k, split_k=1, num_stages=4 if block_n == 16 else 3)


def silu_mul_partials(gate_up: torch.Tensor, weight: torch.Tensor, config: GluDownConfig) -> torch.Tensor:
    """silu(gate) * up of ``gate_up`` [M, 2I] times weight[N, I].T as fp32 partials [SPLIT_K, M, N]
    whose sum is the product. Inputs are checked by ``prefixgate_kernels.triton_ops``."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    n = weight.shape[0]
    split = config.split_k
    assert inter % (config.block_k * split) == 0, f"I={inter} must split into {split} x {config.block_k}-wide slices"
    part = torch.empty((split, m, n), dtype=torch.float32, device=gate_up.device)
    if m == 0:
        return part
    dot_ty = tl.float32 if interpreting() or gate_up.dtype == torch.float32 else (
        tl.bfloat16 if gate_up.dtype == torch.bfloat16 else tl.float16)
    _glu_down_kernel[(cdiv(n, config.block_n), split)](
        gate_up, weight, part, m, n, inter, inter // split, gate_up.stride(0), weight.stride(0),
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_TY=dot_ty,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return part
