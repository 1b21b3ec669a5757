"""Small helpers shared by the Triton launchers: dtype codes, interpreter detection, checks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from prefixgate_kernels.reference import FP8_DTYPE

if TYPE_CHECKING:  # triton loads where a launcher first needs it
    import triton.language as tl

# KV storage codes, passed to kernels as a constexpr so each storage format compiles its own variant.
KV_PLAIN, KV_FP8, KV_INT8 = 0, 1, 2

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    The interpreter returns garbage for ``tl.dot`` on bf16 operands (seen on triton 3.9: max error
    2.5e10 on a 16x16 product), so kernels upcast their dot operands to fp32 when this is set.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kv_code(cache: torch.Tensor) -> int:
    return kv_code_for(cache.dtype)


def kv_code_for(dtype: torch.dtype) -> int:
    if dtype == FP8_DTYPE:
        return KV_FP8
    if dtype == torch.int8:
        return KV_INT8
    return KV_PLAIN


def check_paged_cache(name: str, cache: torch.Tensor, device: torch.device) -> None:
    """cache: [num_blocks, block_size, kv_heads, head_dim], any block stride, head_dim contiguous."""
    assert cache.dim() == 4, f"{name} must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(cache.shape)}"
    assert cache.device == device, f"{name} is on {cache.device}, expected {device}"
    assert cache.stride(3) == 1, f"{name}'s head_dim must be contiguous (stride 1), got strides {cache.stride()}"
    assert cache.dtype in (*ATTN_DTYPES, FP8_DTYPE, torch.int8), f"{name} has unsupported dtype {cache.dtype}"


def check_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """Scale conventions of prefixgate_kernels.reference: fp8 one scale per tensor, int8 one per (block, slot, head)."""
    code = kv_code(k_cache)
    if code == KV_PLAIN:
        return
    assert k_scale is not None and v_scale is not None, f"a {k_cache.dtype} cache needs k_scale and v_scale"
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert s.dtype == torch.float32, f"{name} must be float32, got {s.dtype}"
        assert s.device == k_cache.device, f"{name} is on {s.device}, expected {k_cache.device}"
        if code == KV_FP8:
            assert s.numel() == 1, f"fp8 {name} must hold one per-tensor scale, got shape {tuple(s.shape)}"
        else:
            want = tuple(k_cache.shape[:3])
            assert tuple(s.shape) == want, f"int8 {name} must be [num_blocks, block_size, kv_heads]={want}, got {tuple(s.shape)}"
    if code == KV_INT8:
        assert k_scale.stride() == v_scale.stride(), "int8 k_scale and v_scale must share strides"


def scale_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """(k scales, v scales, int8 scale strides) as the attention kernels take them: fp8 scales
    flattened to [1], int8 ones as given with their (block, slot, head) strides, a placeholder otherwise."""
    code = kv_code(k_cache)
    if code == KV_FP8:
        assert k_scale is not None and v_scale is not None  # check_kv_scales: a quantized cache has both
        return k_scale.reshape(-1), v_scale.reshape(-1), (0, 0, 0)
    if code == KV_INT8:
        assert k_scale is not None and v_scale is not None
        blocks, slots, heads = k_scale.stride()  # [num_blocks, block_size, kv_heads] (check_kv_scales)
        return k_scale, v_scale, (blocks, slots, heads)
    dummy = placeholder(k_cache.device, torch.float32)
    return dummy, dummy, (0, 0, 0)


_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-element tensor for pointer arguments a kernel variant never reads (cached: no allocation per call)."""
    key = (torch.device(device), dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host ints, for grids and split sizes: ``triton.cdiv`` is a JIT function,
    ~5 us a call from Python on the build machine, a cost every eager launch paid once or more."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_dtype(q_dtype: torch.dtype, cache: torch.Tensor) -> tl.dtype:
    """The tl dtype attention kernels feed to ``tl.dot``.

    fp32 in the interpreter (its bf16 dot is broken); fp16 for fp8/int8 caches, because e4m3 -> fp16
    is one instruction per pair on Hopper while e4m3 -> bf16 goes through fp32 and made fp8 decode
    slower than bf16 (measured, run 1); otherwise q's own dtype.
    """
    return dot_dtype_for(q_dtype, cache.dtype, interpreting())


def dot_dtype_for(q_dtype: torch.dtype, kv_dtype: torch.dtype, interp: bool) -> tl.dtype:
    """``dot_dtype`` from the dtypes alone (a launch plan cached by shapes and dtypes)."""
    import triton.language as tl

    if interp:
        return tl.float32
    if kv_code_for(kv_dtype) != KV_PLAIN:
        return tl.float16
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[q_dtype]



_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a small fake machine so that tests exercise split-KV
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
