"""Paged decode attention that reads every KV head of a token as one row: for small heads at odd head counts.

``decode_attention.paged_decode`` runs one program per (sequence, KV head, split). At head dim 64 in an
8-bit cache a head's row of a token is 64 bytes, and with an odd KV head count no two heads can be joined
into whole lines (``decode_attention.joined_kv_heads``): a program reads 64 bytes 192 bytes apart (3 heads),
and the fp8 launch of SmolLM2-135M's 9 / 3 heads streams at ~53 % of copy. Session 32's ablation
(``benchmarks/decode_fp8_ablation.py``, H100) put that on the reads, not the math: the launch without its
softmax took 57.6 us of 62.8, its loads alone 54.9, the same bytes read as whole token rows 51.3, and a
program attending every head of its tokens from whole rows (its ``heads`` mode) 56.6.

Here that form is a kernel of its own: one program per (sequence, split) over all KV heads::

    grid = (num_seqs, num_splits)
    tile  [HEADS_P2, BLOCK_N, D]   the cache's token rows (heads past KV_HEADS masked: no bytes read),
                                   a batch a head: S = Q K^T and O += P V as batched MMAs
    q     [HEADS_P2, GROUP_PAD, D] each head's query rows

Splits cut each sequence's own context (``decode_attention._split_range``, as in a CUDA graph); the last
of a sequence's splits to finish merges every head's partials (``decode_attention._merge_splits``),
counted in int32 zeros it leaves zero. fp8 and 16-bit caches (int8's per-head scales are not read here).
Written for a few small heads: the fp8 9 / 3 launch compiles (sm_90, Triton 3.6) to 96 registers and 24 KB
of shared memory at 4 warps with its 16-token tiles; 8 heads of 128 spill (255 registers; measured 1.5x slower
than the per-head launch there).

Measured (session 33, H100, 64 x 4K, graph replays): the fp8 9 / 3 launch 58.6 us, 57.2 with the merge counters
kept by the caller, against the per-head launch's 62.8 (fp8 / the launcher's bf16 1.54 against 1.41). Not the
launcher's choice: in a chain of launches, as a decode step runs them, the two are equal (49.4 against 49.9 us a
launch: what this form saves is the single launch's tail), it is slower at small batches (one program a split
rather than one a head and split: 8 x 4K bf16 25.1 against 22.0 us), and the per-head launch also brings the
fused RoPE / K-V write and the early (PDL) start into the engine's step. ``benchmarks/kernels.py`` times it
beside the launcher on the classes it fits (docs/gpu.md, sessions 32-33).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import (
    KV_FP8,
    KV_INT8,
    KV_PLAIN,
    cdiv,
    dot_dtype_for,
    interpreting,
    kv_code,
    next_pow2,
    num_sms,
    placeholder,
    scale_args,
)
from prefixgate_kernels._dot import exact_dot
from prefixgate_kernels.decode_attention import (
    _MERGE_TILE_ELEMENTS,
    LOG2E,
    _merge_splits,
    _split_range,
    _unpack_8bit_pairs,
    choose_num_splits,
)

# Bytes of K (and as many of V) a tile holds. Session 33 (H100, the fp8 9 / 3 class, graph replays,
# benchmarks/decode_fp8_ablation.py --rows-variants): 16-token tiles (4 KB) 58.6 us, 32 (8 KB, session 32's
# choice, half the per-head launch's 128-token tile) 61.2, 64 65.7; so 4 KB
TILE_BYTES = 4096
# The wave the split count fills, in programs an SM: the measured launches ran 3 (6 splits at 64 x 4K on 132 SMs;
# 3 or 12 splits were slower). The sm_90 compile of the 16-token fp8 9 / 3 launch (96 registers, 24 KB of shared
# memory) would fit 5; not measured
PROGRAMS_PER_SM = 3


@triton.jit(do_not_specialize=["stride_btb"])
def _decode_rows_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [NB, BS, Hkv, D] (strided; a token's heads adjacent)
    v_ptr,  # same, or with V_PAIRS its int16 view [NB, BS, Hkv, D/2]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    k_scale_ptr,  # fp8: [1]; otherwise unused
    v_scale_ptr,
    out_ptr,  # [B, Hq, D]
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32, log2 domain
    counters_ptr,  # [>= B] int32 zeros: splits of a sequence that have finished
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    Q_HEADS_P2: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr,
    DOT_TY: tl.constexpr,
    V_PAIRS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len, start, end = _split_range(seq_len, split, 0, NUM_SPLITS, BLOCK_N)  # cut by length
    hi = tl.arange(0, HEADS_P2)
    h_ok = hi < KV_HEADS
    rows = tl.arange(0, GROUP_PAD)
    heads = hi[:, None] * GROUP + rows[None, :]  # [HEADS_P2, GROUP_PAD] query heads
    row_ok = h_ok[:, None] & (rows < GROUP)[None, :]
    d = tl.arange(0, HEAD_DIM)
    dh = tl.arange(0, HEAD_DIM // 2)
    q = tl.load(q_ptr + b * stride_qb + heads[:, :, None] * stride_qh + d[None, None, :], mask=row_ok[:, :, None],
                other=0.0)
    if NUM_SPLITS > 1:  # noqa: SIM102 - a compile-time test around a run-time one
        if start >= seq_len:
            return
    q = q.to(DOT_TY)
    if KV_QUANT == 1:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # one scale a tensor: folded into the score scale

    m_i = tl.full([HEADS_P2, GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS_P2, GROUP_PAD], tl.float32)
    if V_PAIRS:
        acc_e = tl.zeros([HEADS_P2, GROUP_PAD, HEAD_DIM // 2], tl.float32)  # output dims 0, 2, 4, ...
        acc_o = tl.zeros([HEADS_P2, GROUP_PAD, HEAD_DIM // 2], tl.float32)  # output dims 1, 3, 5, ...
    else:
        acc = tl.zeros([HEADS_P2, GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b * stride_btb
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        page = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slot = toks % BLOCK_SIZE
        ok = h_ok[:, None, None] & tok_ok[None, :, None]
        k = tl.load(k_ptr + page[None, :, None] * stride_kb + slot[None, :, None] * stride_ks
                    + hi[:, None, None] * stride_kh + d[None, None, :], mask=ok, other=0.0)  # [HEADS_P2, BLOCK_N, D]
        s = exact_dot(q, tl.trans(k.to(DOT_TY), (0, 2, 1)), DOT_TY)  # [HEADS_P2, GROUP_PAD, BLOCK_N] fp32
        # t0 < end: every tile holds a real key, so every row's max is finite after it
        s = tl.where(tok_ok[None, None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        v_row = page[None, :, None] * stride_vb + slot[None, :, None] * stride_vs + hi[:, None, None] * stride_vh
        if V_PAIRS:
            pairs = tl.load(v_ptr + v_row + dh[None, None, :], mask=ok, other=0)  # [HEADS_P2, BLOCK_N, D/2] int16
            v_even, v_odd = _unpack_8bit_pairs(pairs, KV_QUANT)
            p16 = p.to(tl.float16)
            acc_e = acc_e * alpha[:, :, None] + tl.dot(p16, v_even)
            acc_o = acc_o * alpha[:, :, None] + tl.dot(p16, v_odd)
        else:
            v = tl.load(v_ptr + v_row + d[None, None, :], mask=ok, other=0.0)  # [HEADS_P2, BLOCK_N, D]
            acc = acc * alpha[:, :, None] + exact_dot(p.to(DOT_TY), v.to(DOT_TY), DOT_TY)
        m_i = m_new

    v_final = 1.0 / tl.where(row_ok, l_i, 1.0)  # padding rows never saw a key weight: kept finite
    if KV_QUANT == 1:
        v_final = v_final * tl.load(v_scale_ptr)
    if NUM_SPLITS == 1:
        direct = True
    else:
        n_valid = tl.cdiv(seq_len, split_len)  # splits holding keys of this sequence (the rest exited above)
        direct = n_valid == 1
    bh = b * (GROUP * KV_HEADS) + heads  # flat (b, q head)
    if direct:
        o_row = out_ptr + b * stride_ob + heads[:, :, None] * stride_oh
        if V_PAIRS:
            tl.store(o_row + 2 * dh[None, None, :], (acc_e * v_final[:, :, None]).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, :, None])
            tl.store(o_row + 2 * dh[None, None, :] + 1, (acc_o * v_final[:, :, None]).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, :, None])
        else:
            tl.store(o_row + d[None, None, :], (acc * v_final[:, :, None]).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, :, None])
    else:
        p_row = part_out_ptr + (bh[:, :, None] * NUM_SPLITS + split) * HEAD_DIM
        if V_PAIRS:
            tl.store(p_row + 2 * dh[None, None, :], acc_e * v_final[:, :, None], mask=row_ok[:, :, None])
            tl.store(p_row + 2 * dh[None, None, :] + 1, acc_o * v_final[:, :, None], mask=row_ok[:, :, None])
        else:
            tl.store(p_row + d[None, None, :], acc * v_final[:, :, None], mask=row_ok[:, :, None])
        tl.store(part_lse_ptr + bh * NUM_SPLITS + split, m_i + tl.log2(l_i), mask=row_ok)
        if NUM_SPLITS > 1:  # compile-time: a one-split launch, always direct, compiles none of the merge
            # the last split to finish merges every head (the grid-barrier pattern of decode_attention's kernel:
            # bar.sync, one acq_rel add at GPU scope, the partials read back from L2)
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + b, 1, sem="acq_rel", scope="gpu")
            if arrived == n_valid - 1:
                tl.store(counters_ptr + b, 0)  # zero again for the next launch
                # every query head of the sequence in one merge: its heads are adjacent rows of the partials, and
                # one merge per KV head (session 32's form) put KV_HEADS dependent rounds of L2 reads on the
                # launch's tail
                _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, b * (GROUP * KV_HEADS), b, 0, n_valid,
                              stride_ob, stride_oh, NUM_SPLITS, GROUP * KV_HEADS, Q_HEADS_P2, SPLITS_PAD, MERGE_CHUNK,
                              HEAD_DIM, 0, 0)


def tile_tokens(kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """Tokens a tile: ``TILE_BYTES`` of K in whole token rows (heads padded to a power of two), 16 at least
    (an MMA's K)."""
    row_bytes = next_pow2(kv_heads) * head_dim * torch.empty(0, dtype=kv_dtype).element_size()
    return max(16, TILE_BYTES // row_bytes)  # both powers of two


def paged_decode_rows(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], a token's heads adjacent
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1 each
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 5,
    merge_counters: torch.Tensor | None = None,
    v_pairs: bool | None = None,
) -> torch.Tensor:
    """Decode attention with every KV head of a token read as one row (the module's kernel) -> [B, Hq, D].

    The same attention as ``decode_attention.paged_decode`` (checked against ``reference.paged_decode_attention``
    in tests/kernels/test_decode_rows.py). ``num_splits`` defaults to the count whose (sequence, split)
    programs fill ``PROGRAMS_PER_SM`` a SM best for a context as long as the table (``choose_num_splits``); each
    sequence's live context is cut into that many (graph-safe: the launch reads no device value). ``block_n``
    defaults to ``tile_tokens``. ``merge_counters``: int32 zeros, at least B, kept by a caller launching on one
    stream (the kernel leaves them zero); without it a launch that splits zeroes its own. ``v_pairs``: read an
    8-bit V as int16 pairs (compiled kernels; the default there)."""
    num_seqs, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    code = kv_code(k_cache)
    if code == KV_INT8:
        raise ValueError("paged_decode_rows reads fp8 and 16-bit caches; int8's per-head scales are not read here")
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold heads of q's {head_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads do not share {kv_heads} KV heads evenly")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1 or cache.stride(2) != head_dim:
            raise ValueError(f"{name}'s token rows must hold their heads adjacent (strides {tuple(cache.stride())})")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head dim must be a power of two of at least 16, got {head_dim}")
    if num_seqs == 0:
        return torch.empty_like(q)
    group = q_heads // kv_heads
    interp = interpreting()
    block_n = block_n if block_n is not None else tile_tokens(kv_heads, head_dim, k_cache.dtype)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two of at least 16, got {block_n}")
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, 1, max_context, num_sms(q.device), max(256, block_n),
                                       programs_per_sm=PROGRAMS_PER_SM)
    num_splits = max(1, min(num_splits, cdiv(max_context, block_n)))
    if v_pairs is None:
        v_pairs = code != KV_PLAIN and not interp
    out = torch.empty_like(q)
    ks, vs, _ = scale_args(k_cache, k_scale, v_scale)
    part_out = part_lse = placeholder(q.device, torch.float32)  # unread by a one-split launch
    counters = placeholder(q.device, torch.int32)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, q_heads, num_splits, dtype=torch.float32, device=q.device)
        counters = merge_counters if merge_counters is not None else torch.zeros(num_seqs, dtype=torch.int32,
                                                                                 device=q.device)
    v_arg = v_cache.view(torch.uint8).view(torch.int16) if v_pairs else v_cache
    splits_pad = max(2, next_pow2(num_splits))
    q_heads_p2 = next_pow2(q_heads)
    merge_chunk = min(splits_pad, max(2, _MERGE_TILE_ELEMENTS // (q_heads_p2 * head_dim)))
    options: dict[str, object] = {}
    if not interp:
        options["num_stages"] = num_stages
    _decode_rows_kernel[(num_seqs, num_splits)](
        q, k_cache, v_arg, block_tables, seq_lens, ks, vs, out, part_out, part_lse, counters, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_arg.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, GROUP=group, GROUP_PAD=max(16, next_pow2(group)), Q_HEADS_P2=q_heads_p2, KV_HEADS=kv_heads,
        HEADS_P2=next_pow2(kv_heads), HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        KV_QUANT=1 if code == KV_FP8 else 0, DOT_TY=dot_dtype_for(q.dtype, k_cache.dtype, interp), V_PAIRS=v_pairs,
        SPLITS_PAD=splits_pad, MERGE_CHUNK=merge_chunk, num_warps=num_warps, **options,
    )
    return out

