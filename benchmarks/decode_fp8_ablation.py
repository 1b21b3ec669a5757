"""Where the fp8 decode of the 9 / 3 class goes (issue #19 item 4, session 32): the same launch with its
work taken away piece by piece.

The 9 / 3 class (64 sequences x 4K, 9 query heads of 64 over 3 KV heads) decodes an fp8 cache only
1.32-1.46x as fast as a bf16 one (target 1.6x) and streams at ~53 % of copy where bf16 streams at ~76 %.
Fewer instructions alone did not move it (session 21: the masks, 7 % of the mix, taken out: unchanged), nor
one-warp programs (-5 %), nor reading the three heads as one row (session 17: unchanged). Before a rewrite
(the keys as the MMA's M, docs/gpu.md "Item 4: where the next attempt starts"), this probe asks which part of
the launch holds the time. One Triton kernel, one (sequence, KV head, split) program as the engine's
``_decode_split_kernel`` runs it (its launcher's tiles and split count, V read as int16 pairs), in modes:

    loads       K's and V's bytes of each tile loaded as 32-bit words and xor-ed into a register tile, the
                next tile's loaded before this one's are used: the traffic and address work, nothing else
    rows        the same bytes, a program reading every KV head of its tokens (rows of Hkv x D bytes,
                Hkv times the splits): the traffic in whole token rows
    mma         loads, the fp8 -> f16 conversions and both products, scores used as they come (no softmax)
    full        the engine's math: online softmax between the products (checked against the reference)
    warps       the same math with each warp streaming its own quarter of every tile and keeping its own
                softmax state ([warps, rows, keys] tensors, batched MMAs), merged once at the end: no
                cross-warp reduction a tile (checked likewise)
    keys        warps, with the keys as the MMAs' M and the query rows as an N of 8: S^T = K q^T
                ([warps, keys, 8]: the softmax on half the elements of [16, keys]), P back to rows for O = P V
    heads       every KV head of its tokens in one program, as whole token rows (Hkv x D contiguous bytes, the
                heads padded to a power of two and masked), batched MMAs over the heads: since call 3 the
                engine's kernel of that form (``decode_rows.paged_decode_rows``, its own tiles and splits, the
                merge included); calls 2-3 ran this probe's first version of it (32-token tiles, Hkv times
                the splits, partials only)

each beside the engine's own launch (``decode_attention.paged_decode``) on the same cache, all as CUDA-graph
replays of one launch, and the same on a control that streams well, head dim 128 at 32 / 8 heads (fp8 1.7x
bf16 there). Partials only: no split merge.

    python benchmarks/decode_fp8_ablation.py [--split-scales 1,2,4] --out benchmarks/results/decode_fp8_ablation.json

Measured on an H100 (session 32, docs/gpu.md): the 9 / 3 class's engine launch 62.8 us; without the softmax 57.6;
the loads alone 54.9 (61 % of copy) and as whole rows 51.3 (65 %), unchanged with 2x and 4x the programs; warps
62.9, keys 60.8 (also tried inside the engine's kernel: 63.8, and removed), heads 56.6. The launch is held by how
its bytes are read, not by its math. Session 33 (``--rows-variants --block-sizes 16,32,64``): pages of 32 and 64
tokens move none of the modes (loads 61 %, rows 67-68 % of copy at each), so the scattered pages are not it either;
``decode_rows`` 61.2 us at its 32-token tiles of then, 58.6 at 16 (since its default), 57.2 with kept counters.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefixgate_kernels import decode_rows  # noqa: E402
from prefixgate_kernels.decode_attention import LOG2E, _unpack_8bit_pairs  # noqa: E402

MODES = {"loads": 0, "rows": 1, "mma": 2, "full": 3, "warps": 4, "keys": 5, "heads": -1}  # heads: decode_rows
# (batch, q heads, kv heads, head dim, context, block size); the probe takes the engine launcher's tiles and split
# count for each (``decode_attention.choose_tiles`` / ``choose_num_splits``)
CLASSES = {"9/3 hd64": (64, 9, 3, 64, 4096, 16), "32/8 hd128": (64, 32, 8, 128, 4096, 16)}


@triton.jit
def _ablation_kernel(q_ptr, k_ptr, v_ptr, kw_ptr, vw_ptr, bt_ptr, part_ptr, lse_ptr, qk_scale, split_tokens, seq_len,
                     stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     stride_wb, stride_ws, stride_wh, stride_btb,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr, WORDS: tl.constexpr, ROW_WORDS: tl.constexpr, MODE: tl.constexpr,
                     WARPS: tl.constexpr, QN: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, seq_len)
    rows = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + rows
    d = tl.arange(0, HEAD_DIM)
    dh = tl.arange(0, HEAD_DIM // 2)
    bt_row = bt_ptr + b * stride_btb
    if MODE <= 1:
        # words of a K / V row: one head's (loads) or every head's (rows: kvh is 0, the program's tokens span
        # all heads' columns, ROW_WORDS of WORDS real)
        w = tl.arange(0, WORDS)
        w_ok = w < ROW_WORDS
        seen = tl.zeros([BLOCK_N, WORDS], tl.int32)
        # the next tile's words are loaded before this tile's are used (a register prefetch: plain loads get no
        # cp.async pipeline, and call 1's form, without it, waited for every tile and streamed below the others)
        k_next, v_next = _tile_words(kw_ptr, vw_ptr, bt_row, start, end, kvh, w, w_ok, stride_wb, stride_ws,
                                     stride_wh, BLOCK_SIZE, BLOCK_N)
        for t0 in range(start, end, BLOCK_N):
            k_cur, v_cur = k_next, v_next
            k_next, v_next = _tile_words(kw_ptr, vw_ptr, bt_row, t0 + BLOCK_N, end, kvh, w, w_ok, stride_wb,
                                         stride_ws, stride_wh, BLOCK_SIZE, BLOCK_N)
            seen ^= k_cur ^ v_cur
        # one number a program, so that no load is dead code (the sum wraps; its value means nothing)
        tl.store(lse_ptr + (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split,
                 tl.sum(tl.sum(seen, 0), 0).to(tl.float32))
        return
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(rows < GROUP)[:, None],
                other=0.0).to(tl.float16)
    if MODE == 4:
        _per_warp_streams(q, k_ptr, v_ptr, bt_row, part_ptr, lse_ptr, qk_scale, start, end, b, kvh, split, rows, heads,
                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, WARPS)
        return
    if MODE == 5:
        _keys_as_m(q_ptr, k_ptr, v_ptr, bt_row, part_ptr, lse_ptr, qk_scale, start, end, b, kvh, split,
                   stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   GROUP, QN, HEAD_DIM, BLOCK_SIZE, BLOCK_N, WARPS)
        return
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc_e = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)
    acc_o = tl.zeros([GROUP_PAD, HEAD_DIM // 2], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        page = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slot = toks % BLOCK_SIZE
        k = tl.load(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=tok_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
        pairs = tl.load(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + dh[None, :],
                        mask=tok_ok[:, None], other=0)
        v_even, v_odd = _unpack_8bit_pairs(pairs, 1)
        if MODE == 2:
            p16 = (s * qk_scale).to(tl.float16)
            acc_e += tl.dot(p16, v_even)
            acc_o += tl.dot(p16, v_odd)
        else:
            s = tl.where(tok_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p16 = p.to(tl.float16)
            acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_even)
            acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_odd)
            m_i = m_new
    if MODE == 2:
        l_i += 1.0
        m_i = tl.zeros([GROUP_PAD], tl.float32)
    bh = b * (GROUP * tl.num_programs(1)) + heads
    p_row = part_ptr + (bh[:, None] * tl.num_programs(2) + split) * HEAD_DIM
    ok = (rows < GROUP)[:, None]
    tl.store(p_row + 2 * dh[None, :], acc_e / l_i[:, None], mask=ok)
    tl.store(p_row + 2 * dh[None, :] + 1, acc_o / l_i[:, None], mask=ok)
    tl.store(lse_ptr + bh * tl.num_programs(2) + split, m_i + tl.log2(l_i), mask=rows < GROUP)


@triton.jit
def _tile_words(kw_ptr, vw_ptr, bt_row, t0, end, kvh, w, w_ok, stride_wb, stride_ws, stride_wh,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The K and V words of tokens [t0, t0 + BLOCK_N) (zeros past ``end``)."""
    toks = t0 + tl.arange(0, BLOCK_N)
    tok_ok = toks < end
    page = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
    row = page[:, None] * stride_wb + (toks % BLOCK_SIZE)[:, None] * stride_ws + kvh * stride_wh + w[None, :]
    ok = tok_ok[:, None] & w_ok[None, :]
    return tl.load(kw_ptr + row, mask=ok, other=0), tl.load(vw_ptr + row, mask=ok, other=0)


@triton.jit
def _per_warp_streams(q, k_ptr, v_ptr, bt_row, part_ptr, lse_ptr, qk_scale, start, end, b, kvh, split, rows, heads,
                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr, WARPS: tl.constexpr):
    """The full mode's math as ``WARPS`` streams: tile keys ``t0 + w * BLOCK_N / WARPS + n`` belong to stream w, a
    batch index of every tensor (batched MMAs keep a batch in one warp), whose max, sum and output are its own
    until the end."""
    WN: tl.constexpr = BLOCK_N // WARPS
    wi = tl.arange(0, WARPS)
    ni = tl.arange(0, WN)
    d = tl.arange(0, HEAD_DIM)
    dh = tl.arange(0, HEAD_DIM // 2)
    q3 = tl.broadcast_to(q[None, :, :], (WARPS, GROUP_PAD, HEAD_DIM))
    m3 = tl.full([WARPS, GROUP_PAD], float("-inf"), tl.float32)
    l3 = tl.zeros([WARPS, GROUP_PAD], tl.float32)
    acc_e = tl.zeros([WARPS, GROUP_PAD, HEAD_DIM // 2], tl.float32)
    acc_o = tl.zeros([WARPS, GROUP_PAD, HEAD_DIM // 2], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + wi[:, None] * WN + ni[None, :]  # [WARPS, WN]
        tok_ok = toks < end
        page = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slot = toks % BLOCK_SIZE
        k = tl.load(k_ptr + page[:, :, None] * stride_kb + slot[:, :, None] * stride_ks + kvh * stride_kh
                    + d[None, None, :], mask=tok_ok[:, :, None], other=0.0)  # [WARPS, WN, D]
        s = tl.dot(q3, tl.trans(k.to(tl.float16), (0, 2, 1)))  # [WARPS, GROUP_PAD, WN]
        s = tl.where(tok_ok[:, None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m3, tl.max(s, 2))
        # a stream whose keys have all been masked so far keeps -inf: its alpha and p are taken as 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m3 - m_safe)
        p = tl.exp2(s - m_safe[:, :, None])
        l3 = l3 * alpha + tl.sum(p, 2)
        pairs = tl.load(v_ptr + page[:, :, None] * stride_vb + slot[:, :, None] * stride_vs + kvh * stride_vh
                        + dh[None, None, :], mask=tok_ok[:, :, None], other=0)  # [WARPS, WN, D/2]
        v_even, v_odd = _unpack_8bit_pairs(pairs, 1)
        p16 = p.to(tl.float16)
        acc_e = acc_e * alpha[:, :, None] + tl.dot(p16, v_even)
        acc_o = acc_o * alpha[:, :, None] + tl.dot(p16, v_odd)
        m3 = m_new
    m = tl.max(m3, 0)  # the streams merged, as splits are
    w = tl.where(m3 == float("-inf"), 0.0, tl.exp2(m3 - m[None, :]))
    l_i = tl.sum(l3 * w, 0)
    out_e = tl.sum(acc_e * w[:, :, None], 0) / l_i[:, None]
    out_o = tl.sum(acc_o * w[:, :, None], 0) / l_i[:, None]
    bh = b * (GROUP * tl.num_programs(1)) + heads
    p_row = part_ptr + (bh[:, None] * tl.num_programs(2) + split) * HEAD_DIM
    ok = (rows < GROUP)[:, None]
    tl.store(p_row + 2 * dh[None, :], out_e, mask=ok)
    tl.store(p_row + 2 * dh[None, :] + 1, out_o, mask=ok)
    tl.store(lse_ptr + bh * tl.num_programs(2) + split, m + tl.log2(l_i), mask=rows < GROUP)


@triton.jit
def _keys_as_m(q_ptr, k_ptr, v_ptr, bt_row, part_ptr, lse_ptr, qk_scale, start, end, b, kvh, split,
               stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               GROUP: tl.constexpr, QN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr, WARPS: tl.constexpr):
    """``_per_warp_streams`` transposed: the scores as S^T = K q^T with the ``QN`` (>= GROUP) query rows as the
    MMA's N, the softmax over axis 1 (keys) of [WARPS, WN, QN], the output as O^T = V^T P^T."""
    WN: tl.constexpr = BLOCK_N // WARPS
    wi = tl.arange(0, WARPS)
    ni = tl.arange(0, WN)
    d = tl.arange(0, HEAD_DIM)
    dh = tl.arange(0, HEAD_DIM // 2)
    rows = tl.arange(0, QN)
    heads = kvh * GROUP + rows
    q = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + d[:, None], mask=(rows < GROUP)[None, :],
                other=0.0).to(tl.float16)  # q^T [D, QN]
    q3 = tl.broadcast_to(q[None, :, :], (WARPS, HEAD_DIM, QN))
    m3 = tl.full([WARPS, QN], float("-inf"), tl.float32)
    l3 = tl.zeros([WARPS, QN], tl.float32)
    acc_e = tl.zeros([WARPS, QN, HEAD_DIM // 2], tl.float32)  # O's even and odd output dims
    acc_o = tl.zeros([WARPS, QN, HEAD_DIM // 2], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + wi[:, None] * WN + ni[None, :]  # [WARPS, WN]
        tok_ok = toks < end
        page = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        slot = toks % BLOCK_SIZE
        k = tl.load(k_ptr + page[:, :, None] * stride_kb + slot[:, :, None] * stride_ks + kvh * stride_kh
                    + d[None, None, :], mask=tok_ok[:, :, None], other=0.0)  # [WARPS, WN, D]
        s = tl.dot(k.to(tl.float16), q3)  # S^T [WARPS, WN, QN]
        s = tl.where(tok_ok[:, :, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m3, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m3 - m_safe)
        p = tl.exp2(s - m_safe[:, None, :])
        l3 = l3 * alpha + tl.sum(p, 1)
        pairs = tl.load(v_ptr + page[:, :, None] * stride_vb + slot[:, :, None] * stride_vs + kvh * stride_vh
                        + dh[None, None, :], mask=tok_ok[:, :, None], other=0)  # [WARPS, WN, D/2]
        v_even, v_odd = _unpack_8bit_pairs(pairs, 1)
        p16 = p.to(tl.float16)
        pt = tl.trans(p16, (0, 2, 1))  # P [WARPS, QN, WN]
        acc_e = acc_e * alpha[:, :, None] + tl.dot(pt, v_even)
        acc_o = acc_o * alpha[:, :, None] + tl.dot(pt, v_odd)
        m3 = m_new
    m = tl.max(m3, 0)
    w = tl.where(m3 == float("-inf"), 0.0, tl.exp2(m3 - m[None, :]))
    l_i = tl.sum(l3 * w, 0)
    out_e = tl.sum(acc_e * w[:, :, None], 0) / l_i[:, None]  # [QN, D/2]
    out_o = tl.sum(acc_o * w[:, :, None], 0) / l_i[:, None]
    bh = b * (GROUP * tl.num_programs(1)) + heads
    p_row = part_ptr + (bh[:, None] * tl.num_programs(2) + split) * HEAD_DIM
    ok = (rows < GROUP)[:, None]
    tl.store(p_row + 2 * dh[None, :], out_e, mask=ok)
    tl.store(p_row + 2 * dh[None, :] + 1, out_o, mask=ok)
    tl.store(lse_ptr + bh * tl.num_programs(2) + split, m + tl.log2(l_i), mask=rows < GROUP)


class Case:
    """One class's fp8 cache, block tables and query, and a launch of each mode over them."""

    def __init__(self, shape: tuple[int, ...], gen: torch.Generator, split_scale: int = 1,
                 layout: str = "token", device: str = "cuda") -> None:
        from benchmarks.kernels import paged_setup, quantize_cache
        from prefixgate_kernels import decode_attention
        from prefixgate_kernels.reference import FP8_DTYPE

        self.batch, self.q_heads, self.kv_heads, self.head_dim, self.context, self.block_size = shape
        sms = decode_attention.num_sms(torch.device(device))  # the interpreter's (tests): a small fake machine
        self.tiles = decode_attention.choose_tiles(self.head_dim, FP8_DTYPE, self.batch * self.kv_heads, sms)
        self.splits = decode_attention.choose_num_splits(
            self.batch, self.kv_heads, self.context, sms, self.tiles.block_n, programs_per_sm=self.tiles.programs_per_sm,
            one_wave=decode_attention.one_wave_rule_for(FP8_DTYPE)) * split_scale  # x split_scale: more programs
        kv, self.tables, self.lens = paged_setup(self.batch, self.kv_heads, self.head_dim, self.context,
                                                 self.block_size, gen, device=device, layout=layout)
        qkv, self.k_scale, self.v_scale = quantize_cache(kv, FP8_DTYPE)
        self.layout = layout  # quantize_cache kept paged_setup's page layout
        self.k16, self.v16 = kv[:, 0, 0], kv[:, 0, 1]  # the same cache in bf16, for the launcher's bf16 launch
        self.k, self.v = qkv[:, 0, 0], qkv[:, 0, 1]  # [NB, BS, Hkv, D] fp8, strided layer views
        self.q = torch.randn(self.batch, self.q_heads, self.head_dim, device=device, dtype=torch.bfloat16,
                             generator=gen)
        self.scale = 1 / math.sqrt(self.head_dim)
        # host floats, read once here: a launch inside a CUDA graph's capture may not read the device
        self.qk_scale = self.scale * LOG2E * float(self.k_scale)
        self.v_scale_value = float(self.v_scale)
        # keys a split, in whole tiles, as the engine's launcher cuts them
        self.split_tokens = triton.cdiv(triton.cdiv(self.context, self.splits), self.tiles.block_n) * self.tiles.block_n
        self.part = torch.empty(self.batch, self.q_heads, self.splits, self.head_dim, dtype=torch.float32,
                                device=device)
        self.lse = torch.empty(self.batch, self.q_heads, self.splits, dtype=torch.float32, device=device)
        # the heads mode's output (decode_rows merges its splits itself)
        self.out_heads = torch.empty_like(self.q)
        # the loads / rows modes' one number a program
        self.sink = torch.empty(self.batch * self.kv_heads * self.splits, dtype=torch.float32, device=device)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim

    def launch(self, mode: str) -> None:
        group = self.q_heads // self.kv_heads
        kw, vw = self.k.view(torch.int32), self.v.view(torch.int32)  # [NB, BS, Hkv, D / 4]
        vp = self.v.view(torch.int16)  # [NB, BS, Hkv, D / 2]: two fp8 values an element
        words = self.head_dim // 4
        grid = (self.batch, self.kv_heads, self.splits)
        split_tokens, row_words, block_n = self.split_tokens, words, self.tiles.block_n
        if mode == "rows":  # every head of a token in one program, Hkv times the programs along the context
            grid = (self.batch, 1, self.splits * self.kv_heads)
            split_tokens = triton.cdiv(self.context, self.splits * self.kv_heads)
            row_words = words * self.kv_heads
            block_n = max(16, block_n * words // triton.next_power_of_2(row_words))  # as many words a tile
        part, lse = self.part, self.sink if mode in ("loads", "rows") else self.lse
        if mode == "heads":  # the engine's kernel of this form: every head of a token's row in one program
            self.out_heads = decode_rows.paged_decode_rows(self.q, self.k, self.v, self.tables, self.lens, self.scale,
                                                           self.k_scale, self.v_scale)
            return
        options = {"maxnreg": self.tiles.max_registers} if self.tiles.max_registers else {}
        _ablation_kernel[grid](
            self.q, self.k, vp, kw, vw, self.tables, part, lse, self.qk_scale,
            split_tokens, self.context,
            self.q.stride(0), self.q.stride(1), *self.k.stride()[:3], *vp.stride()[:3], *kw.stride()[:3],
            self.tables.stride(0),
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=self.head_dim,
            BLOCK_SIZE=self.block_size, BLOCK_N=block_n, WORDS=triton.next_power_of_2(row_words), ROW_WORDS=row_words,
            MODE=MODES[mode], WARPS=self.tiles.num_warps, QN=max(8, triton.next_power_of_2(group)),
            num_warps=self.tiles.num_warps, num_stages=self.tiles.num_stages, **options)

    def merged(self, mode: str) -> torch.Tensor:
        """A computing mode's attention output: its partials merged in torch (log2-domain weights) times V's scale,
        or the heads mode's own output."""
        if mode == "heads":
            return self.out_heads
        w = torch.exp2(self.lse - self.lse.amax(-1, keepdim=True))
        return (self.part * w[..., None]).sum(2) / w.sum(-1)[..., None] * self.v_scale_value

    @property
    def modes(self) -> tuple[str, ...]:
        """The probe's modes this cache's layout allows: with head-major pages a token's heads are not one row, so
        neither the rows mode nor ``decode_rows`` (which refuses such a cache) reads it."""
        return tuple(m for m in MODES if self.layout == "token" or m not in ("rows", "heads"))

    def engine(self) -> torch.Tensor:
        """The engine's launch."""
        from prefixgate_kernels import decode_attention

        return decode_attention.paged_decode(self.q, self.k, self.v, self.tables, self.lens, self.scale,
                                             self.k_scale, self.v_scale)

    def engine_bf16(self) -> torch.Tensor:
        """The engine's launcher on the same cache in bf16 (its own tiles and splits): the ratio's denominator."""
        from prefixgate_kernels import triton_ops

        return triton_ops.paged_decode_attention(self.q, self.k16, self.v16, self.tables, self.lens, self.scale)


def batch_fits(classes: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """Each launch's time against its bytes over the 9 / 3 class's batches, a line a page layout:
    {layout: {launch: {"TBps": the rate past the fixed cost, "fixed_us": the fixed cost}}} (bf16 against its own
    bytes, twice fp8's). Needs two batches or more; the 9 / 3 rows are those of shape (*, 9, 3, 64, 4096, 16)."""
    from benchmarks.kernels import line_fit

    points: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for row in classes.values():
        if tuple(row["shape"][1:]) != CLASSES["9/3 hd64"][1:]:
            continue
        per_layout = points.setdefault(row["layout"], {})
        for name, times in row["ms"].items():
            if all(t is not None for t in times):
                nbytes = row["kv_bytes"] * (2 if name == "engine_bf16" else 1)
                per_layout.setdefault(name, []).append((nbytes, min(times)))
    return {layout: {name: line_fit(pts) for name, pts in launches.items() if len(pts) >= 2}
            for layout, launches in points.items()}


# decode_rows launches beside its defaults (tile tokens, stages, splits; None: the default), each with the merge
# counters kept by the caller as the engine's graph keeps them ("kept") or zeroed by the launch (a memset node)
ROWS_VARIANTS = [
    (None, 5, None), (None, 4, None), (None, 3, None), (32, 5, None), (32, 3, None), (64, 5, None),
    (None, 5, "x0.5"), (None, 5, "x2"), (None, 5, "pps5"),
]


def rows_variants(case: Case, rounds: int) -> dict[str, float | None]:
    """``decode_rows.paged_decode_rows`` on ``case`` over ``ROWS_VARIANTS`` -> {label: best graph ms}."""
    from benchmarks.kernels import bench_graph
    from prefixgate_kernels.decode_attention import choose_num_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_splits = choose_num_splits(case.batch, 1, case.context, sms, 256,
                                                   programs_per_sm=decode_rows.PROGRAMS_PER_SM)
    counters = torch.zeros(case.batch, dtype=torch.int32, device="cuda")
    out: dict[str, float | None] = {}
    for block_n, stages, splits in ROWS_VARIANTS:
        # pps5: the splits that fill 5 programs an SM (the 16-token launch's registers and shared memory fit 5)
        n = {None: default_splits, "x0.5": max(1, default_splits // 2), "x2": default_splits * 2,
             "pps5": choose_num_splits(case.batch, 1, case.context, sms, 256, programs_per_sm=5)}[splits]
        for kept in (False, True):
            def launch(block_n=block_n, stages=stages, n=n, kept=kept):
                decode_rows.paged_decode_rows(case.q, case.k, case.v, case.tables, case.lens, case.scale,
                                              case.k_scale, case.v_scale, num_splits=n, block_n=block_n,
                                              num_stages=stages, merge_counters=counters if kept else None)
            label = f"bn{block_n or decode_rows.tile_tokens(case.kv_heads, case.head_dim, case.k.dtype)}_s{stages}" \
                    f"_sp{n}{'_kept' if kept else ''}"
            times = [t for t in (bench_graph(launch) for _ in range(rounds)) if t is not None]
            out[label] = min(times) if times else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/decode_fp8_ablation.json")
    ap.add_argument("--rounds", type=int, default=2, help="times every launch is timed, in turn")
    ap.add_argument("--split-scales", default="1",
                    help="comma-separated multiples of the launcher's split count: past 1, the probe's loads, rows, "
                         "mma and full modes again with that many times the programs (more bytes in flight an SM)")
    ap.add_argument("--rows-variants", action="store_true",
                    help="also decode_rows (the heads mode) over ROWS_VARIANTS on the 9 / 3 class: tile tokens, pipeline stages and "
                         "split counts around its defaults, and with the merge counters kept by the caller")
    ap.add_argument("--block-sizes", default="16",
                    help="comma-separated cache block sizes (tokens a page) of the 9 / 3 class: past 16, the class "
                         "again with pages that long (larger contiguous chunks of whole token rows)")
    ap.add_argument("--batches", default="64",
                    help="comma-separated batch sizes of the 9 / 3 class: past 64, the class again with that many "
                         "sequences (a launch of more bytes: how much its fixed costs weigh)")
    ap.add_argument("--layouts", default="token",
                    help="comma-separated page layouts of the 9 / 3 class: 'token' (the engine's: a token's heads "
                         "adjacent) and 'head' (each page head by head: a program's bytes contiguous a page); "
                         "past token, the class and its --batches again head-major")
    args = ap.parse_args()
    from benchmarks.pdl_o_probe import start_gpu_run

    run = start_gpu_run("benchmarks/decode_fp8_ablation.py")
    if run is None:
        return 2
    from benchmarks.kernels import bench_graph, rel_err
    from prefixgate_kernels import reference as ref

    result: dict = {**run.header(1), "classes": {}}
    print(f"{result['gpu']}: copy {run.copy_TBps:.2f} TB/s, {run.sms} SMs", flush=True)
    lines = []
    classes = dict(CLASSES)
    for bs in (int(x) for x in args.block_sizes.split(",") if int(x) != 16):
        classes[f"9/3 bs{bs}"] = (*CLASSES["9/3 hd64"][:5], bs)
    nine_three = [("9/3 hd64", CLASSES["9/3 hd64"])]
    for batch in (int(x) for x in args.batches.split(",") if int(x) != 64):
        classes[f"9/3 b{batch}"] = (batch, *CLASSES["9/3 hd64"][1:])
        nine_three.append((f"9/3 b{batch}", classes[f"9/3 b{batch}"]))
    cases = [(label, shape, "token") for label, shape in classes.items()]
    for layout in (x for x in args.layouts.split(",") if x != "token"):
        if layout != "head":
            ap.error(f"--layouts: unknown layout {layout!r} (token, head)")
        cases += [(f"{label} {layout}", shape, layout) for label, shape in nine_three]
    for label, shape, layout in cases:
        case = Case(shape, run.gen, layout=layout)
        n = min(case.batch, 4)
        want = ref.paged_decode_attention(case.q[:n], case.k, case.v, case.tables[:n], case.lens[:n], case.scale,
                                          case.k_scale, case.v_scale)
        want16 = ref.paged_decode_attention(case.q[:n], case.k16, case.v16, case.tables[:n], case.lens[:n],
                                            case.scale)
        errs = {}
        computing = [m for m in ("full", "warps", "keys", "heads") if m in case.modes]
        for mode in computing:  # the modes that compute the attention, against the reference
            case.launch(mode)
            errs[f"{mode}_rel_err"] = rel_err(case.merged(mode)[:n], want)
        row: dict = {**errs, "shape": shape, "layout": layout, "kv_bytes": case.kv_bytes, "splits": case.splits,
                     "tiles": {"block_n": case.tiles.block_n, "num_stages": case.tiles.num_stages,
                               "num_warps": case.tiles.num_warps, "max_registers": case.tiles.max_registers},
                     "engine_rel_err": rel_err(case.engine()[:n], want),
                     "engine_bf16_rel_err": rel_err(case.engine_bf16()[:n], want16),
                     "ms": {}}
        launches = {"engine": case.engine, "engine_bf16": case.engine_bf16,
                    **{m: (lambda m=m, c=case: c.launch(m)) for m in case.modes}}
        for _ in range(args.rounds):
            for name, fn in launches.items():
                row["ms"].setdefault(name, []).append(bench_graph(fn))
        best = {k: min(v) for k, v in row["ms"].items() if all(x is not None for x in v)}
        # bf16 moves twice the fp8 bytes: its share of copy against its own bytes
        row["pct_copy"] = {k: case.kv_bytes * (2 if k == "engine_bf16" else 1) / (ms * 1e-3) / 1e12 / run.copy_TBps
                           for k, ms in best.items()}
        if "engine" in best and "engine_bf16" in best:
            row["fp8_over_bf16"] = best["engine_bf16"] / best["engine"]
        result["classes"][label] = row
        lines.append(f"{label:<11} " + "  ".join(f"{k} {best[k] * 1000:6.1f} us ({row['pct_copy'][k]:.0%})"
                                                  for k in ("engine", "engine_bf16", *case.modes) if k in best)
                     + (f"  fp8/bf16 {row['fp8_over_bf16']:.2f}" if "fp8_over_bf16" in row else "")
                     + "   err " + " ".join(f"{k.removesuffix('_rel_err')} {v:.1e}" for k, v in row.items()
                                             if k.endswith("_rel_err")))
        if args.rows_variants and label == "9/3 hd64":  # the heads mode alone covers the other pages and the control
            row["rows_variants_ms"] = rows_variants(case, args.rounds)
            lines.append(f"{label:<11} whole rows: " + "  ".join(f"{k} {v * 1000:.1f}" for k, v in
                                                               row["rows_variants_ms"].items() if v is not None))
        del case
        torch.cuda.empty_cache()
        for scale in (int(x) for x in args.split_scales.split(",") if int(x) > 1 and layout == "token"):
            case = Case(shape, run.gen, split_scale=scale)
            more = {}
            for m in ("loads", "rows", "mma", "full"):
                times = [t for t in (bench_graph(lambda m=m, c=case: c.launch(m)) for _ in range(args.rounds))
                         if t is not None]
                if times:
                    more[m] = min(times)
            row[f"ms_splits_x{scale}"] = more
            lines.append(f"{label:<11} splits x{scale} ({case.splits}): " + "  ".join(
                f"{k} {v * 1000:6.1f} us ({case.kv_bytes / (v * 1e-3) / 1e12 / run.copy_TBps:.0%})"
                for k, v in more.items()))
            del case
            torch.cuda.empty_cache()
    result["fits"] = batch_fits(result["classes"])
    for layout, fits in result["fits"].items():
        lines.append(f"fits, 9 / 3 over batches, {layout} pages: " + "  ".join(
            f"{k} {f['fixed_us']:.1f} us + {f['TBps'] / run.copy_TBps:.0%}" for k, f in fits.items()
            if f["TBps"] is not None))
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
