"""RMSNorm with the residual add fused in: one read of the step's hidden state instead of ~8 kernels.

One program per token row ``[H]`` (H = hidden size, 4,096 for Llama-8B: the whole row in registers)::

    residual[t] = residual[t] + x[t]           (rounded to residual's dtype, written in place)
    out[t]      = weight * (residual[t] / rms(residual[t]))    (fp32 statistics, scaled in x's dtype)

The roundings are those of ``prefixgate_kernels.reference.add_rms_norm`` (transformers' order): the sum is
rounded to the compute dtype before the statistics, the normalised row is rounded before the
weight multiply, and that product is rounded once more.

``x`` may also be a projection's split-K partials, fp32 ``[S, T, H]`` (``prefixgate_kernels/partial_gemm.py``):
the program sums its row's S partials in fp32 and rounds the sum to the residual's dtype, which is
what the projection would have returned, before the add. That saves the projection its own reduce
kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import interpreting, next_pow2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, H] (PARTIALS = 0), or fp32 partials [PARTIALS, T, H] to be summed
    res_ptr,  # [T, H], read and rewritten in place when HAS_RESIDUAL
    w_ptr,  # [H]
    out_ptr,  # [T, H]
    stride_x, stride_r, stride_o,
    stride_part,  # elements between two partials (PARTIALS > 0)
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    PARTIALS: tl.constexpr,
    BLOCK: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
    WAIT: tl.constexpr = False,
):
    if LAUNCH_DEPENDENTS and not WAIT:
        # a kernel launched after this one with PDL may start now (it waits for our writes)
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # The weight first, with the row's own loads: placed after the sum of squares (where it is used), it
    # was issued only after that reduction's barrier (the compiled PTX showed the load after bar.sync), a
    # second memory round trip; measured in session 26: ~0.1 us a norm on the H100.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WAIT:
        # launched with PDL under the projection that writes x (``gemv_pdl`` lets it launch once its own wait
        # returns): the weight, which no kernel writes, is in flight; x and the residual only after this
        # returns, when that kernel has finished and its writes are visible
        tl.extra.cuda.gdc_wait()
        if LAUNCH_DEPENDENTS:
            # launched early ourselves, we let the next kernel launch only once our wait has returned, not
            # while the projection before us still streams (grids parked beside a running one: docs/gpu.md,
            # session 12)
            tl.extra.cuda.gdc_launch_dependents()
    if PARTIALS > 0:  # the projection's output is the sum of its slices, rounded as it would have been
        acc = tl.zeros([BLOCK], tl.float32)
        for p in tl.static_range(PARTIALS):
            acc += tl.load(x_ptr + p * stride_part + row * stride_x + cols, mask=mask, other=0.0)
        x = acc.to(res_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    y = (x32 * inv_rms).to(res_ptr.dtype.element_ty).to(tl.float32)  # the row's dtype (res is x without one)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            launch_dependents: bool = False, pdl: bool = False) -> torch.Tensor:
    # partials (fp32, any count, one included) are summed and rounded to the residual's dtype, the row's
    partials = x.shape[0] if x.dim() == 3 else 0
    row_dtype = x.dtype
    if partials:
        assert residual is not None  # partials come through add_rms_norm alone: summed into its residual
        row_dtype = residual.dtype
    tokens, hidden = x.shape[-2:]
    out = torch.empty((tokens, hidden), dtype=torch.promote_types(row_dtype, weight.dtype), device=x.device)
    if tokens == 0:
        return out
    block = next_pow2(hidden)
    res = residual if residual is not None else x
    pdl = pdl and not interpreting()
    launch = {"launch_pdl": True} if pdl else {}
    _add_rms_norm_kernel[(tokens,)](
        x, res, weight, out, x.stride(-2), res.stride(0), out.stride(0), x.stride(0) if partials else 0,
        hidden, eps, HAS_RESIDUAL=residual is not None, PARTIALS=partials, BLOCK=block,
        LAUNCH_DEPENDENTS=launch_dependents and not interpreting(), WAIT=pdl,
        num_warps=max(1, min(16, block // 256)), **launch,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> normalised [T, H]. Inputs are checked by ``prefixgate_kernels.triton_ops``."""
    return _launch(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 launch_dependents: bool = False, pdl: bool = False) -> torch.Tensor:
    """``residual += x`` in place (x [T, H], or fp32 partials [S, T, H] summed first), -> rms_norm(residual)
    [T, H]. Inputs are checked by ``prefixgate_kernels.triton_ops``. ``launch_dependents``: the program
    lets a kernel launched after it with programmatic dependent launch start at once (``gate_up_silu``'s
    ``pdl``). ``pdl``: launched with programmatic dependent launch, the weight loaded before it waits for the
    kernel before it (which gains only if that kernel lets it launch early: ``gemv_pdl``'s
    ``launch_dependents``; correct after any kernel). Both are scheduling hints the interpreter ignores."""
    return _launch(x, residual, weight, eps, launch_dependents, pdl)
