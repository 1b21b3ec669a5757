"""Paged decode attention: one query token per sequence over its block table (flash-decoding).

Work split (one program = one sequence x one KV head x one slice of the context)::

    grid = (num_seqs, num_kv_heads, num_splits)
                 split 0            split 1            split 2
    context  |<- split_tokens ->|<- split_tokens ->|<- ... ->|     (a split past seq_len exits at once)
    tile     |BLOCK_N|BLOCK_N|..                                    (a tile spans BLOCK_N / block_size pages)

GQA: the ``group = q_heads / kv_heads`` query heads that share a KV head are the rows of one
[GROUP_PAD, head_dim] operand, so every KV tile is read from memory once for all of them and the
scores come out of one ``tl.dot``. With one split the kernel writes the output directly; with more,
each split writes its normalised partial output and its log-sum-exp, and the last of a (sequence,
kv head)'s splits to finish merges them (weights exp2(lse_s - max lse)), counted in a zeroed int32
buffer it leaves zero: one kernel a layer, not a split kernel and a merge kernel (``_reduce_kernel``,
kept as the baseline the benchmarks time it against)::

    program (b, h, s):  attend split s -> store o_s, lse_s -> bar.sync; one thread: n = atomic_add(ctr[b, h], 1)
                        (acq_rel, GPU scope) -> if n == splits holding keys - 1: ctr[b, h] = 0, read every
                        o_s, lse_s from L2 (.cg), write out[b, heads of h]

Quantized KV: scales are folded into the score columns (K) and the probability columns (V), so the
dot runs on the raw (upcast) cache values: fp8 -> one per-tensor scale; int8 -> one scale per
(block, slot, kv head), loaded alongside each tile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import (
    KV_PLAIN,
    cdiv,
    dot_dtype_for,
    interpreting,
    kv_code_for,
    next_pow2,
    num_sms,
    placeholder,
    scale_args,
)
from prefixgate_kernels._dot import exact_dot
from prefixgate_kernels.kv_write import _quantize_store
from prefixgate_kernels.reference import FP8_DTYPE
from prefixgate_kernels.rotary import _load_summed, _rope_tile_summed

LOG2E = 1.4426950408889634


@triton.jit
def _unpack_8bit_pairs(pairs, KV_QUANT: tl.constexpr):
    """pairs: int16 holding two 8-bit cache values (low byte = even d) -> (even, odd) fp16 tensors.

    Why: the PV dot reduces over tokens, which are strided in the cache, so its operand must be
    transposed on the way into the MMA; Triton 3.6/3.9 transposes 8-bit operands with one ld.shared.b8
    per byte (seen in the PTX; fp8 decode ran slower than bf16 in H200 run 2). Loading the 8-bit V as
    16-bit pairs keeps that transpose 16-bit (ldmatrix.trans), and the unpack is one instruction.
    """
    if KV_QUANT == 1:
        even, odd = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
        )
    else:
        even, odd = tl.inline_asm_elementwise(
            "{ .reg .s16 a, b; shl.b16 a, $2, 8; shr.s16 a, a, 8; shr.s16 b, $2, 8;"
            " cvt.rn.f16.s16 $0, a; cvt.rn.f16.s16 $1, b; }",
            "=h,=h,h", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
        )
    return even, odd


@triton.jit
def _stamp(stamps_ptr, slot, after):
    """Store the GPU's global nanosecond timer (PTX ``%globaltimer``) at ``stamps_ptr + slot``, read
    once ``after`` (an fp32 scalar the program computed) is known: the data dependence keeps the read
    after the work that made it."""
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,f", [after], dtype=tl.int64,
                                    is_pure=False, pack=1)
    tl.store(stamps_ptr + slot, now)


@triton.jit
def _stamp_sm(stamps_ptr, slot, after):
    """Store the id of the SM this program runs on (PTX ``%smid``) at ``stamps_ptr + slot``."""
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,f", [after], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(stamps_ptr + slot, sm.to(tl.int64))


@triton.jit
def _query_tile(q_ptr, b, heads, rows, row_ok, d, seq_len, start, end, cos_ptr, sin_ptr, stride_cos, stride_sin,
                slot_mapping_ptr, k_bias_ptr, k_ptr, v_write_ptr, k_scale_ptr, v_scale_ptr, kvh, k_col, v_col,
                stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vwb, stride_vws, stride_vwh,
                stride_sb, stride_ss, stride_sh, stride_qs, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr, MEMBER_DIM: tl.constexpr, MEMBERS: tl.constexpr,
                ROPE_WRITE: tl.constexpr, HAS_K_BIAS: tl.constexpr, SOFT_FP8: tl.constexpr,
                QKV_SLICES: tl.constexpr, ROW_TY: tl.constexpr):
    """A program's query rows ``[GROUP_PAD, D]`` in ``ROW_TY``: loaded, rotated from the q|k|v row
    (``ROPE_WRITE``, which also writes the step's token K / V where this program's split [start, end)
    holds position ``seq_len - 1``; with ``QKV_SLICES`` > 1 the row is that many fp32 partials
    ``stride_qs`` apart, summed and rounded to ``ROW_TY``), or spread over their members' columns
    (``MEMBER_DIM`` > 0)."""
    if ROPE_WRITE:  # q|k|v row in, rotated q; the token's K / V into the cache by the split holding it
        row = q_ptr + b * stride_qb
        cos = tl.load(cos_ptr + b * stride_cos + d).to(ROW_TY).to(tl.float32)
        sin = tl.load(sin_ptr + b * stride_sin + d).to(ROW_TY).to(tl.float32)
        q = _rope_tile_summed(row, stride_qs, heads, d, row_ok[:, None] & (d < HEAD_DIM)[None, :], cos, sin,
                              HEAD_DIM, QKV_SLICES, ROW_TY)
        slot_id = tl.load(slot_mapping_ptr + b)
        writes = (seq_len - 1 >= start) & (seq_len - 1 < end) & (slot_id >= 0)
        _write_token_kv(row, stride_qs, cos, sin, slot_id, writes, k_bias_ptr, k_ptr, v_write_ptr, k_scale_ptr,
                        v_scale_ptr, kvh, k_col, v_col, stride_kb, stride_ks, stride_kh, stride_vwb, stride_vws,
                        stride_vwh, stride_sb, stride_ss, stride_sh, HEAD_DIM, BLOCK_SIZE, KV_QUANT, SOFT_FP8,
                        HAS_K_BIAS, QKV_SLICES, ROW_TY)
        # the writer's stores are seen by its own threads' loads below (bar.sync orders a CTA's global
        # accesses); the other splits never read the token's slot
        tl.debug_barrier()
    elif MEMBER_DIM > 0:  # row r belongs to member r // (GROUP / MEMBERS): its values in that member's columns
        own_cols = (d // MEMBER_DIM)[None, :] == (rows // (GROUP // MEMBERS))[:, None]
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + (d % MEMBER_DIM)[None, :],
                    mask=row_ok[:, None] & own_cols, other=0.0)
    else:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    return q


# The block table's row stride is its width, which changes with the longest context in the batch:
# left to Triton's default it would be specialised on divisibility by 16 and compile a second variant
# the first time the width is not a multiple of 16 (seen on the H200: the engine's first mixed
# prefill+decode step took 2.1 s instead of 0.4 s, a 129-block table after 128-block ones).
@triton.jit(do_not_specialize=["stride_btb"])
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [NB, BS, Hkv, D] (strided)
    v_ptr,  # same, or when V_PAIRS its int16 view [NB, BS, Hkv, D/2] (two 8-bit values per element)
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    k_scale_ptr,  # fp8: [1]; int8: [NB, BS, Hkv]; plain: unused
    v_scale_ptr,
    out_ptr,  # [B, Hq, D]                 (written when NUM_SPLITS == 1)
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32 (written when NUM_SPLITS > 1)
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32, log2 domain
    counters_ptr,  # [>= B * Hkv] int32, zero between launches (FUSED_MERGE: splits that have finished)
    stamps_ptr,  # [B, Hkv, NUM_SPLITS, 5] int64 (written when STAMPS): see paged_decode's ``stamps``
    cos_ptr,  # [B, D] fp32 (ROPE_WRITE: q_ptr is the merged q|k|v projection's output, see RopeWrite)
    sin_ptr,
    slot_mapping_ptr,  # [B] int64, -1: padding (nothing written)
    k_bias_ptr,  # [Hkv, D] (HAS_K_BIAS)
    v_write_ptr,  # the V cache in its own dtype (v_ptr may be its int16 pairs view)
    stride_cos, stride_sin,
    k_col, v_col,  # where a q|k|v row's K and V start (Hq * D, (Hq + Hkv) * D)
    stride_qs,  # QKV_SLICES > 1: elements from one fp32 partial of the q|k|v rows to the next
    stride_vwb, stride_vws, stride_vwh,
    qk_scale,  # softmax scale * log2(e)
    split_tokens,  # keys per split; 0: each sequence's own context cut into NUM_SPLITS (``split_length``)
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_sb, stride_ss, stride_sh,
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr,
    DOT_TY: tl.constexpr,
    V_PAIRS: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    GROUP_P2: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    MEMBER_DIM: tl.constexpr,
    MEMBERS: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
    STAMPS: tl.constexpr,
    ROPE_WRITE: tl.constexpr = False,
    HAS_K_BIAS: tl.constexpr = False,
    SOFT_FP8: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
    QKV_SLICES: tl.constexpr = 1,
):
    """One (sequence, kv head, split) program. With ``MEMBER_DIM`` > 0 a "kv head" is ``MEMBERS``
    adjacent heads of the cache read as one row of ``MEMBERS * MEMBER_DIM`` values (``joined_kv_heads``),
    padded to the power of two ``HEAD_DIM`` (masked: the padding is never read), and ``GROUP`` counts
    the q heads of all members: q and out are the caller's ``[B, Hq, MEMBER_DIM]``, each q row is
    loaded into its own member's columns of the width (zeros elsewhere: its scores are exactly its
    own head's) and only those columns of its output are stored (``_store_heads``).

    With ``ROPE_WRITE`` the kernel also does ``prefixgate_kernels.rotary``'s work for the step's token (one
    launch a layer instead of two): every program rotates its q heads from the q|k|v row itself, and
    the program whose split holds the token (position ``seq_len - 1``) rotates that token's K, writes
    K and V into the cache (quantized as ``kv_write`` does) and, after a CTA barrier, streams its
    split as any program does, reading them back; no other program reads that slot. Bit for bit the
    values the two kernels would have produced (``_rope_tile`` rounds as the reference does).

    With ``LAUNCH_DEPENDENTS`` every program lets the next kernel launch at its start (programmatic
    dependent launch): a kernel launched after it with PDL starts under this one and waits
    (``griddepcontrol.wait``) before it reads what this one writes; without a PDL launch after it the
    instruction does nothing. (Letting it launch only once a split's keys are read gained less: session 30.)"""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    stamp_row = ((b * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * 5
    if STAMPS:
        _stamp(stamps_ptr, stamp_row, split.to(tl.float32))
        _stamp_sm(stamps_ptr, stamp_row + 4, split.to(tl.float32))
    seq_len = tl.load(seq_lens_ptr + b)
    split_len, start, end = _split_range(seq_len, split, split_tokens, NUM_SPLITS, BLOCK_N)

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kvh * GROUP + rows
    d = tl.arange(0, HEAD_DIM)
    dh = tl.arange(0, HEAD_DIM // 2)
    # the row's real width (ROW_WIDTH: MEMBERS * MEMBER_DIM when heads are joined, 3 x 64 = 192 of 256
    # columns). Written as a compare of the arange with a constant, not of 2 * dh: the latter hid the
    # V pairs' contiguity from Triton's analysis and turned their 16-byte cp.async into 2-byte loads
    # (sm_90 PTX here; fp8 per head 20 % slower on the H200, session 17 call 1).
    col_ok = d < ROW_WIDTH
    pair_ok = dh < ROW_WIDTH // 2
    # The query rows (and with ROPE_WRITE the token's K / V write) before the empty split's exit: after
    # it, their loads waited for the sequence length's (a branch on it), two memory round trips in a
    # row where one does (an empty split loads its rows for nothing and stores none). Measured in
    # session 26: ~0.2 us a split launch on the H100.
    q = _query_tile(q_ptr, b, heads, rows, row_ok, d, seq_len, start, end, cos_ptr, sin_ptr, stride_cos, stride_sin,
                    slot_mapping_ptr, k_bias_ptr, k_ptr, v_write_ptr, k_scale_ptr, v_scale_ptr, kvh, k_col, v_col,
                    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vwb, stride_vws, stride_vwh,
                    stride_sb, stride_ss, stride_sh, stride_qs, GROUP, HEAD_DIM, BLOCK_SIZE, KV_QUANT, MEMBER_DIM,
                    MEMBERS, ROPE_WRITE, HAS_K_BIAS, SOFT_FP8, QKV_SLICES, out_ptr.dtype.element_ty)
    if NUM_SPLITS > 1:  # noqa: SIM102 - a compile-time test around a run-time one (one split never exits)
        if start >= seq_len:
            return
    q = q.to(DOT_TY)  # [GROUP_PAD, D]

    if KV_QUANT == 1:
        k_tensor_scale = tl.load(k_scale_ptr)
        v_tensor_scale = tl.load(v_scale_ptr)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if V_PAIRS:
        acc_e = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)  # output dims 0, 2, 4, ...
        acc_o = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)  # output dims 1, 3, 5, ...
    else:
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b * stride_btb
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        page = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slot = toks % BLOCK_SIZE
        k = tl.load(
            k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
            mask=tok_ok[:, None] & col_ok[None, :], other=0.0,
        )  # [BLOCK_N, D]
        s = exact_dot(q, tl.trans(k.to(DOT_TY)), DOT_TY)  # [GROUP_PAD, BLOCK_N] fp32
        if KV_QUANT == 1:
            s = s * k_tensor_scale
        if KV_QUANT == 2:
            sc_off = page * stride_sb + slot * stride_ss + kvh * stride_sh
            s = s * tl.load(k_scale_ptr + sc_off, mask=tok_ok, other=0.0)[None, :]
        s = tl.where(tok_ok[None, :], s * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [GROUP_PAD, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT == 2:
            p = p * tl.load(v_scale_ptr + sc_off, mask=tok_ok, other=0.0)[None, :]
        v_row = page[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh
        if V_PAIRS:
            pairs = tl.load(v_ptr + v_row + dh[None, :], mask=tok_ok[:, None] & pair_ok[None, :],
                            other=0)  # [BLOCK_N, D/2] int16
            v_even, v_odd = _unpack_8bit_pairs(pairs, KV_QUANT)
            p16 = p.to(tl.float16)
            acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_even)
            acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_odd)
        else:
            v = tl.load(v_ptr + v_row + d[None, :], mask=tok_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_N, D]
            acc = acc * alpha[:, None] + exact_dot(p.to(DOT_TY), v.to(DOT_TY), DOT_TY)
        m_i = m_new

    if STAMPS:
        _stamp(stamps_ptr, stamp_row + 1, tl.max(l_i, 0))
    v_final = 1.0 / l_i
    if KV_QUANT == 1:
        v_final = v_final * v_tensor_scale
    if NUM_SPLITS == 1:
        direct = True
    elif FUSED_MERGE:
        n_valid = tl.cdiv(seq_len, split_len)  # splits holding keys of this sequence (the rest exited above)
        direct = n_valid == 1  # the only split with keys: its output is final
    else:
        direct = False  # _reduce_kernel reads every split's partial
    if direct:
        o_row = out_ptr + b * stride_ob + heads[:, None] * stride_oh
        if V_PAIRS:
            _store_heads(o_row, 2 * dh[None, :], (acc_e * v_final[:, None]).to(out_ptr.dtype.element_ty), rows,
                         GROUP, MEMBER_DIM, MEMBERS)
            _store_heads(o_row, 2 * dh[None, :] + 1, (acc_o * v_final[:, None]).to(out_ptr.dtype.element_ty), rows,
                         GROUP, MEMBER_DIM, MEMBERS)
        else:
            _store_heads(o_row, d[None, :], (acc * v_final[:, None]).to(out_ptr.dtype.element_ty), rows, GROUP,
                         MEMBER_DIM, MEMBERS)
    else:
        bh = b * (GROUP * tl.num_programs(1)) + heads  # flat (b, q head) index into the partials
        p_row = part_out_ptr + (bh[:, None] * NUM_SPLITS + split) * HEAD_DIM
        if V_PAIRS:
            tl.store(p_row + 2 * dh[None, :], acc_e * v_final[:, None], mask=row_ok[:, None])
            tl.store(p_row + 2 * dh[None, :] + 1, acc_o * v_final[:, None], mask=row_ok[:, None])
        else:
            tl.store(p_row + d[None, :], acc * v_final[:, None], mask=row_ok[:, None])
        tl.store(part_lse_ptr + bh * NUM_SPLITS + split, m_i + tl.log2(l_i), mask=row_ok)
        if FUSED_MERGE:
            # The last of the sequence's splits to finish merges them (no second kernel). The pattern
            # of a grid barrier: every thread's stores are issued (bar.sync), one thread's acq_rel
            # add at GPU scope releases them and, for the last arrival, acquires the others'; the
            # partials are then read from L2 (.cg), past any line of them an earlier launch left in
            # this SM's L1.
            tl.debug_barrier()
            counter = counters_ptr + b * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if STAMPS:
                _stamp(stamps_ptr, stamp_row + 2, arrived.to(tl.float32))
            if arrived == n_valid - 1:
                tl.store(counter, 0)  # zero again for the next launch (every split of this one has counted)
                _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, b * (GROUP * tl.num_programs(1)) + kvh * GROUP,
                              b, kvh * GROUP, n_valid, stride_ob, stride_oh,
                              NUM_SPLITS, GROUP, GROUP_P2, SPLITS_PAD, MERGE_CHUNK, HEAD_DIM, MEMBER_DIM, MEMBERS)
                if STAMPS:
                    _stamp(stamps_ptr, stamp_row + 3, arrived.to(tl.float32))


@triton.jit
def _write_token_kv(row, slice_stride, cos, sin, slot_id, writes, k_bias_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                    v_scale_ptr, kvh, k_col, v_col,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_sb, stride_ss, stride_sh,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr,
                    SOFT_FP8: tl.constexpr, HAS_K_BIAS: tl.constexpr, SLICES: tl.constexpr, dt: tl.constexpr):
    """``_rotary_write_kv_kernel``'s K / V half for one KV head of one token: ``rope(k) - k_bias`` and
    ``v`` from the q|k|v ``row`` (or its ``SLICES`` fp32 partials, summed and rounded to ``dt``) into the
    cache slot ``slot_id``, stored where ``writes``. Branch-free: every program loads the token's K and V
    rows (one head's each), so the loads do not wait for the slot and the sequence length that decide the
    store, and only the stores are masked."""
    d = tl.arange(0, HEAD_DIM)
    kh = kvh + tl.zeros([1], tl.int32)  # a [1, D] tile: kv_write's store takes [heads, D]
    row_ok = (kh >= 0)[:, None] & (d < HEAD_DIM)[None, :]
    k = _rope_tile_summed(row + k_col, slice_stride, kh, d, row_ok, cos, sin, HEAD_DIM, SLICES, dt)
    if HAS_K_BIAS:  # as prefixgate_kernels.rotary: the bias rounded to k's dtype, one rounding of the difference
        bias = tl.load(k_bias_ptr + kh[:, None] * HEAD_DIM + d[None, :])
        k = (k.to(tl.float32) - bias.to(dt).to(tl.float32)).to(dt)
    v = _load_summed(row + v_col + kh[:, None] * HEAD_DIM + d[None, :], row_ok, slice_stride, SLICES, dt)
    block = slot_id // BLOCK_SIZE
    slot = slot_id % BLOCK_SIZE
    store = tl.where(writes, row_ok, False)  # (row_ok & writes: the interpreter rejects that mask's dtype)
    _quantize_store(k, k_cache_ptr, k_scale_ptr, block, slot, kh, d, store,
                    stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh, KV_QUANT, SOFT_FP8)
    _quantize_store(v, v_cache_ptr, v_scale_ptr, block, slot, kh, d, store,
                    stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh, KV_QUANT, SOFT_FP8)


@triton.jit
def _store_heads(o_row, cols, vals, rows, GROUP: tl.constexpr, MEMBER_DIM: tl.constexpr, MEMBERS: tl.constexpr):
    """Store rows ``rows < GROUP`` of ``vals`` (columns ``cols`` of the program's width) at their
    heads' pointers ``o_row``; with ``MEMBER_DIM`` > 0 only the columns of each row's own member of
    the joined heads, at their place in a head of ``MEMBER_DIM`` (padding columns belong to none)."""
    row_ok = (rows < GROUP)[:, None]
    if MEMBER_DIM > 0:
        own = (cols // MEMBER_DIM) == (rows // (GROUP // MEMBERS))[:, None]
        tl.store(o_row + cols % MEMBER_DIM, vals, mask=row_ok & own)
    else:
        tl.store(o_row + cols, vals, mask=row_ok)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, bh0, b, head0, n_valid, stride_ob, stride_oh,
                  NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, SPLITS_PAD: tl.constexpr,
                  MERGE_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, MEMBER_DIM: tl.constexpr,
                  MEMBERS: tl.constexpr):
    """out[b, head0 + g] = sum_s 2^(lse_gs - max_s lse_gs) o_gs / sum_s 2^(...), g < GROUP, s < n_valid:
    the log-sum-exps first (one [GROUP_P2, SPLITS_PAD] tile), then the partial outputs in chunks of
    MERGE_CHUNK splits ([GROUP_P2, MERGE_CHUNK, D], about 4K fp32 a chunk)."""
    g = tl.arange(0, GROUP_P2)
    g_ok = g < GROUP
    sp = tl.arange(0, SPLITS_PAD)
    lse_ok = g_ok[:, None] & (sp[None, :] < n_valid)
    lse = tl.load(part_lse_ptr + (bh0 + g)[:, None] * NUM_SPLITS + sp[None, :], mask=lse_ok, other=float("-inf"),
                  cache_modifier=".cg")
    top = tl.where(g_ok, tl.max(lse, 1), 0.0)  # rows past GROUP are all -inf: keep them finite
    w_sum = tl.sum(tl.where(lse_ok, tl.exp2(lse - top[:, None]), 0.0), 1)
    c = tl.arange(0, MERGE_CHUNK)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for s0 in range(0, n_valid, MERGE_CHUNK):
        s_ok = g_ok[:, None] & ((s0 + c)[None, :] < n_valid)  # [GROUP_P2, MERGE_CHUNK]
        row = (bh0 + g)[:, None] * NUM_SPLITS + s0 + c[None, :]
        w = tl.where(s_ok, tl.exp2(tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                                   - top[:, None]), 0.0)
        parts = tl.load(part_out_ptr + row[:, :, None] * HEAD_DIM + d[None, None, :], mask=s_ok[:, :, None],
                        other=0.0, cache_modifier=".cg")  # [GROUP_P2, MERGE_CHUNK, D]
        acc += tl.sum(parts * w[:, :, None], 1)
    o = acc / tl.where(g_ok, w_sum, 1.0)[:, None]
    _store_heads(out_ptr + b * stride_ob + (head0 + g)[:, None] * stride_oh, d[None, :], o.to(out_ptr.dtype.element_ty),
                 g, GROUP, MEMBER_DIM, MEMBERS)


@triton.jit
def _split_range(seq_len, split, split_tokens, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(split_len, start, end)``: the keys [start, end) of split ``split`` of a ``seq_len``-token context,
    ``split_len`` keys a split (``_split_length``); one split takes the whole context, with no length to work
    out."""
    if NUM_SPLITS == 1:
        return seq_len, 0, seq_len
    else:
        split_len = _split_length(seq_len, split_tokens, NUM_SPLITS, BLOCK_N)
        start = split * split_len
        return split_len, start, tl.minimum(start + split_len, seq_len)


@triton.jit
def _split_length(seq_len, split_tokens, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a sequence: ``split_tokens`` when the launch fixed it (> 0), else the
    sequence's own context cut into ``NUM_SPLITS`` tile-aligned parts. The second is how a CUDA graph
    splits: its split count is fixed at capture from the block table's capacity (the longest context
    it may meet), and cutting that capacity instead of the live context left most splits empty, e.g.
    32 sequences of 2K in a graph sized for 8.4K ran one program per (sequence, kv head), half a wave,
    at 68 % of copy bandwidth (session 12).

    Either is a multiple of BLOCK_N (the launcher rounds ``split_tokens`` up to it), and saying so
    matters: a select of the two loses the alignment each has, and without it the compiled kernel no
    longer knows a tile's tokens share their pages (sm_90 compile here: 96 -> 113 registers, back to 96
    with it). It was not what made one-split launches 7-11 % slower after this function came in (the
    H200 with it, session 13: 128 x 2K 0.275 ms against 0.257 for the kernel before); a one-split launch
    now skips it and takes the whole context."""
    by_length = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return tl.multiple_of(tl.where(split_tokens > 0, split_tokens, by_length), BLOCK_N)


@triton.jit
def _reduce_kernel(
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D]
    split_tokens,  # as the split kernel's
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    n_valid = tl.cdiv(seq_len, _split_length(seq_len, split_tokens, NUM_SPLITS, BLOCK_N))  # the rest wrote nothing
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = (sp < n_valid) & (sp < NUM_SPLITS)
    bh = b * tl.num_programs(1) + h
    lse = tl.load(part_lse_ptr + bh * NUM_SPLITS + sp, mask=sp_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(sp_ok, w, 0.0)
    d = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_out_ptr + (bh * NUM_SPLITS + sp[:, None]) * HEAD_DIM + d[None, :], mask=sp_ok[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class DecodeTiles:
    """Tile shape of the split kernel: tokens per tile, pipeline depth (Triton ``num_stages``), warps,
    and how many such programs an SM holds at once (registers and shared memory of the sm_90
    compile), which sets the wave that ``choose_num_splits`` fills."""

    block_n: int
    num_stages: int
    num_warps: int = 4
    programs_per_sm: int = 4
    max_registers: int | None = None  # Triton's maxnreg, where registers limit programs per SM


# Triton 3.6's pipeliner puts the block-table load in the first stage and the K/V copies after it:
# num_stages = 2 keeps one K/V tile buffer per program, 5 a ring of two (read from the compiled
# TTGIR of this kernel for sm_90: memdesc<1x64x128> at 2-4 stages, <2x64x128> at 5-6).
def choose_tiles(head_dim: int, kv_dtype: torch.dtype, pairs: int | None = None,
                 num_sms: int | None = None) -> DecodeTiles:
    """Tiles per (head dim, cache dtype), each measured on the H200 against session 2's 64-token,
    2-stage tiles (session 3, run 1: benchmarks/results/kernels_h200_s3run1.json, 14 shapes).
    ``pairs`` (sequences x kv heads of the launch) and ``num_sms``, when given, let fp8 at head dim
    128 pick between its two tile sets (below); without them it takes the ring.

    * head dim 128, bf16/fp16/fp32: 64-token tiles, 2 stages (bf16: 106 registers, 39 KB, 4 programs
      per SM, 98-100% of copy).
    * head dim 128, 8-bit (fp8, int8): ``EIGHT_BIT_RING``, 128-token tiles through a two-tile ring, 3
      programs per SM with splits fitted to that wave. fp8 since session 4: in CUDA-graph replays
      faster than session 3's 64-token ring on all 7 shapes timed beside it (64 x 4K 0.163 against
      0.174 ms, 16 x 32K 0.276 against 0.333: 1.54-1.79x bf16 instead of 1.35-1.48x;
      kernels_fp8_h200_s4run1.json). int8 since session 8: 6-13% faster than its 64-token 2-stage
      tiles on 11 of the 12 head-dim-128 shapes of session 7's suite run (kernels_h200_s7suite.json,
      ``int8_candidate``; again on session 8's call 1), 2.5% slower on the one with GQA ratio 1.
    * head dim 128, fp8, at least one (sequence, kv head) pair per SM: ``FP8_WAVE_TILES``, the same
      128-token tile with one buffer under a 128-register cap, 4 programs per SM. Session 8's suite
      run (kernels_h200_s8suite.json, ``fp8_alternative``, graph replays): 1.6-8.4% faster than the
      ring on all 8 such shapes (64 x 4K 0.155 against 0.167 ms), 1.0-3.3% slower on the 4 with
      fewer pairs than SMs (16 x 32K 0.298 against 0.288), where every program streams a long split
      of one sequence and the ring's second buffer pays; the ring keeps those.
    * head dim 64: the ring too (bf16 64 x 4K 0.148 against 0.159 ms: 85% of copy instead of 80%),
      with 128-token tiles for 8-bit caches (fp8 0.121 against 0.130 ms, int8 0.142 against 0.189;
      96-106 registers, 42 KB).
    """
    if head_dim > 128:  # registers: the [BLOCK_N, D] tiles of a 256-wide head
        return DecodeTiles(block_n=32, num_stages=2)
    eight_bit = kv_dtype in (FP8_DTYPE, torch.int8)
    if head_dim <= 64:
        return DecodeTiles(block_n=128 if eight_bit else 64, num_stages=5)
    if kv_dtype == FP8_DTYPE and pairs is not None and num_sms is not None and pairs >= num_sms:
        return FP8_WAVE_TILES
    if eight_bit:
        return EIGHT_BIT_RING
    return DecodeTiles(block_n=64, num_stages=2)


# 128-token tiles through a two-tile ring for an 8-bit, head-dim-128 cache: 150 registers (int8
# 160) and 75 KB of shared memory, so 3 programs per SM; streams at copy speed on full waves
# (256 x 2K: 6 waves of 3 per SM in 0.304 ms), and lost at 64 x 4K (0.197 ms) only to a second,
# mostly empty wave (512 programs on 396 slots) until its splits were fitted to 3 per SM (3 at
# 64 x 4K: 0.163 ms, predicted ~0.14). The fp8 choice since session 4, int8's since session 8.
EIGHT_BIT_RING = DecodeTiles(block_n=128, num_stages=5, programs_per_sm=3)
# The fp8 128-token tile with one buffer: 145 registers (3 per SM) uncapped; capped at 128, 4 per SM
# with no spill in the sm_90 compile (41 KB of shared memory), splits fitted to that wave.
FP8_WAVE_TILES = DecodeTiles(block_n=128, num_stages=2, programs_per_sm=4, max_registers=128)


def choose_num_splits(num_seqs: int, kv_heads: int, max_context: int, num_sms: int, block_n: int,
                      programs_per_sm: int = 4, context_lens: Sequence[int] | None = None,
                      one_wave: OneWaveRule | None = None) -> int:
    """Split count that wastes the least of the last wave of (sequence, kv head, split) programs.

    A wave is ``programs_per_sm * num_sms`` programs running at once (about 4 per SM for the default
    tiles: ~40 KB of shared memory and 128 threads each). Run time ~ waves * (context / splits), so
    pick the smallest split count within 5% of the best ``ceil(programs * s / wave) / s``, each split
    at least 256 tokens. Measured on the H200 (run 2): 16 x 32768 took 0.60 ms at 5 splits (1.2
    waves) and 0.49 ms at 4 or 8. The count depends on the launch's shape only (sequences x kv
    heads against the wave, the block table's capacity as a cap), so the launch never reads device
    values (no host sync; CUDA-graph safe); without a hint the kernels cut each sequence's live
    context into that many splits on the device (``_split_length``), so a graph sized for long
    contexts still fills its wave on short ones.

    ``context_lens`` (a host-side hint: each sequence's context, as the scheduler knows it) switches
    to ``_splits_for_lengths``, which models a batch of unequal lengths; without it every sequence is
    taken to fill the table, which is exact for uniform batches and what a CUDA graph must assume.

    ``one_wave`` (``one_wave_rule_for`` a cache dtype): where the model picks several waves but the
    most splits whose programs fit in one wave fill it at least ``one_wave.fill`` (and, with
    ``max_split_tokens``, cut the table into splits no longer than that), take those. The model
    charges a wave as if a program's speed were fixed, but a launch that streams is bound by the
    bandwidth, which ~3 programs an SM already saturate, and more splits add programs, partials and
    merges (``one_wave_rule_for`` has the measurements).
    """
    cap = max(1, min(256, math.ceil(max_context / max(256, block_n))))
    wave = max(1, programs_per_sm * num_sms)
    if context_lens is not None and len(context_lens) > 0:
        # every layer of a step asks with the same lengths: computed once per step, not once per layer
        lens = context_lens if isinstance(context_lens, tuple) else tuple(context_lens)
        return _splits_for_lengths(lens, kv_heads, max_context, wave, block_n, cap)
    programs = max(1, num_seqs * kv_heads)
    cost = {s: math.ceil(programs * s / wave) / s for s in range(1, cap + 1)}
    best = min(cost.values())
    picked = min(s for s, c in cost.items() if c <= best * 1.05)
    if one_wave is not None:
        fits = [s for s in cost if programs * s <= wave]
        if fits and picked not in fits and programs * max(fits) >= one_wave.fill * wave and (
                one_wave.max_split_tokens is None or math.ceil(max_context / max(fits)) <= one_wave.max_split_tokens):
            return max(fits)
    return picked


# See one_wave_rule_for.
ONE_WAVE_FILL = 0.7
FP8_ONE_WAVE_SPLIT_TOKENS = 2048


@dataclass(frozen=True)
class OneWaveRule:
    """``choose_num_splits``' exception to its wave model: one wave at least ``fill`` full, where each
    split holds at most ``max_split_tokens`` of the table (None: any length)."""

    fill: float = ONE_WAVE_FILL
    max_split_tokens: int | None = None


def one_wave_rule_for(kv_dtype: torch.dtype) -> OneWaveRule | None:
    """``choose_num_splits``' one-wave rule for a cache dtype: any split length for 16-bit (and fp32)
    caches, splits of at most ``FP8_ONE_WAVE_SPLIT_TOKENS`` for fp8, none (the wave model alone) for int8.

    Measured on the H200 (session 17 call 5, ``benchmarks/kernels.py --split-rule``), graph replays
    at both counts wherever they differ: bf16 faster or equal on all 7 shapes (9 / 3 heads of 64 at
    64 x 4K 8 -> 2 splits 1.082x; the engine's decode graphs of 24 / 48 / 56 sequences over 2K in an
    8,448-token table 1.038 / 1.036 / 1.074x; 5 x 32K at 16 KV heads 1.049x; 3 x 4K at 32 1.041x;
    48 x 4K at 8 1.000x). fp8 split both ways: faster where each one-wave program streams at most
    2,048 live tokens (9 / 3 at 64 x 4K, 2 splits: 1.094x; 24 / 48 / 56 x 2K: 1.17 / 1.02 / 1.07x)
    and 0.937x where it streams 4K or 8K (48 x 4K at 1 split, 5 x 32K at 4). A launch knows only the
    table's width, an upper bound of the live context, so fp8 takes the rule where the width cut
    into the one wave's splits is at most 2,048 tokens: every such launch is on the side that won
    (the engine's 2K graphs, whose 8,448-token tables give 4,224 or more, keep the model). int8 was
    not measured either way and keeps the model."""
    if kv_dtype == torch.int8:
        return None
    if kv_dtype == FP8_DTYPE:
        return OneWaveRule(max_split_tokens=FP8_ONE_WAVE_SPLIT_TOKENS)
    return OneWaveRule()


# One program's fixed cost (prologue, q load, the partial write and its share of the reduce) in
# tokens of KV streaming: fitted to the H200's uniform 64 x 4096 batch, where 2 splits (twice the
# programs, half the tokens each) ran 2% slower than 1 (session 2, run 4).
_PROGRAM_OVERHEAD_TOKENS = 128


@functools.lru_cache(maxsize=16)
def _splits_for_lengths(lens: tuple[int, ...], kv_heads: int, max_context: int, wave: int, block_n: int,
                        cap: int) -> int:
    """Split count for a batch of known, unequal context lengths.

    With splits of ``S`` tokens a sequence of ``n`` tokens runs ``ceil(n / S)`` programs per KV head
    (the rest exit at once). Programs are short next to the whole launch, so the GPU's block
    scheduler packs them like a list schedule: the launch takes about
    ``max(total work / wave, longest program)``, work counted in tokens plus a fixed cost per
    program. Candidate split counts are powers of two (a fresh compile per value of the constexpr;
    eager launches would otherwise compile one variant per batch). Measured on the H200 (run 4),
    32 sequences of 100-8,000 tokens: 0.181 ms at the width-only choice (2), 0.137-0.141 at 4-32.
    """
    total = sum(int(n) for n in lens)
    longest = max(int(n) for n in lens)
    costs: dict[int, float] = {}
    s = 1
    while s <= cap:
        split = math.ceil(math.ceil(max_context / s) / block_n) * block_n  # tokens per split, as paged_decode cuts them
        programs = kv_heads * sum(math.ceil(int(n) / split) for n in lens)
        work = kv_heads * total + programs * _PROGRAM_OVERHEAD_TOKENS
        costs[s] = max(work / wave, min(split, longest) + _PROGRAM_OVERHEAD_TOKENS)
        s *= 2
    best = min(costs.values())
    # the fewest splits within 3% of the best: fewer partials to merge, fewer variants compiled
    return min(k for k, c in costs.items() if c <= best * 1.03)


# fp32 elements of partial outputs the merging program holds at once ([GROUP_P2, MERGE_CHUNK, D]):
# 32 registers a thread at 4 warps, under what the split loop itself needs
_MERGE_TILE_ELEMENTS = 4096


def paged_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], any block stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1 each
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    v_pairs: bool | None = None,
    max_registers: int | None = None,
    context_lens: Sequence[int] | None = None,
    split_by_length: bool | None = None,
    merge_counters: torch.Tensor | None = None,
    fused_merge: bool = True,
    joined_heads: int | None = None,
    merge_chunk: int | None = None,
    stamps: torch.Tensor | None = None,
    rope: RopeWrite | None = None,
    launch_dependents: bool = False,
) -> torch.Tensor:
    """Launch the split-KV decode kernel. Inputs are checked by ``prefixgate_kernels.triton_ops``.

    Tiles default to ``choose_tiles``, the split count to ``choose_num_splits`` (``context_lens``:
    optional host-side lengths of the sequences, for batches of unequal length). Where the splits
    fall: with ``context_lens`` at fixed offsets (the cost model's tokens per split), without them
    (a CUDA graph, which cannot know the lengths) each sequence's live context is cut into the
    split count on the device (``_split_length``); ``split_by_length`` overrides. ``max_registers``
    caps registers per thread (Triton's ``maxnreg``; default: the tiles' own, ``FP8_WAVE_TILES``
    sets one): where registers, not shared memory, limit how many programs an SM holds. Compiled
    kernels only (the interpreter has no registers to cap).

    Several splits are merged by the last of each (sequence, kv head)'s programs to finish, counted
    in ``merge_counters`` (int32, at least B x Hkv, all zero; the kernel leaves them zero): a caller
    that launches on one stream keeps one such buffer for all its launches (the engine's runner and
    its CUDA graphs do); without it each launch zeroes a fresh one. ``fused_merge=False`` merges in
    a second kernel (``_reduce_kernel``) instead: the baseline the benchmarks time it against.

    ``joined_heads`` reads that many adjacent KV heads as one row (``joined_kv_heads`` says when the
    launcher does, the kernel's ``MEMBER_DIM`` how); 1 reads them one by one.
    ``merge_chunk`` (a power of two; tuning) sets how many splits' partials the in-kernel merge reads
    at once (default: about 4K fp32 a chunk, ``_MERGE_TILE_ELEMENTS``).

    ``stamps`` (a diagnostic; compiled kernels only): an int64 buffer of at least grid programs x 5
    (sequences x kv heads x splits; 256 splits at most), which each program fills at row
    ``(b * Hkv + kv head) * splits + split`` with the GPU's nanosecond timer at its start, after its
    split's keys, after its partial's store and count (merged launches), and, for the program that
    merges, after the merge; the fifth value is the SM it ran on. A program whose split holds no key
    writes its start and SM only; what it does not write keeps the caller's value (fill with -1).

    ``rope`` (``RopeWrite``): ``q`` is the q columns of the step's merged q|k|v projection, not yet
    rotated, and the launch also does ``prefixgate_kernels.rotary.rotary_write_kv``'s work (the kernel's
    ``ROPE_WRITE``); KV heads are then read one by one. With ``rope.slices`` > 1 those rows are the
    projection's fp32 split-K partials (``q`` views the first), summed in the kernel, and the output is in
    ``rope.dtype``.

    ``launch_dependents``: each program signals at its start that the next kernel may launch (the kernel's
    ``LAUNCH_DEPENDENTS``), for a consumer launched with programmatic dependent launch that streams its own
    inputs while this one runs. A scheduling hint only: the interpreter, which has no such launch, ignores it."""
    num_seqs, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if rope is not None:
        if joined_heads not in (None, 1):
            raise ValueError(f"a launch that rotates and writes the token reads KV heads one by one, not {joined_heads}")
        joined_heads = 1
        if q.stride(1) != head_dim or q.stride(2) != 1:
            raise ValueError("with rope, q must be the q columns of q|k|v rows (heads of head_dim values, adjacent)")
        if (rope.slices > 1) != (q.dtype == torch.float32 and rope.dtype is not None):
            raise ValueError(f"q|k|v as fp32 partials goes with RopeWrite.slices > 1 (got q {q.dtype}, "
                             f"{rope.slices} slices)")
    # the output's dtype, which the kernel also rounds q|k|v partials to
    out_dtype = q.dtype
    if rope is not None and rope.slices > 1:
        assert rope.dtype is not None  # RopeWrite.__post_init__: partials come with a dtype to round to
        out_dtype = rope.dtype
    v_write = v_cache
    if joined_heads is None:
        joined_heads = launcher_joined_heads(k_cache, v_cache) if fused_merge else 1
    if joined_heads < 1:
        raise ValueError(f"joined_heads must be at least 1, got {joined_heads}")
    member_dim = members = 0
    if joined_heads > 1:  # the kernel's heads are the cache's groups: [NB, BS, Hkv, D] viewed as [NB, BS, Hkv/J, J*D]
        if not fused_merge or kv_heads % joined_heads or not heads_adjacent(k_cache, v_cache):
            raise ValueError(f"KV heads are read {joined_heads} together with the merge in the kernel, of a head "
                             f"count they divide (got {kv_heads}), from a cache whose heads' rows are adjacent")
        members, member_dim, kv_heads = joined_heads, head_dim, kv_heads // joined_heads
        k_cache = k_cache.view(*k_cache.shape[:2], kv_heads, members * member_dim)
        v_cache = v_cache.view(*v_cache.shape[:2], kv_heads, members * member_dim)
        head_dim = next_pow2(members * member_dim)  # the kernel's width; the padding columns are masked
    hint = None if context_lens is None else (context_lens if isinstance(context_lens, tuple) else tuple(context_lens))
    plan = _launch_plan(num_seqs, q_heads, head_dim, block_size, kv_heads, block_tables.shape[1] * block_size,
                        out_dtype, k_cache.dtype, q.device, hint, split_by_length, num_splits, block_n, num_warps,
                        num_stages, v_pairs, max_registers, fused_merge, member_dim, members, merge_chunk,
                        interpreting())
    if stamps is not None:
        if interpreting():
            raise ValueError("stamps read the GPU's timer: a compiled kernel only, not the interpreter")
        need = plan.grid[0] * plan.grid[1] * plan.grid[2] * 5
        if stamps.dtype != torch.int64 or not stamps.is_contiguous() or stamps.numel() < need:
            raise ValueError(f"stamps must be a contiguous int64 buffer of at least {need} values, got "
                             f"{stamps.dtype} x {stamps.numel()}")
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)  # [B, Hq, D] (q may be a view of q|k|v rows)
    ks, vs, sc_strides = scale_args(k_cache, k_scale, v_scale)
    part_out = part_lse = placeholder(q.device, torch.float32)
    counters = placeholder(q.device, torch.int32)  # read only by FUSED_MERGE launches
    if plan.num_splits > 1:
        part_out = torch.empty(num_seqs, q_heads, plan.num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, q_heads, plan.num_splits, dtype=torch.float32, device=q.device)
    if plan.fused_merge:
        counters = merge_counters if merge_counters is not None else torch.zeros(
            num_seqs * kv_heads, dtype=torch.int32, device=q.device)
    v_arg = v_cache.view(torch.uint8).view(torch.int16) if plan.v_pairs else v_cache  # [NB, BS, Hkv, D/2]
    q_st, k_st, v_st, o_st = q.stride(), k_cache.stride(), v_arg.stride(), out.stride()
    if rope is not None:
        cos, sin, slots = rope.cos, rope.sin, rope.slot_mapping
        bias = rope.k_bias if rope.k_bias is not None else placeholder(q.device, out_dtype)
        rope_args = (cos, sin, slots, bias, v_write, cos.stride(0), sin.stride(0), q_heads * head_dim,
                     (q_heads + kv_heads) * head_dim, rope.slice_stride, *v_write.stride()[:3])
    else:
        unused = placeholder(q.device, torch.float32)
        rope_args = (unused, unused, placeholder(q.device, torch.int64), unused, v_arg, 0, 0, 0, 0, 0, 0, 0, 0)
    _decode_split_kernel[plan.grid](
        q, k_cache, v_arg, block_tables, seq_lens, ks, vs, out, part_out, part_lse, counters,
        stamps if stamps is not None else placeholder(q.device, torch.int64), *rope_args,
        scale * LOG2E, plan.split_tokens,
        q_st[0], q_st[1], k_st[0], k_st[1], k_st[2], v_st[0], v_st[1], v_st[2],
        block_tables.stride(0), *sc_strides, o_st[0], o_st[1],
        STAMPS=stamps is not None, ROPE_WRITE=rope is not None,
        HAS_K_BIAS=rope is not None and rope.k_bias is not None, SOFT_FP8=rope is not None and interpreting(),
        LAUNCH_DEPENDENTS=launch_dependents and not interpreting(),
        QKV_SLICES=rope.slices if rope is not None else 1,
        **plan.options,
    )
    if plan.num_splits > 1 and not plan.fused_merge:
        _reduce_kernel[(num_seqs, q_heads)](
            part_out, part_lse, seq_lens, out, plan.split_tokens, o_st[0], o_st[1],
            NUM_SPLITS=plan.num_splits, SPLITS_PAD=plan.options["SPLITS_PAD"], HEAD_DIM=head_dim,
            BLOCK_N=plan.options["BLOCK_N"], num_warps=4,
        )
    return out


# ``prefixgate_kernels.triton_ops.rotary_decode_attention`` launches one kernel (RoPE and the K/V write inside the
# decode attention) when True, ``rotary_write_kv`` and then the attention when False: the same-run
# baseline the engine benchmark's ``decode_rope`` section times the fusion against.
FUSE_ROPE_WRITE = True


@dataclass(frozen=True)
class RopeWrite:
    """What ``paged_decode`` needs to rotate the step's q and k and write its K / V itself (the
    ``rope`` argument): the inputs of ``prefixgate_kernels.rotary.rotary_write_kv`` other than the q|k|v rows,
    which the launch reads through ``q`` (their q columns) and at the K / V columns after them."""

    cos: torch.Tensor  # [B, D] fp32, rows contiguous
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [B] int64: the token's cache slot, -1 for padding rows
    k_bias: torch.Tensor | None = None  # [Hkv, D] contiguous: the fp8 calibration's key mean
    # > 1: ``q`` views the first of that many fp32 split-K partials of the q|k|v rows (``gemv_pdl``'s, ``slice_stride``
    # elements apart), which the kernel sums in order and rounds to ``dtype``, the projection's own, before RoPE
    slices: int = 1
    slice_stride: int = 0
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.slices > 1 and (self.dtype not in (torch.bfloat16, torch.float16) or self.slice_stride <= 0):
            raise ValueError(f"{self.slices} q|k|v partials need a 16-bit dtype to round to and a positive slice "
                             f"stride, got {self.dtype} and {self.slice_stride}")


def heads_adjacent(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether a token's KV heads follow each other in both caches ([NB, BS, Hkv, D] with a head's D values
    contiguous and the next head's right after): joined heads are one view of the cache only then. A pool laid
    head by head (engine/kv_layout.py) is not."""
    head_dim = k_cache.shape[3]
    return all(c.stride(3) == 1 and c.stride(2) == head_dim for c in (k_cache, v_cache))


def launcher_joined_heads(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """How many KV heads ``paged_decode`` reads as one row of these caches by default (with the merge in the
    kernel): ``joined_kv_heads`` where the heads are adjacent, else 1. ``triton_ops.rotary_decode_attention``
    asks the same to know whether the one-launch RoPE / K-V write applies (it reads heads one by one)."""
    _, _, kv_heads, head_dim = k_cache.shape
    return joined_kv_heads(head_dim, kv_heads, k_cache.dtype) if heads_adjacent(k_cache, v_cache) else 1


def joined_kv_heads(head_dim: int, kv_heads: int, kv_dtype: torch.dtype) -> int:
    """How many adjacent KV heads ``paged_decode`` reads as one row: 1 (each head alone) or 2.

    Pairs: an fp8 cache (one scale per tensor, so joined heads share it; int8's per-head scales do
    not) of head dim 64 or less with an even number of KV heads. One head's row of such a cache is
    at most 64 bytes, half of a 128-byte L2 line whose other half belongs to the next head and is
    read by another program at another time: fp8 at head dim 64 streamed at ~55 % of copy on the
    H200 (sessions 8-14) where head dim 128 streams at ~100 %. Read as one head of twice the width,
    a pair's rows are whole lines (session 14: 32 / 8 heads, fp8 / bf16 1.21 -> 1.62).

    Triples (``joined_heads=3``, never chosen here): a KV head count that 3 divides and 2 does not
    (SmolLM2-135M's 9 / 3 heads of 64) read as one row of 192 values padded to 256 columns (masked,
    so the padding moves no bytes), all 9 query heads in one program. Measured on the H200 (session
    17, ``benchmarks/kernels.py --joined-heads``): no faster than per head at 64 x 4K (fp8 0.0557
    against 0.0554 ms, bf16 0.0714 against 0.0724, best of 18 tile x split launches) and 1.5-3x
    slower at 8 x 4K and 1 x 32K, so odd head counts are read per head.

    The cache is only viewed (``[NB, BS, Hkv, D]`` as ``[NB, BS, Hkv / J, J D]``, its last two dims
    contiguous); the kernel widens each query head to the joined width with zeros outside its own
    head's columns and keeps only those columns of the output (``_decode_split_kernel``'s
    ``MEMBER_DIM``). The softmax scale stays the caller's, of the real head dim.

    Only a cache whose pages are laid token by token can be viewed so. The engine's CUDA pool lays each
    page head by head (engine/kv_layout.py), where every head's 64-byte rows are already one contiguous
    run a page and the per-head launch streams at ~94 % of copy past its fixed cost (session 34): the
    launcher reads heads one by one there (``launcher_joined_heads``)."""
    if kv_dtype != FP8_DTYPE or head_dim > 64:
        return 1
    return 2 if kv_heads % 2 == 0 else 1


@dataclass(frozen=True)
class _LaunchPlan:
    """Everything about a decode launch that follows from its shapes, dtypes and hints alone."""

    grid: tuple[int, int, int]
    num_splits: int
    split_tokens: int  # keys per split; 0: each sequence's live context cut into num_splits on the device
    fused_merge: bool
    v_pairs: bool
    options: dict[str, object]  # the kernel's constexprs and launch options


# A launch's plan costs ~70-200 us of Python to work out (the split cost model over up to 256 counts,
# the tile choice, the constexprs; measured on the build machine's CPU), as much as the kernel itself
# at small batches. Every layer of a step launches with the same key (an eager step's length hint
# included), so all but the first of a step's launches find it here.
@functools.lru_cache(maxsize=256)
def _launch_plan(num_seqs: int, q_heads: int, head_dim: int, block_size: int, kv_heads: int, max_context: int,
                 q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                 context_lens: tuple[int, ...] | None, split_by_length: bool | None, num_splits: int | None,
                 block_n: int | None, num_warps: int | None, num_stages: int | None, v_pairs: bool | None,
                 max_registers: int | None, fused_merge: bool, member_dim: int, members: int,
                 merge_chunk: int | None,
                 interp: bool) -> _LaunchPlan:
    group = q_heads // kv_heads
    code = kv_code_for(kv_dtype)
    sms = num_sms(device)
    tiles = choose_tiles(head_dim, kv_dtype, num_seqs * kv_heads, sms)
    overridden = (block_n, num_stages, num_warps) != (None, None, None)
    if max_registers is None and not overridden:
        max_registers = tiles.max_registers
    block_n = max(block_n if block_n is not None else tiles.block_n, 16)
    num_stages = num_stages if num_stages is not None else tiles.num_stages
    num_warps = num_warps if num_warps is not None else tiles.num_warps
    if num_splits is None:  # tile overrides (tuning) keep the 4-per-SM wave of session 2's tiles
        num_splits = choose_num_splits(num_seqs, kv_heads, max_context, sms, block_n,
                                       programs_per_sm=4 if overridden else tiles.programs_per_sm,
                                       context_lens=context_lens, one_wave=one_wave_rule_for(kv_dtype))
    split_tokens = cdiv(cdiv(max_context, num_splits), block_n) * block_n
    num_splits = cdiv(max_context, split_tokens)
    if split_by_length is None:
        split_by_length = context_lens is None
    if split_by_length:
        split_tokens = 0  # the kernels cut each sequence's own context into num_splits
    if v_pairs is None:  # GPU only: the interpreter has no inline PTX
        v_pairs = code != KV_PLAIN and not interp
    assert not v_pairs or (code != KV_PLAIN and head_dim % 2 == 0)
    fused_merge = fused_merge and num_splits > 1
    group_p2 = next_pow2(group)
    splits_pad = max(2, next_pow2(num_splits))
    dot_ty = dot_dtype_for(q_dtype, kv_dtype, interp)
    if merge_chunk is None:
        merge_chunk = max(2, _MERGE_TILE_ELEMENTS // (group_p2 * head_dim))
    elif merge_chunk < 2 or merge_chunk & (merge_chunk - 1):
        raise ValueError(f"merge_chunk must be a power of two >= 2, got {merge_chunk}")
    options: dict[str, object] = dict(
        NUM_SPLITS=num_splits, GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, KV_QUANT=code, DOT_TY=dot_ty, V_PAIRS=v_pairs,
        FUSED_MERGE=fused_merge, GROUP_P2=group_p2, SPLITS_PAD=splits_pad,
        MERGE_CHUNK=min(splits_pad, merge_chunk), MEMBER_DIM=member_dim, MEMBERS=members,
        ROW_WIDTH=members * member_dim if members else head_dim,
        num_warps=num_warps, num_stages=num_stages,
    )
    if max_registers and not interp:
        options["maxnreg"] = max_registers
    return _LaunchPlan(grid=(num_seqs, kv_heads, num_splits), num_splits=num_splits, split_tokens=split_tokens,
                       fused_merge=fused_merge, v_pairs=v_pairs, options=options)
