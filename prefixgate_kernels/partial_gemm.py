"""The decode step's o and down projections as split-K GEMMs whose sum is left to the next kernel.

At 1-32 rows cuBLAS runs ``x @ W.T`` for the o (4096 x 4096) and down (4096 x 14336) projections
of a Llama-8B layer as a split-K GEMM plus a second kernel that sums the splits' fp32 partials
(``splitKreduce_kernel``): 64 of a decode step's 366 kernels. The sum can instead happen in the
kernel that reads the projection's output anyway, the residual add + RMSNorm
(``prefixgate_kernels/rmsnorm.py``): ``linear_partials`` cuts K into ``SLICES`` slices and runs them as one
strided batched GEMM with fp32 outputs (``torch.bmm(..., out_dtype=float32)``, views of x and W,
no copy), returning the [S, M, N] partials. Measured on the H200 (session 16 call 2, 32 layers of
o + down in one CUDA graph): 1.386 -> 1.278 ms at M = 1 (4 slices), 1.453 -> 1.304 at M = 8,
1.512 -> 1.354 at M = 32; cuBLAS picks the same tile shapes as for its split-K kernels, without
the reduce.

Where it does not apply (more than ``MAX_ROWS`` rows, a bias, fp32 operands, K not cut into
16-element-aligned slices) ``linear_partials`` returns the plain [M, N] product: the consumer takes
either (``add_rms_norm`` sums a 3-D input over its first dimension).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_ROWS = 32  # measured at 1, 8 and 32 rows; above that the step runs F.linear as before
SLICES = 4  # the fastest at M = 1 (1.278 ms against 1.323 for 2 and 1.295 for 8), equal to 2 at 8 and 32


def slices_for(rows: int, k: int, dtype: torch.dtype, has_bias: bool, on_cuda: bool) -> int:
    """How many K slices ``linear_partials`` cuts an [rows, k] x [n, k]^T product into (1: none)."""
    if not on_cuda or has_bias or dtype not in (torch.bfloat16, torch.float16) or not 0 < rows <= MAX_ROWS:
        return 1
    if k % (SLICES * 16):
        return 1
    return SLICES


def sliced_partials(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T as ``slices`` fp32 partials [S, M, N] whose sum is the product.
    The slices are views (x as [S, M, K/S], W as [S, K/S, N]); on CUDA one batched GEMM writes fp32
    directly, elsewhere the operands are upcast first (the CPU reference)."""
    m, k = x.shape
    n = weight.shape[0]
    xs = x.view(m, slices, k // slices).transpose(0, 1)  # [S, M, K/S]
    ws = weight.view(n, slices, k // slices).permute(1, 2, 0)  # [S, K/S, N]
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())


def linear_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """The partials [S, M, N] where ``slices_for`` cuts the product and both operands are contiguous of
    one dtype (the slices are views), else ``linear(x, weight, bias)`` [M, N]: the one policy the
    reference ops and the Triton ops share."""
    slices = slices_for(x.shape[0], x.shape[1], x.dtype, bias is not None, x.is_cuda)
    if slices == 1 or weight.dtype != x.dtype or not (x.is_contiguous() and weight.is_contiguous()):
        return linear(x, weight, bias)
    return sliced_partials(x, weight, slices)


def summed(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The product K-slice partials [S, M, N] stand for: their fp32 sum slice by slice, in order, rounded once to
    ``dtype`` (the order the kernels that read partials sum them in)."""
    acc = parts[0].clone()
    for s in range(1, parts.shape[0]):
        acc += parts[s]
    return acc.to(dtype)
