"""RoPE on q and k fused with the K/V cache write, straight from a merged q|k|v projection.

One program per token replaces the unfused path's ~10 kernels per layer (two rotations built from
cat / neg / mul / add, two casts, the write_kv scatter)::

    qkv[t] = [ q: Hq x D | k: Hkv x D | v: Hkv x D ]
    q_out[t]            = rope(q)                      -> [T, Hq, D] (contiguous, for attention)
    k_cache[slot(t)]    = quantize(rope(k) - k_bias)   (slot -1: padding, nothing written)
    v_cache[slot(t)]    = quantize(v)

Rotate-half RoPE, as ``prefixgate_kernels.reference.rotary_write_kv``: ``x * cos + rotate_half(x) * sin``
with each product and the sum rounded to x's dtype. ``rotate_half(x)[d]`` is ``-x[d + D/2]`` for
d < D/2 and ``x[d - D/2]`` above, so each head is loaded twice (the second read hits L1/L2) instead
of being split into halves: the whole [heads, D] tile then goes through ``kv_write``'s quantizing
store unchanged (int8 takes its per-head scale over all D).

``k_bias`` [Hkv, D] (optional) is the fp8 calibration's per-channel key mean
(engine/kv_calibration.py): the cache stores ``rope(k) - k_bias``, rounded to the compute dtype
before quantizing, exactly as the plain path's ``k - bias`` in torch. Nothing on the read side
changes: every stored key of a head is shifted by the same vector, so each query's scores move by
one constant ``q . k_bias``, which softmax cancels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import interpreting, kv_code, next_pow2, placeholder, scale_args
from prefixgate_kernels.kv_write import _quantize_store


@triton.jit
def _load_summed(ptrs, mask, slice_stride, SLICES: tl.constexpr, DT: tl.constexpr):
    """The values at ``ptrs``: a plain load where ``SLICES`` is 1, else the fp32 sum of ``SLICES`` split-K
    partials ``slice_stride`` elements apart (``prefixgate_kernels.gemv_pdl``), in order, rounded to ``DT``:
    what the unsliced GEMM would have stored, up to the order of its fp32 sum."""
    if SLICES == 1:
        return tl.load(ptrs, mask=mask, other=0.0)
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SLICES):
        acc += tl.load(ptrs + s * slice_stride, mask=mask, other=0.0)
    return acc.to(DT)


@triton.jit
def _rope_tile(base_ptr, heads, d, mask, cos, sin, HEAD_DIM: tl.constexpr):
    """[HEADS_PAD, D] rotated tile in the input dtype (cos/sin already rounded to it, as fp32)."""
    return _rope_tile_summed(base_ptr, 0, heads, d, mask, cos, sin, HEAD_DIM, 1, base_ptr.dtype.element_ty)


@triton.jit
def _rope_tile_summed(base_ptr, slice_stride, heads, d, mask, cos, sin, HEAD_DIM: tl.constexpr,
                      SLICES: tl.constexpr, DT: tl.constexpr):
    """``_rope_tile`` of rows held as ``SLICES`` fp32 partials (``_load_summed``), in ``DT``."""
    half: tl.constexpr = HEAD_DIM // 2
    x = _load_summed(base_ptr + heads[:, None] * HEAD_DIM + d[None, :], mask, slice_stride, SLICES, DT)
    partner = tl.where(d < half, d + half, d - half)
    xp = _load_summed(base_ptr + heads[:, None] * HEAD_DIM + partner[None, :], mask, slice_stride, SLICES,
                      DT).to(tl.float32)
    xp = tl.where((d < half)[None, :], -xp, xp)
    dt = x.dtype
    a = (x.to(tl.float32) * cos[None, :]).to(dt).to(tl.float32)
    b = (xp * sin[None, :]).to(dt).to(tl.float32)
    return (a + b).to(dt)


@triton.jit
def _rotary_write_kv_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hkv) * D]
    cos_ptr,  # [T, D] fp32
    sin_ptr,
    q_out_ptr,  # [T, Hq, D] contiguous
    k_cache_ptr,  # [NB, BS, Hkv, D] (strided)
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64
    k_scale_ptr,
    v_scale_ptr,
    k_bias_ptr,  # [Hkv, D] contiguous (read when HAS_K_BIAS)
    stride_t, stride_ct, stride_st,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_sb, stride_ss, stride_sh,
    Q_HEADS: tl.constexpr,
    Q_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    HAS_K_BIAS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    row = qkv_ptr + t * stride_t
    dt = qkv_ptr.dtype.element_ty
    # cos/sin rounded to the compute dtype first, like ``cos.to(x.dtype)`` in the reference
    cos = tl.load(cos_ptr + t * stride_ct + d).to(dt).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + d).to(dt).to(tl.float32)

    qh = tl.arange(0, Q_PAD)
    q_mask = (qh < Q_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    q = _rope_tile(row, qh, d, q_mask, cos, sin, HEAD_DIM)
    tl.store(q_out_ptr + t * (Q_HEADS * HEAD_DIM) + qh[:, None] * HEAD_DIM + d[None, :], q, mask=q_mask)

    slot_id = tl.load(slot_mapping_ptr + t)
    if slot_id >= 0:
        block = slot_id // BLOCK_SIZE
        slot = slot_id % BLOCK_SIZE
        kh = tl.arange(0, KV_PAD)
        kv_mask = (kh < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        k = _rope_tile(row + Q_HEADS * HEAD_DIM, kh, d, kv_mask, cos, sin, HEAD_DIM)
        if HAS_K_BIAS:  # torch's ``k - bias.to(k.dtype)``: the bias rounded to k's dtype, one rounding of the difference
            bias = tl.load(k_bias_ptr + kh[:, None] * HEAD_DIM + d[None, :], mask=kv_mask, other=0.0)
            k = (k.to(tl.float32) - bias.to(dt).to(tl.float32)).to(dt)
        v = tl.load(row + (Q_HEADS + KV_HEADS) * HEAD_DIM + kh[:, None] * HEAD_DIM + d[None, :], mask=kv_mask,
                    other=0.0)
        _quantize_store(k, k_cache_ptr, k_scale_ptr, block, slot, kh, d, kv_mask,
                        stride_kcb, stride_kcs, stride_kch, stride_sb, stride_ss, stride_sh, KV_QUANT, SOFT_FP8)
        _quantize_store(v, v_cache_ptr, v_scale_ptr, block, slot, kh, d, kv_mask,
                        stride_vcb, stride_vcs, stride_vch, stride_sb, stride_ss, stride_sh, KV_QUANT, SOFT_FP8)


def rotary_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], rows contiguous
    cos: torch.Tensor,  # [T, D] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], any block stride
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    num_q_heads: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_bias: torch.Tensor | None = None,  # [Hkv, D] contiguous
) -> torch.Tensor:
    """Launch the fused kernel -> rotated q [T, Hq, D]. Inputs are checked by ``prefixgate_kernels.triton_ops``."""
    tokens = qkv.shape[0]
    _, block_size, kv_heads, head_dim = k_cache.shape
    q_out = torch.empty((tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q_out
    ks, vs, sc_strides = scale_args(k_cache, k_scale, v_scale)
    bias = k_bias if k_bias is not None else placeholder(qkv.device, qkv.dtype)
    _rotary_write_kv_kernel[(tokens,)](
        qkv, cos, sin, q_out, k_cache, v_cache, slot_mapping, ks, vs, bias,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *sc_strides,
        Q_HEADS=num_q_heads, Q_PAD=next_pow2(num_q_heads), KV_HEADS=kv_heads, KV_PAD=next_pow2(kv_heads),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, KV_QUANT=kv_code(k_cache), SOFT_FP8=interpreting(),
        HAS_K_BIAS=k_bias is not None, num_warps=4,
    )
    return q_out
