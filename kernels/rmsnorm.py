"""RMSNorm with the residual add fused in: one read of the step's hidden state instead of ~8 kernels.

One program per token row ``[H]`` (H = hidden size, 4,096 for Llama-8B: the whole row in registers)::

    residual[t] = residual[t] + x[t]           (rounded to residual's dtype, written in place)
    out[t]      = weight * (residual[t] / rms(residual[t]))    (fp32 statistics, scaled in x's dtype)

The roundings are those of ``kernels.reference.add_rms_norm`` (transformers' order): the sum is
rounded to the compute dtype before the statistics, the normalised row is rounded before the
weight multiply, and that product is rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H], read and rewritten in place when HAS_RESIDUAL
    w_ptr,  # [H]
    out_ptr,  # [T, H]
    stride_x, stride_r, stride_o,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    y = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if tokens == 0:
        return out
    block = next_pow2(hidden)
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(tokens,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> normalised [T, H]. Inputs are checked by ``kernels.triton_ops``."""
    return _launch(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, -> rms_norm(residual) [T, H]. Inputs are checked by ``kernels.triton_ops``."""
    return _launch(x, residual, weight, eps)
