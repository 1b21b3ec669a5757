"""Paged ragged prefill attention: packed new tokens of many sequences over their block tables.

Sequence b's new tokens are q[cu_seqlens_q[b] : cu_seqlens_q[b+1]]; they sit at absolute
positions ``seq_lens[b] - q_len .. seq_lens[b] - 1`` and their K/V are already in the cache. A query
at position p sees keys 0..p (cached prefix fully, the new tokens causally)::

    keys  0 ...................... prefix ............. seq_len
    q row i (pos = prefix + i)     |-- all visible --|-- causal --|
    loop 1: [0, prefix + m_start) rounded down to BLOCK_N   no mask needed
    loop 2: the rest up to min(seq_len, prefix + m_end)      causal + length mask

grid = (q_heads, ceil(max_q_len / BLOCK_M), num_seqs); q heads vary fastest so the ``group``
heads that read one KV head run side by side and share its tiles through L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_dtype, kv_code, scale_args
from kernels._dot import exact_dot

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, k_scale_ptr, v_scale_ptr, k_tensor_scale, v_tensor_scale,
    kv_head, q_pos, lo, hi, seq_len, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr, DOT_TY: tl.constexpr,
):
    d = tl.arange(0, HEAD_DIM)
    for n0 in range(lo, hi, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_ok = toks < seq_len
        page = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slot = toks % BLOCK_SIZE
        k = tl.load(
            k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
            mask=tok_ok[:, None], other=0.0,
        )  # [BLOCK_N, D]
        v = tl.load(
            v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
            mask=tok_ok[:, None], other=0.0,
        )
        s = exact_dot(q, tl.trans(k.to(DOT_TY)), DOT_TY)  # [BLOCK_M, BLOCK_N] fp32
        if KV_QUANT == 1:
            s = s * k_tensor_scale
        if KV_QUANT == 2:
            sc_off = page * stride_sb + slot * stride_ss + kv_head * stride_sh
            s = s * tl.load(k_scale_ptr + sc_off, mask=tok_ok, other=0.0)[None, :]
        s = s * qk_scale
        if MASKED:
            s = tl.where((toks[None, :] <= q_pos[:, None]) & tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT == 2:
            p = p * tl.load(v_scale_ptr + sc_off, mask=tok_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + exact_dot(p.to(DOT_TY), v.to(DOT_TY), DOT_TY)
        m_i = m_new
    return acc, m_i, l_i


# The block table's row stride is its width, which changes with the longest context in the batch:
# left to Triton's default it would be specialised on divisibility by 16 and compile a second variant
# the first time the width is not a multiple of 16 (seen on the H200: the engine's first mixed
# prefill+decode step took 2.1 s instead of 0.4 s, a 129-block table after 128-block ones).
@triton.jit(do_not_specialize=["stride_btb"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [NB, BS, Hkv, D] (strided)
    v_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,  # [T, Hq, D]
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_sb, stride_ss, stride_sh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr,
    DOT_TY: tl.constexpr,
):
    h = tl.program_id(0)
    m_tile = tl.program_id(1)
    b = tl.program_id(2)
    q_lo = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_lo
    m_start = m_tile * BLOCK_M
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    kv_head = h // GROUP

    rows = m_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = prefix + rows  # absolute positions of this tile's queries
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_lo + rows)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(DOT_TY)  # [BLOCK_M, D]

    k_tensor_scale = 1.0
    v_tensor_scale = 1.0
    if KV_QUANT == 1:
        k_tensor_scale = tl.load(k_scale_ptr)
        v_tensor_scale = tl.load(v_scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b * stride_btb
    full_end = ((prefix + m_start) // BLOCK_N) * BLOCK_N  # keys every row of the tile sees
    kv_end = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
    acc, m_i, l_i = _attend_tile(
        acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, k_scale_ptr, v_scale_ptr, k_tensor_scale, v_tensor_scale,
        kv_head, q_pos, 0, full_end, seq_len, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
        False, HEAD_DIM, BLOCK_SIZE, BLOCK_N, KV_QUANT, DOT_TY,
    )
    acc, m_i, l_i = _attend_tile(
        acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, k_scale_ptr, v_scale_ptr, k_tensor_scale, v_tensor_scale,
        kv_head, q_pos, full_end, kv_end, seq_len, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
        True, HEAD_DIM, BLOCK_SIZE, BLOCK_N, KV_QUANT, DOT_TY,
    )
    acc = acc * v_tensor_scale / l_i[:, None]
    o_ptrs = out_ptr + (q_lo + rows)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], any block stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    max_q_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> torch.Tensor:
    """Launch the ragged prefill kernel. Inputs are checked by ``kernels.triton_ops``.

    ``max_q_len`` sizes the grid; when None the bound ``T`` is used: reading the real maximum off
    the device costs a host sync (~0.1 ms, measured) while surplus tiles exit after two loads.
    """
    num_tokens, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    out = torch.empty_like(q)  # [T, Hq, D]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_q_len is None:
        max_q_len = num_tokens
    on_gpu = q.device.type == "cuda"
    # GPU tiles from the H200 sweeps: 128x128, 8 warps, 3 stages was fastest at 4 x (8192 + 512) (run 1)
    # and at 1 x (7680 + 512) as well (0.195 ms against 0.213 for 64x64 tiles, session 2 run 2).
    if block_m is None:
        block_m = 128 if on_gpu else 16
    if block_n is None:
        block_n = 128 if on_gpu else 16
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    code = kv_code(k_cache)
    ks, vs, sc_strides = scale_args(k_cache, k_scale, v_scale)
    grid = (q_heads, triton.cdiv(max_q_len, block_m), num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, ks, vs, out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *sc_strides,
        out.stride(0), out.stride(1),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, KV_QUANT=code, DOT_TY=dot_dtype(q.dtype, k_cache),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
