"""The decode step's gate|up projection with SiLU(gate) * up applied as it stores its output.

Each program computes a 16-64 column tile of the gate and the same columns of the up projection from one
read of the input rows, and its epilogue stores silu(gate) * up [M, I] instead of the [M, 2I]
gate|up output, so ``silu_mul``'s launch and the 2I-wide intermediate go::

    grid = (I / BLOCK_N,)                 program n: act columns [n*BN, (n+1)*BN), the whole K range
    for each BLOCK_K slice of K:          x tile [M, BK] . gate rows [BN, BK], up rows [BN, BK]
    act = silu(gate) * up                 silu_mul's roundings, on gate and up rounded to the dtype

The roundings are the unfused path's: gate and up rounded to the operand dtype as the gate|up GEMM
would have stored them, silu in fp32 rounded, the product rounded. The whole K range in each
program (no split-K: the activation needs the full sums), weight-streaming tiles as
``skinny_gemm``'s chain (session 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import cdiv, interpreting, next_pow2

MAX_ROWS = 32  # the rows a launch may take (x's tile is the only part that grows with them)
# Rows up to which ``prefixgate_kernels.triton_ops.mlp_partials`` (the engine's MLP) takes this kernel;
# 0: gate|up through cuBLAS, then silu_mul. Measured on the H200 (docs/gpu.md, session 19): 32 layers of
# gate|up + SiLU in a graph 57.8 against 62.7 us a layer at 1 row, 58.4 / 59.6 at 8, 58.6 / 60.1 at 16.
ENGINE_MAX_ROWS = 16


@dataclass(frozen=True)
class GateUpConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [2I, K]: gate rows, then up rows (rows contiguous)
    out_ptr,  # [M, I]
    M, INTER, K,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_TY: tl.constexpr,
    PDL: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    if LAUNCH_DEPENDENTS:
        # the down projection after it, launched with PDL (``gemv_pdl``), may take the SMs this grid's last
        # programs leave and put its first weight tiles in flight before it waits for our writes
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < INTER
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    g_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    u_ptrs = g_ptrs + INTER.to(tl.int64) * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PDL:
        # launched with programmatic dependent launch under the kernel that writes x (a norm that lets it
        # start at once): the first K slice's weights, which depend on nothing, are loaded before the wait
        # for that kernel's writes, so they stream under it
        wg = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0).to(DOT_TY)
        wu = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0).to(DOT_TY)
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0).to(DOT_TY)
        acc_g += tl.dot(x, tl.trans(wg))
        acc_u += tl.dot(x, tl.trans(wu))
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    for _ in range(BLOCK_K if PDL else 0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0).to(DOT_TY)
        wg = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0).to(DOT_TY)
        wu = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0).to(DOT_TY)
        acc_g += tl.dot(x, tl.trans(wg))
        acc_u += tl.dot(x, tl.trans(wu))
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # the unfused path's roundings: gate|up stored in the dtype, silu rounded, the product rounded
    gate = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def choose_config(m: int, inter: int, k: int, num_sms: int, max_rows: int = MAX_ROWS) -> GateUpConfig | None:
    """Tiles for x [m, k] against gate|up [2 * inter, k], or None where the kernel does not apply (no
    rows, too many, K not a multiple of the K tile). Shapes only, so it is CUDA-graph safe.

    256-wide K slices, and the widest of 64 / 32 / 16 columns a half that still gives two programs an
    SM (a Llama-8B layer, I = 14,336: 32, 448 programs); a stage holds two weight tiles and the x tile."""
    block_k = 256
    if not 0 < m <= max_rows or k % block_k:
        return None
    block_n = next((b for b in (64, 32) if cdiv(inter, b) >= 2 * num_sms), 16)
    return GateUpConfig(block_n, block_k, num_stages=3 if block_n > 16 else 4)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, config: GateUpConfig, pdl: bool = False,
                 launch_dependents: bool = False) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for ``weight`` [2I, K] = gate rows | up rows -> [M, I] in x's dtype.
    Inputs are checked by ``prefixgate_kernels.triton_ops``. ``pdl``: launched with programmatic dependent
    launch, the first K slice's weights loaded before it waits for the kernel that writes x (which must
    let it launch: ``rmsnorm.add_rms_norm(..., launch_dependents=True)``). ``launch_dependents``: each
    program lets a kernel launched after it with PDL start (that kernel must wait for these writes, as
    ``gemv_pdl`` does). Compiled kernels only, the interpreter launches it as usual."""
    m, k = x.shape
    inter = weight.shape[0] // 2
    assert k % config.block_k == 0, f"K={k} must be a multiple of {config.block_k}"
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dot_ty = tl.float32 if interpreting() or x.dtype == torch.float32 else (
        tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    pdl = pdl and not interpreting()
    launch = {"launch_pdl": True} if pdl else {}
    _gate_up_silu_kernel[(cdiv(inter, config.block_n),)](
        x, weight, out, m, inter, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_TY=dot_ty, PDL=pdl,
        LAUNCH_DEPENDENTS=launch_dependents and not interpreting(), num_warps=config.num_warps,
        num_stages=config.num_stages, **launch,
    )
    return out
