"""Paged prefill attention with the softmax overlapping the tensor cores (Gluon, Hopper).

Nsight Compute on the prefix hit's attention (``prefill_attention._prefill_kernel``, 512 new tokens
over 7,680 cached, session 21) found the tensor pipe busy 40 % of the time: every tile waits for its
Q K^T before the softmax and for the softmax before its P V, and Triton 3.6 cannot be told
otherwise (its pipeliner waits on a wgmma whose result the next iteration reads, and a hand-rotated
loop is serialised by ptxas). Gluon states the schedule itself. Per tile j, one warpgroup-wide
program of BLOCK_M query rows does::

    O *= alpha_{j-1};  issue S_j = Q K_j^T (async);  issue O += P_{j-1} V_{j-1} (async)
    wait S_j;  softmax(S_j) -> m_j, alpha_j, P_j        <- runs while P_{j-1} V_{j-1} is on the tensor cores
    wait P_{j-1} V_{j-1};  cp.async the tile j + NUM_BUF - 1 into the ring slot it freed

(FlashAttention-3's overlap inside a warpgroup). K and V come through a ring of NUM_BUF shared-memory
tiles gathered from the paged cache with cp.async, each tile's block-table entries loaded one tile
ahead of its copy. Q is staged once in shared memory. The keys a row may see are those of
``prefill_attention`` (its cached prefix, then its new tokens causally); tiles wholly visible to every
row skip the mask.

16-bit caches, head dims 64 / 128, no KV splits. Measured on the H200 (sessions 21-22, docs/gpu.md): at
head dim 64 8-26 % faster than the Triton kernel, at head dim 128 equal. The CTA-wide barrier each tile
holds its two warpgroups in step, which ``prefill_specialized`` removes (a loader partition, two
consumers): that kernel is 24-31 % faster at head dim 128 and takes the engine's launches
(``prefill_attention.gluon_kernel``); this one stays as an A/B option (``PrefillKernel.OVERLAP``). Not
for the CPU interpreter (Gluon compiles for the GPU only); its tests are compiled ones.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from prefixgate_kernels._common import cdiv
from prefixgate_kernels.prefill_attention import LOG2E


@gluon.jit
def _copy_tile(k_smem, v_smem, slot, k_ptr, v_ptr, page, toks, d, kv_end, kv_head,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE: gl.constexpr):
    """cp.async one K and one V tile (keys ``toks``, pages ``page``) into ring slot ``slot``; keys at or
    past ``kv_end`` are zero-filled (a page's unwritten slots may hold anything, NaN included)."""
    ok = (toks < kv_end)[:, None]
    row_k = page * stride_kb + (toks % BLOCK_SIZE).to(gl.int64) * stride_ks + kv_head * stride_kh
    row_v = page * stride_vb + (toks % BLOCK_SIZE).to(gl.int64) * stride_vs + kv_head * stride_vh
    cp.async_copy_global_to_shared(k_smem.index(slot), k_ptr + row_k[:, None] + d[None, :], mask=ok)
    cp.async_copy_global_to_shared(v_smem.index(slot), v_ptr + row_v[:, None] + d[None, :], mask=ok)


@gluon.jit
def _issue_tile(k_smem, v_smem, slot, k_ptr, v_ptr, page, toks, d, kv_end, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE: gl.constexpr):
    """``_copy_tile`` as one commit group."""
    _copy_tile(k_smem, v_smem, slot, k_ptr, v_ptr, page, toks, d, kv_end, kv_head,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
    cp.commit_group()


@gluon.jit
def _pages(bt_row, toks, kv_end, BLOCK_SIZE: gl.constexpr):
    return gl.load(bt_row + toks // BLOCK_SIZE, mask=toks < kv_end, other=0).to(gl.int64)


@gluon.jit
def _masked(s, n0, full_end, q_pos, seq_len, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):
    """Raw scores, -inf where a tile holds keys some row may not see. The softmax scale is applied
    inside the exponent's FMA (``s * qk_scale - m``) and to the row max, not as a pass of its own."""
    if n0 + BLOCK_N > full_end:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        ok = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] < seq_len)
        s = gl.where(ok, s, float("-inf"))
    return s


@gluon.jit
def _prefill_overlap_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, seq_lens_ptr, out_ptr, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
    stride_ot, stride_oh,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr,
    num_warps: gl.constexpr,
):
    h = gl.program_id(0)
    m_tile = gl.program_id(1)
    b = gl.program_id(2)
    q_lo = gl.load(cu_ptr + b)
    q_len = gl.load(cu_ptr + b + 1) - q_lo
    m_start = m_tile * BLOCK_M
    if m_start < q_len:
        seq_len = gl.load(seq_lens_ptr + b)
        prefix = seq_len - q_len
        kv_head = h // GROUP
        dtype: gl.constexpr = q_ptr.dtype.element_ty

        # one warp a 16-row slice of the tile (M across all warps), the MMA's N the whole tile
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        # global -> shared copies: 16-byte vectors along the head dimension
        VEC: gl.constexpr = 8
        COLS: gl.constexpr = HEAD_DIM // VEC
        LD: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // COLS, COLS], [num_warps, 1], [1, 0])

        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
        rows_ld = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
        q = gl.load(q_ptr + (q_lo + rows_ld).to(gl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=(rows_ld < q_len)[:, None], other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], Q_SMEM)
        q_smem.store(q)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], KV_SMEM)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], KV_SMEM)

        kv_end = gl.minimum(seq_len, prefix + m_start + BLOCK_M)
        n_tiles = gl.cdiv(kv_end, BLOCK_N)
        full_end = ((prefix + m_start) // BLOCK_N) * BLOCK_N  # keys below it: every row of the tile sees them
        q_pos = prefix + m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
        bt_row = bt_ptr + b * stride_btb
        tok_base = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))

        # prologue: tiles 0 .. NUM_BUF - 1 in flight (every ring slot), the next tile's pages loaded
        page = _pages(bt_row, tok_base, kv_end, BLOCK_SIZE)
        for i in gl.static_range(NUM_BUF):
            _issue_tile(k_smem, v_smem, i, k_ptr, v_ptr, page, i * BLOCK_N + tok_base, d, kv_end, kv_head,
                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
            page = _pages(bt_row, (i + 1) * BLOCK_N + tok_base, kv_end, BLOCK_SIZE)

        # tile 0: scores and softmax; its P V waits for the loop (or the epilogue)
        cp.wait_group(NUM_BUF - 1)
        gl.thread_barrier()
        fence_async_shared()
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False)
        s = _masked(s, 0, full_end, q_pos, seq_len, BLOCK_N, S_LAYOUT)
        m_i = gl.max(s, axis=1) * qk_scale  # the log2-domain row max (qk_scale > 0)
        p = gl.exp2(s * qk_scale - m_i[:, None])
        l_i = gl.sum(p, axis=1)
        alpha = gl.full([BLOCK_M], 1.0, gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=O_LAYOUT)

        for j in range(1, n_tiles):
            # issued so far: tiles 0 .. j + NUM_BUF - 2 (one a loop turn after the prologue); tile j is in
            cp.wait_group(NUM_BUF - 2)
            gl.thread_barrier()
            fence_async_shared()
            s_tok = warpgroup_mma(q_smem, k_smem.index(j % NUM_BUF).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
            o_tok = warpgroup_mma(p_op, v_smem.index((j - 1) % NUM_BUF), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))  # Q K_j^T done; P_{j-1} V_{j-1} may still run
            s = _masked(s, j * BLOCK_N, full_end, q_pos, seq_len, BLOCK_N, S_LAYOUT)
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
            # slot (j - 1) % NUM_BUF is free (its V was just read): tile j - 1 + NUM_BUF goes there
            gl.thread_barrier()
            nxt = j + NUM_BUF - 1
            _issue_tile(k_smem, v_smem, nxt % NUM_BUF, k_ptr, v_ptr, page, nxt * BLOCK_N + tok_base, d, kv_end,
                        kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
            page = _pages(bt_row, (nxt + 1) * BLOCK_N + tok_base, kv_end, BLOCK_SIZE)

        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % NUM_BUF), acc)
        cp.wait_group(0)

        acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]
        rows_o = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_LAYOUT))
        d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
        o_ptrs = out_ptr + (q_lo + rows_o).to(gl.int64)[:, None] * stride_ot + h * stride_oh + d_o[None, :]
        gl.store(o_ptrs, acc.to(dtype), mask=(rows_o < q_len)[:, None])


def check_gluon_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> gl.dtype:
    """What the Gluon prefills take (16-bit q and cache of one dtype, head dim 64 / 128, key tiles of whole
    cache blocks, whole GQA groups): ValueError otherwise; the Gluon dtype of q."""
    _, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"16-bit q and cache of one dtype expected, got {q.dtype} / {k_cache.dtype}")
    if head_dim not in (64, 128) or block_n % block_size or q_heads % kv_heads:
        raise ValueError(f"head dim 64 / 128 and tiles of whole blocks expected (D {head_dim}, BS {block_size})")
    return gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16


def paged_prefill_overlap(
    q: torch.Tensor,  # [T, Hq, D] bf16 / fp16
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    max_q_len: int | None = None,
    block_m: int = 128,
    block_n: int = 128,
    num_buf: int = 2,
    num_warps: int = 8,
) -> torch.Tensor:
    """``prefill_attention.paged_prefill`` for 16-bit caches through the overlapped schedule (CUDA only)."""
    gl_dtype = check_gluon_prefill(q, k_cache, v_cache, block_n)
    num_tokens, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    q_smem = gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gl_dtype)
    kv_smem = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl_dtype)
    grid = (q_heads, cdiv(max_q_len if max_q_len is not None else num_tokens, block_m), block_tables.shape[0])
    _prefill_overlap_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_BUF=num_buf, Q_SMEM=q_smem, KV_SMEM=kv_smem, num_warps=num_warps,
    )
    return out
