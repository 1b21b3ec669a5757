"""Paged prefill attention in warp-specialised partitions (Gluon, Hopper): a loader and two consumers.

``prefill_overlap`` overlaps each tile's softmax with its previous P V inside one program whose eight
warps also gather the K / V pages with cp.async, and a CTA-wide barrier every tile holds its two
warpgroups in step: both run their softmax at the same time, and the tensor cores wait for them. At
head dim 128 it only equals the Triton kernel (session 21-22, docs/gpu.md). Here the work is split the
way FlashAttention-3 splits it, in three partitions of one 128-query-row program::

    loader     (4 warps, few registers)   for each key tile: wait until its ring slot is free, cp.async the
                                          tile's K and V pages into it (zero past the keys), arrive on ready
    consumer 0 (4 warps, rows 0..63)      for each key tile: wait ready; S_j = Q K_j^T and O += P_{j-1} V_{j-1}
    consumer 1 (4 warps, rows 64..127)      issued async; softmax of S_j while P V runs; wait P V; free the
                                          slot of tile j - 1 (an mbarrier both consumers arrive on)

The consumers share only the ring: no CTA-wide barrier, so each warpgroup runs its own schedule and one's
softmax can meet the other's MMAs; with ``PINGPONG`` they issue their MMAs in turns (two more mbarriers),
FlashAttention-3's ping-pong. The keys a row may see are ``prefill_attention``'s (its cached prefix, then
its new tokens causally). 16-bit caches, head dims 64 / 128, no KV splits; compiled only (Gluon has no
interpreter), so its tests are GPU ones.

Measured on the H200 (session 22, docs/gpu.md), graph replays at 32 / 8 heads: the prefix hit's attention
(512 new tokens over 7,680 cached) at head dim 128 0.192 ms with the Triton kernel, 0.133 here at 128-key
tiles, three ring slots and turns (500 TFLOP/s; two slots: 0.182); ``prefill_attention.paged_prefill``
sends it every unsplit 16-bit launch of at least 128 rows at head dims 64 and 128 (``gluon_kernel``).

``num_splits`` > 1 shares each tile's keys out among that many programs (BLOCK_N-aligned shares, as the
Triton kernel's splits), each writing (o / l, m + log2 l) partials that ``prefill_attention.merge_splits``
combines. ``pack`` puts a KV head's q heads into a program's rows (row r: token ``r // group`` of q head
``r % group``), so that each K / V tile is read once for the group. Both were written and compiled for sm_90
in session 22 without a device to run them: the launcher uses neither until they have been measured
(docs/gpu.md).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from prefixgate_kernels._common import cdiv
from prefixgate_kernels.prefill_attention import LOG2E, merge_splits, split_partials
from prefixgate_kernels.prefill_overlap import _copy_tile, _masked, _pages, check_gluon_prefill

WG_ROWS = gl.constexpr(64)  # query rows a consumer warpgroup owns (the wgmma's M); a program has two
LOADER_WARPS = gl.constexpr(4)  # a warpgroup: registers are handed out by warpgroups


@gluon.jit
def _loader(k_ptr, v_ptr, k_smem, v_smem, ready, empty, bt_row, key0, kv_end, n_tiles, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
            SPLIT: gl.constexpr):
    """Fill the ring: tile t (keys from ``key0`` with SPLIT, else 0) goes to slot t % NUM_BUF once both
    consumers have released that slot's previous tile; its ``ready`` barrier completes when every loader
    thread's copies have landed. Keys at or past ``kv_end`` (the split's end with SPLIT) are zero-filled."""
    # four threads a key row (64 contiguous bytes an instruction), so a thread holds few rows and each row's
    # address serves all of its vectors (its head-dim offsets are constants)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    tok_base = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    if SPLIT:
        tok_base += key0
    page = _pages(bt_row, tok_base, kv_end, BLOCK_SIZE)
    for t in range(n_tiles):
        slot = t % NUM_BUF
        mbarrier.wait(empty.index(slot), ((t // NUM_BUF) & 1) ^ 1)  # a fresh barrier passes phase 1
        _copy_tile(k_smem, v_smem, slot, k_ptr, v_ptr, page, t * BLOCK_N + tok_base, d, kv_end, kv_head,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
        cp.mbarrier_arrive(ready.index(slot), increment_count=False)
        page = _pages(bt_row, (t + 1) * BLOCK_N + tok_base, kv_end, BLOCK_SIZE)


@gluon.jit
def _take_turn(turn, k, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """With PINGPONG, the two consumers issue their MMAs in turns (FlashAttention-3's ping-pong): consumer
    HALF's k-th issue waits for the other's k-th (consumer 0 goes first; a fresh barrier passes phase 1)."""
    if PINGPONG:
        mbarrier.wait(turn.index(HALF), (k & 1) ^ (1 - HALF))


@gluon.jit
def _pass_turn(turn, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - HALF))


@gluon.jit
def _consumer(q_ptr, out_ptr, part_out_ptr, part_lse_ptr, q_smem, k_smem, v_smem, ready, empty, turn, q_lo, q_len,
              m_start, prefix, key0, key_end, h, n_tiles, full_end, qk_scale, stride_qt, stride_qh, stride_ot,
              stride_oh, num_tokens, q_heads, split,
              HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
              PINGPONG: gl.constexpr, SPLIT: gl.constexpr, RPT: gl.constexpr):
    """A consumer partition. A split may hold no key of the tile (its share starts past the tile's last
    key): then there is no tile to wait for, and the program wrote the split's empty partials already."""
    go = n_tiles > 0 if SPLIT else True  # static without SPLIT: the measured kernel's code
    if go:
        _consume(q_ptr, out_ptr, part_out_ptr, part_lse_ptr, q_smem, k_smem, v_smem, ready, empty, turn, q_lo,
                 q_len, m_start, prefix, key0, key_end, h, n_tiles, full_end, qk_scale, stride_qt, stride_qh,
                 stride_ot, stride_oh, num_tokens, q_heads, split, HALF, HEAD_DIM, BLOCK_N, NUM_BUF, PINGPONG, SPLIT,
                 RPT)


@gluon.jit
def _consume(q_ptr, out_ptr, part_out_ptr, part_lse_ptr, q_smem, k_smem, v_smem, ready, empty, turn, q_lo, q_len,
             m_start, prefix, key0, key_end, h, n_tiles, full_end, qk_scale, stride_qt, stride_qh, stride_ot,
             stride_oh, num_tokens, q_heads, split,
             HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
             PINGPONG: gl.constexpr, SPLIT: gl.constexpr, RPT: gl.constexpr):
    """``_consumer``'s work: rows [HALF * WG_ROWS, + WG_ROWS) of the program against every key tile the loader brings:
    S_j and P_{j-1} V_{j-1} in flight together, the softmax of S_j while P V runs. Keys at or past
    ``key_end`` are masked. With SPLIT the keys start at ``key0`` and the rows' partial (o / l, m + log2 l)
    goes to the split's slice of the partials, for ``prefill_attention.merge_splits``; a row that sees no
    key of its split leaves (0, -inf). Row r is token ``m_start + r // RPT`` of q head ``h + r % RPT``
    (RPT > 1: a KV head's q heads packed into the rows, ``pack``), else token ``m_start + r`` of head ``h``."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    VEC: gl.constexpr = 8
    COLS: gl.constexpr = HEAD_DIM // VEC
    LD: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // COLS, COLS], [4, 1], [1, 0])

    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    if RPT == 1:
        rows_ld = m_start + HALF * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, LD))
        q = gl.load(q_ptr + (q_lo + rows_ld).to(gl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=(rows_ld < q_len)[:, None], other=0.0)
    else:
        r_ld = HALF * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, LD))
        tok_ld = m_start + r_ld // RPT
        q = gl.load(q_ptr + (q_lo + tok_ld).to(gl.int64)[:, None] * stride_qt + (h + r_ld % RPT)[:, None] * stride_qh
                    + d[None, :], mask=(tok_ld < q_len)[:, None], other=0.0)
    my_q = q_smem.index(HALF)
    my_q.store(q)
    fence_async_shared()
    if RPT == 1:
        q_pos = prefix + m_start + HALF * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, S_LAYOUT))
    else:
        q_pos = prefix + m_start + (HALF * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, S_LAYOUT))) // RPT

    # tile 0: scores and softmax; its P V waits for the loop (or the epilogue)
    mbarrier.wait(ready.index(0), 0)
    fence_async_shared()
    zero_s = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=S_LAYOUT)
    _take_turn(turn, 0, HALF, PINGPONG)
    s_tok = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _pass_turn(turn, HALF, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    n0 = 0
    if SPLIT:
        n0 = key0
    s = _masked(s, n0, full_end, q_pos, key_end, BLOCK_N, S_LAYOUT)
    m_i = gl.max(s, axis=1) * qk_scale
    p = gl.exp2(s * qk_scale - _finite(m_i, SPLIT)[:, None])
    l_i = gl.sum(p, axis=1)
    alpha = gl.full([WG_ROWS], 1.0, gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=O_LAYOUT)

    for j in range(1, n_tiles):
        slot = j % NUM_BUF
        mbarrier.wait(ready.index(slot), (j // NUM_BUF) & 1)
        fence_async_shared()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        prev = (j - 1) % NUM_BUF
        _take_turn(turn, j, HALF, PINGPONG)
        s_tok = warpgroup_mma(my_q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        _pass_turn(turn, HALF, PINGPONG)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        n0 = j * BLOCK_N
        if SPLIT:
            n0 += key0
        s = _masked(s, n0, full_end, q_pos, key_end, BLOCK_N, S_LAYOUT)
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_base = _finite(m_new, SPLIT)
        alpha = gl.exp2(m_i - m_base)
        p = gl.exp2(s * qk_scale - m_base[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        mbarrier.arrive(empty.index(prev))  # tile j - 1's K and V are read: its slot may be refilled
        p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)

    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    _take_turn(turn, n_tiles, HALF, PINGPONG)
    o_tok = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % NUM_BUF), acc, is_async=True)
    _pass_turn(turn, HALF, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))
    r_o = HALF * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, O_LAYOUT))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
    if SPLIT:
        seen = l_i > 0.0
        lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
        acc = acc / gl.convert_layout(gl.where(seen, l_i, 1.0), gl.SliceLayout(1, O_LAYOUT))[:, None]
        _store_partial(part_out_ptr, part_lse_ptr, acc, lse, m_start + r_o // RPT, h + r_o % RPT, d_o, q_lo, q_len,
                       split, num_tokens, q_heads, HEAD_DIM)
    elif RPT == 1:
        rows_o = m_start + HALF * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, O_LAYOUT))
        acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]
        o_ptrs = out_ptr + (q_lo + rows_o).to(gl.int64)[:, None] * stride_ot + h * stride_oh + d_o[None, :]
        gl.store(o_ptrs, acc.to(dtype), mask=(rows_o < q_len)[:, None])
    else:
        tok_o = m_start + r_o // RPT
        acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]
        o_ptrs = (out_ptr + (q_lo + tok_o).to(gl.int64)[:, None] * stride_ot + (h + r_o % RPT)[:, None] * stride_oh
                  + d_o[None, :])
        gl.store(o_ptrs, acc.to(dtype), mask=(tok_o < q_len)[:, None])


@gluon.jit
def _finite(m, SPLIT: gl.constexpr):
    """The exponent base of a row's running max: with SPLIT a row may have seen no key yet (-inf), and
    -inf - -inf is NaN, so it counts as 0 there (its scores are -inf: every exponent is 0)."""
    if SPLIT:
        m = gl.where(m == float("-inf"), 0.0, m)
    return m


@gluon.jit
def _store_partial(part_out_ptr, part_lse_ptr, o, lse, toks, heads, d, q_lo, q_len, split, num_tokens, q_heads,
                   HEAD_DIM: gl.constexpr):
    """A split's partial rows (row i: token ``toks[i]`` of q head ``heads[i]``): ``part_out`` [splits, T, Hq, D]
    fp32 and ``part_lse`` [splits, T, Hq] (log2), the layout ``prefill_attention.merge_splits`` reads."""
    idx = (split * num_tokens + q_lo + toks) * q_heads + heads
    ok = toks < q_len
    gl.store(part_out_ptr + idx.to(gl.int64)[:, None] * HEAD_DIM + d[None, :], o, mask=ok[:, None])
    gl.store(part_lse_ptr + gl.convert_layout(idx, lse.type.layout), lse,
             mask=gl.convert_layout(ok, lse.type.layout))


# The block table's row stride follows the longest context and the token / split counts change with every
# step: left specialised (divisible by 16, equal to 1) they would compile new variants mid-run, as the Triton
# prefill kernel once did (its comment says what that cost).
@gluon.jit(do_not_specialize=["stride_btb", "num_tokens", "num_splits"])
def _prefill_specialized_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
    num_tokens, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
    stride_ot, stride_oh,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr, PINGPONG: gl.constexpr, SPLIT: gl.constexpr, RPT: gl.constexpr,
    num_warps: gl.constexpr,
):
    h = gl.program_id(0)
    m_tile = gl.program_id(1)
    b = gl.program_id(2)
    # without SPLIT the partitions still take a split index and a first key, unused: they get ``b``, a value
    # of the kernel's own (a literal or folded 0 captured by the partitions fails to lower in Triton 3.6)
    split = b
    if SPLIT:
        b = gl.program_id(2) // num_splits
        split = gl.program_id(2) % num_splits
    q_lo = gl.load(cu_ptr + b)
    q_len = gl.load(cu_ptr + b + 1) - q_lo
    # RPT > 1 (``pack``): the grid's first dimension is the KV head, and a program's 128 rows are 128 / RPT
    # tokens of each of its RPT q heads (each K / V tile read once for the group); else one q head's tokens
    TOK: gl.constexpr = 2 * WG_ROWS // RPT  # tokens a program
    m_start = m_tile * TOK
    if m_start < q_len:
        seq_len = gl.load(seq_lens_ptr + b)
        prefix = seq_len - q_len
        if RPT == 1:
            kv_head = h // GROUP
            q_heads = gl.num_programs(0)
        else:
            kv_head = h
            h = h * GROUP  # the program's first q head
            q_heads = gl.num_programs(0) * GROUP
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], Q_SMEM)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], KV_SMEM)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_DIM], KV_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready.index(i), count=LOADER_WARPS * 32)  # every loader thread's cp.async arrival
            mbarrier.init(empty.index(i), count=2)  # both consumers
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)  # the other consumer's issue (PINGPONG)

        kv_end = gl.minimum(seq_len, prefix + m_start + TOK)
        full_end = ((prefix + m_start) // BLOCK_N) * BLOCK_N  # keys below it: every row of the tile sees them
        bt_row = bt_ptr + b * stride_btb
        # the keys this program attends: all of [0, kv_end), or its split's BLOCK_N-aligned share
        key0 = split  # unused without SPLIT
        key_end = seq_len
        load_end = kv_end
        n_tiles = gl.cdiv(kv_end, BLOCK_N)
        if SPLIT:
            split_keys = gl.cdiv(gl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
            key0 = split * split_keys
            key_end = gl.minimum(key0 + split_keys, kv_end)
            load_end = key_end
            n_tiles = gl.maximum(gl.cdiv(key_end - key0, BLOCK_N), 0)
            if n_tiles == 0:  # an empty split: (0, -inf) for the merge; the partitions find no tile
                LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8],
                                                    [num_warps, 1], [1, 0])
                r = gl.arange(0, 2 * WG_ROWS, layout=gl.SliceLayout(1, LD))
                d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
                _store_partial(part_out_ptr, part_lse_ptr,
                               gl.zeros([2 * WG_ROWS, HEAD_DIM], gl.float32, layout=LD),
                               gl.full([2 * WG_ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, LD)),
                               m_start + r // RPT, h + r % RPT, d, q_lo, q_len, split, num_tokens, q_heads, HEAD_DIM)
        # the two consumers' argument lists differ only in the half they own (tuples are spelled out:
        # Gluon's frontend does not concatenate tuples holding constexprs)
        gl.warp_specialize([
            (_consumer, (q_ptr, out_ptr, part_out_ptr, part_lse_ptr, q_smem, k_smem, v_smem, ready, empty, turn,
                         q_lo, q_len, m_start, prefix, key0, key_end, h, n_tiles, full_end, qk_scale, stride_qt,
                         stride_qh, stride_ot, stride_oh, num_tokens, q_heads, split,
                         0, HEAD_DIM, BLOCK_N, NUM_BUF, PINGPONG, SPLIT, RPT)),
            (_consumer, (q_ptr, out_ptr, part_out_ptr, part_lse_ptr, q_smem, k_smem, v_smem, ready, empty, turn,
                         q_lo, q_len, m_start, prefix, key0, key_end, h, n_tiles, full_end, qk_scale, stride_qt,
                         stride_qh, stride_ot, stride_oh, num_tokens, q_heads, split,
                         1, HEAD_DIM, BLOCK_N, NUM_BUF, PINGPONG, SPLIT, RPT)),
            (_loader, (k_ptr, v_ptr, k_smem, v_smem, ready, empty, bt_row, key0, load_end, n_tiles, kv_head,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_BUF, SPLIT)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


def paged_prefill_specialized(
    q: torch.Tensor,  # [T, Hq, D] bf16 / fp16
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    max_q_len: int | None = None,
    block_n: int = 128,
    num_buf: int = 2,
    consumer_regs: int = 232,
    loader_regs: int = 40,
    pingpong: bool = False,
    num_splits: int = 1,
    pack: bool = False,
) -> torch.Tensor:
    """``prefill_attention.paged_prefill`` for 16-bit caches through the warp-specialised partitions
    (CUDA only). A program is 128 query rows: two consumer warpgroups of 64 and a loader. With
    ``num_splits`` > 1 each sequence's keys are shared out among that many programs per tile, whose
    partials ``prefill_attention.merge_splits`` combines (as the Triton kernel's splits). ``pack`` puts a KV
    head's q heads into one program's rows (128 / group tokens of each), so each K / V tile is read once for
    the group; the group must divide 128."""
    gl_dtype = check_gluon_prefill(q, k_cache, v_cache, block_n)
    num_tokens, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = q_heads // kv_heads
    if pack and (2 * WG_ROWS.value) % group:
        raise ValueError(f"pack needs a GQA group dividing {2 * WG_ROWS.value} rows, got {group}")
    rpt = group if pack else 1
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    split = num_splits > 1
    part_out, part_lse = split_partials(num_splits, q)
    q_smem = gl.NVMMASharedLayout.get_default_for([WG_ROWS.value, head_dim], gl_dtype)
    kv_smem = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl_dtype)
    rows = max_q_len if max_q_len is not None else num_tokens
    grid = (q_heads // rpt, cdiv(rows * rpt, 2 * WG_ROWS.value), block_tables.shape[0] * num_splits)
    # registers: 12 warps share the file; the default partition (consumer 0) gets what the workers leave
    maxnreg = (2 * consumer_regs + loader_regs) // 3 // 8 * 8
    _prefill_specialized_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, part_out, part_lse, scale * LOG2E,
        num_tokens, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_BUF=num_buf,
        Q_SMEM=q_smem, KV_SMEM=kv_smem, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs, PINGPONG=pingpong,
        SPLIT=split, RPT=rpt, num_warps=4, maxnreg=maxnreg,
    )
    if split:
        merge_splits(part_out, part_lse, out)
    return out
