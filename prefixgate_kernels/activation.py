"""SiLU(gate) * up over a merged gate/up projection's output: one pass instead of three kernels.

    gate_up [T, 2I] = [ gate (I columns) | up (I columns) ]  ->  out [T, I]

Roundings as ``prefixgate_kernels.reference.silu_mul`` (torch's bf16 ops): silu in fp32 rounded to the
compute dtype, then the product rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import cdiv

_BLOCK = 1024  # columns per program: 2 KiB of bf16 per operand, four 16-byte loads per thread at 4 warps


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> [T, I]. Inputs are checked by ``prefixgate_kernels.triton_ops``."""
    tokens, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    _silu_mul_kernel[(tokens, cdiv(inter, _BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=_BLOCK, num_warps=4,
    )
    return out
