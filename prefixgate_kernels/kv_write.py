"""write_kv (reshape_and_cache): scatter new tokens' K/V into their cache slots, quantizing on the way.

One program per token writes all its KV heads for both K and V::

    key[t] : [Hkv, D]  --slot_mapping[t] = block * block_size + slot-->  k_cache[block, slot] : [Hkv, D]
    slot_mapping[t] < 0  -> the token is skipped (padding)

Quantization matches ``prefixgate_kernels.reference.quantize``: fp8 divides by the per-tensor scale and
clamps to +-448; int8 takes one scale per (token, head) = max|x| / 127 (at least 1e-8 / 127),
rounds half to even and stores the scale at [block, slot, head].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import interpreting, kv_code, next_pow2, scale_args


@triton.jit
def _round_half_even(x):
    # torch.round rounds halves to even; floor(x + 0.5) would not, so resolve exact halves by parity.
    f = tl.floor(x)
    diff = x - f
    f_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (diff > 0.5) | ((diff == 0.5) & f_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _round_to_e4m3(y):
    # Round-to-nearest-even onto the e4m3 grid in fp32 (|y| <= 448 already). Only used in the
    # interpreter: its fp32->fp8 cast rounds halves away from zero, drops the carry into the next
    # binade (31.64 -> 16) and flushes subnormals; casting an exactly representable value is right.
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(y), 1e-30))), -6.0)  # subnormals share the 2^-6 binade's quantum
    quantum = tl.exp2(e - 3.0)  # 3 mantissa bits
    return _round_half_even(y / quantum) * quantum


@triton.jit
def _quantize_store(
    x,  # [HEADS_PAD, D] as loaded (key/value dtype)
    cache_ptr, scale_ptr, block, slot, heads, d, mask,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
    KV_QUANT: tl.constexpr,
    SOFT_FP8: tl.constexpr,
):
    dst = cache_ptr + block * stride_cb + slot * stride_cs + heads[:, None] * stride_ch + d[None, :]
    if KV_QUANT == 0:
        # Direct cast, no fp32 detour: same dtype is then bit-exact everywhere.
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
    elif KV_QUANT == 1:
        y = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if SOFT_FP8:
            y = _round_to_e4m3(y)
        tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), 1)  # [HEADS_PAD]
        s = tl.math.div_rn(tl.maximum(amax, 1e-8), tl.full(amax.shape, 127.0, tl.float32))
        y = _round_half_even(tl.math.div_rn(x, s[:, None]))
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        tl.store(dst, y.to(tl.int8), mask=mask)
        head_ok = tl.max(mask.to(tl.int32), 1) > 0
        tl.store(scale_ptr + block * stride_sb + slot * stride_ss + heads * stride_sh, s, mask=head_ok)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [NB, BS, Hkv, D] (strided)
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64
    k_scale_ptr,  # fp8: [1]; int8: [NB, BS, Hkv]
    v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_sb, stride_ss, stride_sh,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    SOFT_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot_id = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot_id < 0:
        return
    block = slot_id // BLOCK_SIZE
    slot = slot_id % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    mask = (heads < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    _quantize_store(k, k_cache_ptr, k_scale_ptr, block, slot, heads, d, mask,
                    stride_kcb, stride_kcs, stride_kch, stride_sb, stride_ss, stride_sh, KV_QUANT, SOFT_FP8)
    _quantize_store(v, v_cache_ptr, v_scale_ptr, block, slot, heads, d, mask,
                    stride_vcb, stride_vcs, stride_vch, stride_sb, stride_ss, stride_sh, KV_QUANT, SOFT_FP8)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], any block stride
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Launch the scatter. Inputs are checked by ``prefixgate_kernels.triton_ops``."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    code = kv_code(k_cache)
    ks, vs, sc_strides = scale_args(k_cache, k_scale, v_scale)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *sc_strides,
        HEADS=kv_heads, HEADS_PAD=next_pow2(kv_heads), HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        KV_QUANT=code, SOFT_FP8=interpreting(), num_warps=4,
    )
