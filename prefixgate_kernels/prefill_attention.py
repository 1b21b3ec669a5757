"""Paged ragged prefill attention: packed new tokens of many sequences over their block tables.

Sequence b's new tokens are q[cu_seqlens_q[b] : cu_seqlens_q[b+1]]; they sit at absolute
positions ``seq_lens[b] - q_len .. seq_lens[b] - 1`` and their K/V are already in the cache. A query
at position p sees keys 0..p (cached prefix fully, the new tokens causally)::

    keys  0 ...................... prefix ............. seq_len
    q row i (pos = prefix + i)     |-- all visible --|-- causal --|
    loop 1: [0, prefix + m_start) rounded down to BLOCK_N   no mask needed
    loop 2: the rest up to min(seq_len, prefix + m_end)      causal + length mask

grid = (q_heads, ceil(max_q_len / BLOCK_M), num_seqs * num_splits); q heads vary fastest so the
``group`` heads that read one KV head run side by side and share its tiles through L2.

Split-KV (``num_splits > 1``, the ``SPLIT`` variant, for grids that leave most of the GPU idle: a
short suffix over a long cached prefix is a few query tiles per head)::

    tile's keys [0, kv_end)   |<- split 0 ->|<- split 1 ->|<- ... ->|   each BLOCK_N-aligned
    program (h, m, b, s)      attends its split only, writes o_s = acc / l and lse_s = m + log2 l
    _merge_kernel             o = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)   (flash-decoding)

A split may hold no key a row can see (all masked): its m stays -inf, so the update guards the
exponent base and the partial is (0, lse = -inf), which the merge weights by zero.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import cdiv, dot_dtype, kv_code, next_pow2, num_sms, placeholder, scale_args
from prefixgate_kernels._dot import exact_dot, exact_dot_acc
from prefixgate_kernels.launch_layout import CacheLayout

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, k_scale_ptr, v_scale_ptr,
    kv_head, q_pos, lo, hi, seq_len, score_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_QUANT: tl.constexpr, DOT_TY: tl.constexpr, ROWS_MAY_BE_EMPTY: tl.constexpr,
):
    """Online softmax over keys [lo, hi). ``score_scale`` = softmax scale * log2(e) (* the fp8 key
    scale): applied to the row max and inside one FMA with the max subtraction, not as a separate
    pass over the scores. Unmasked tiles (every key visible to every row, all < seq_len) load and
    compute without predicates."""
    d = tl.arange(0, HEAD_DIM)
    for n0 in range(lo, hi, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        slot = toks % BLOCK_SIZE
        if MASKED:
            tok_ok = toks < seq_len
            page = tl.load(bt_row + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + toks // BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        v_ptrs = v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=tok_ok[:, None], other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_ptrs, mask=tok_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = exact_dot(q, tl.trans(k.to(DOT_TY)), DOT_TY)  # [BLOCK_M, BLOCK_N] fp32
        if KV_QUANT == 2:
            sc_off = page * stride_sb + slot * stride_ss + kv_head * stride_sh
            if MASKED:
                s = s * tl.load(k_scale_ptr + sc_off, mask=tok_ok, other=0.0)[None, :]
            else:
                s = s * tl.load(k_scale_ptr + sc_off)[None, :]
        if MASKED:
            s = tl.where((toks[None, :] <= q_pos[:, None]) & tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * score_scale)
        if ROWS_MAY_BE_EMPTY:  # a row with no visible key yet: -inf - -inf would be NaN
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_base = m_new
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s * score_scale - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT == 2:
            if MASKED:
                p = p * tl.load(v_scale_ptr + sc_off, mask=tok_ok, other=0.0)[None, :]
            else:
                p = p * tl.load(v_scale_ptr + sc_off)[None, :]
        # scale the accumulator, then let the MMA accumulate into it: one [BLOCK_M, D] fp32 tile
        # live instead of two (the product and the running sum)
        acc = exact_dot_acc(p.to(DOT_TY), v.to(DOT_TY), acc * alpha[:, None], DOT_TY)
        m_i = m_new
    return acc, m_i, l_i


# The block table's row stride is its width, which changes with the longest context in the batch:
# left to Triton's default it would be specialised on divisibility by 16 and compile a second variant
# the first time the width is not a multiple of 16 (seen on the H200: the engine's first mixed
# prefill+decode step took 2.1 s instead of 0.4 s, a 129-block table after 128-block ones).
# ``num_tokens`` (the step's token count, used only to index the split partials) likewise, and
# ``num_splits``: one compile serves every split count (a split count as a constexpr compiled each
# of 2, 4, 8, 16 apart, ~1.5 s each on the H200's host, at a graph capture or a first step). Timed
# as CUDA-graph replays the run-time count costs nothing: steps of 16-512 tokens over 8K cached at
# head dims 128 and 64, 0.035-0.194 ms, equal to the constexpr kernel's within 0.001 ms in one call
# (session 11, docs/gpu.md); session 9's "slower" figures were host-bound eager timings.
@triton.jit(do_not_specialize=["stride_btb", "num_tokens", "num_splits"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [NB, BS, Hkv, D] (strided)
    v_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,  # [T, Hq, D]                       (written when not SPLIT)
    part_out_ptr,  # [num_splits, T, Hq, D] fp32     (written when SPLIT)
    part_lse_ptr,  # [num_splits, T, Hq] fp32, log2 domain
    qk_scale,
    num_tokens,
    num_splits,  # KV splits per sequence (the grid's third dimension / sequences); 1 when not SPLIT
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
    SPLIT: tl.constexpr,
):
    h = tl.program_id(0)
    m_tile = tl.program_id(1)
    b = tl.program_id(2)
    split = 0
    if SPLIT:
        b = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
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

    score_scale = qk_scale
    v_tensor_scale = 1.0
    if KV_QUANT == 1:
        score_scale = qk_scale * tl.load(k_scale_ptr)
        v_tensor_scale = tl.load(v_scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b * stride_btb
    full_end = ((prefix + m_start) // BLOCK_N) * BLOCK_N  # keys every row of the tile sees
    kv_end = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
    lo = 0
    hi = kv_end
    if SPLIT:
        split_keys = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * split_keys
        hi = tl.minimum(lo + split_keys, kv_end)
    acc, m_i, l_i = _attend_tile(
        acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, k_scale_ptr, v_scale_ptr,
        kv_head, q_pos, lo, tl.minimum(hi, full_end), seq_len, score_scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
        False, HEAD_DIM, BLOCK_SIZE, BLOCK_N, KV_QUANT, DOT_TY, False,
    )
    acc, m_i, l_i = _attend_tile(
        acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, k_scale_ptr, v_scale_ptr,
        kv_head, q_pos, tl.maximum(lo, full_end), hi, seq_len, score_scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
        True, HEAD_DIM, BLOCK_SIZE, BLOCK_N, KV_QUANT, DOT_TY, SPLIT,
    )
    if not SPLIT:
        acc = acc * v_tensor_scale / l_i[:, None]
        o_ptrs = out_ptr + (q_lo + rows)[:, None] * stride_ot + h * stride_oh + d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        seen = l_i > 0.0
        o_part = acc * (v_tensor_scale / tl.where(seen, l_i, 1.0))[:, None]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        # partials are [num_splits, T, Hq, (D)] contiguous; Hq = the grid's first dimension
        lse_idx = (split * num_tokens + q_lo + rows) * tl.num_programs(0) + h  # [BLOCK_M]
        tl.store(part_out_ptr + lse_idx.to(tl.int64)[:, None] * HEAD_DIM + d[None, :], o_part, mask=row_ok[:, None])
        tl.store(part_lse_ptr + lse_idx, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_kernel(
    part_out_ptr,  # [NUM_SPLITS, T, Hq, D] fp32
    part_lse_ptr,  # [NUM_SPLITS, T, Hq] fp32
    out_ptr,  # [T, Hq, D]
    num_tokens,
    q_heads,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One token, all its heads: o = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max_s lse_s)."""
    t = tl.program_id(0)
    hs = tl.arange(0, HEADS_PAD)
    h_ok = hs < q_heads
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + (sp * num_tokens + t) * q_heads + hs, mask=h_ok, other=float("-inf"))
        m = tl.maximum(m, lse)
    m = tl.where(m == float("-inf"), 0.0, m)  # padded heads (every real row sees at least key 0)
    w_sum = tl.zeros([HEADS_PAD], tl.float32)
    acc = tl.zeros([HEADS_PAD, HEAD_DIM], tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        idx = (sp * num_tokens + t) * q_heads + hs
        w = tl.exp2(tl.load(part_lse_ptr + idx, mask=h_ok, other=float("-inf")) - m)  # 0 for an empty split
        o = tl.load(part_out_ptr + idx.to(tl.int64)[:, None] * HEAD_DIM + d[None, :], mask=h_ok[:, None], other=0.0)
        acc += o * w[:, None]
        w_sum += w
    acc = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + hs[:, None] * stride_oh + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None])


@dataclass(frozen=True)
class PrefillTiles:
    """Query rows and keys per tile, warps, and how many such programs an SM holds at once (the wave
    that ``choose_prefill_splits`` fills)."""

    block_m: int
    block_n: int
    num_warps: int
    programs_per_sm: int


def choose_prefill_tiles(num_tokens: int, on_gpu: bool) -> PrefillTiles:
    """GPU tiles from the H200 sweeps:

    * 128 x 128, 8 warps (one program per SM: ~255 registers a thread): fastest at 4 x (8,192 + 512)
      (session 1 run 1) and at the 1 x (7,680 + 512) hit (0.194 ms against 0.205 for 64 x 64, session 4 run 1).
    * a step of at most 64 new tokens: 64 x 64, 4 warps (two programs per SM): half of a 128-row tile
      would be padding. 1 x (8,128 + 64): 0.048 ms at 8 splits against 0.071 for 128 x 128 at its best
      (4 splits) and 0.194 unsplit (session 4 run 1).
    The interpreter gets small tiles (its cost is per element, and the tests want several tiles).

    Tried and taken out (session 10, docs/gpu.md): packing the q heads of one KV head into a tile's
    rows, so that each K/V tile is loaded once per group instead of once per head. Timed as CUDA-graph
    replays it equalled these tiles wherever both were timed at their own split counts (1 x (7,680 +
    512): 0.191 ms both; 1 x (8,128 + 64): 0.047 both; head dim 64 at 16 and 64 tokens and both head
    dims at 128 and 256 tokens: within 3 %): these steps are not bound by the K/V traffic through L2.
    """
    if not on_gpu:
        return PrefillTiles(block_m=16, block_n=16, num_warps=4, programs_per_sm=1)
    if num_tokens <= 64:
        return PrefillTiles(block_m=64, block_n=64, num_warps=4, programs_per_sm=2)
    return PrefillTiles(block_m=128, block_n=128, num_warps=8, programs_per_sm=1)


# One program's fixed cost in keys of streaming: its prologue (q load), the partial's write and its
# share of the merge (the merge reads NUM_SPLITS fp32 rows per output row).
_SPLIT_OVERHEAD_KEYS = 256
# Each split streams at least this many keys: below it the partials cost more than the split saves.
_MIN_SPLIT_KEYS = 1024
# the most KV splits a launch takes (powers of two up to it): the merge compiles once per count
MAX_PREFILL_SPLITS = 16


def choose_prefill_splits(q_tiles: int, q_heads: int, max_context: int, num_sms: int,
                          programs_per_sm: int = 1) -> int:
    """KV splits for a prefill launch of ``q_tiles`` query tiles per head (summed over sequences).

    A launch runs ``ceil(programs / wave)`` waves of ``~max_context / splits + overhead`` keys each;
    pick the power of two that minimises that. A grid that fills the GPU stays at one split (the
    1 x (7,680 + 512) prefix hit: 4 tiles x 32 heads = 128 programs on 132 SMs), a short suffix over
    a long prefix splits (1 x (8,128 + 64) on 64-row tiles, two per SM: 32 programs, 8 splits of 1K
    keys fill 256 of 264 slots).
    """
    programs = max(1, q_tiles * q_heads)
    wave = max(1, num_sms * programs_per_sm)
    best, best_cost = 1, None
    s = 1
    while s <= MAX_PREFILL_SPLITS and (s == 1 or max_context / s >= _MIN_SPLIT_KEYS):
        cost = math.ceil(programs * s / wave) * (max_context / s + _SPLIT_OVERHEAD_KEYS)
        if best_cost is None or cost < best_cost * 0.97:  # fewer splits unless clearly better
            best, best_cost = s, cost
        s *= 2
    return best


def splits_for_launch(num_tokens: int, num_seqs: int, q_heads: int, max_context: int, num_sms: int,
                      block_m: int, programs_per_sm: int) -> int:
    """``choose_prefill_splits`` for a packed step: one sequence's chunk is all ``num_tokens``; with
    more sequences each has at least one query tile and together at most T / block_m + B - 1."""
    q_tiles = -(-num_tokens // block_m) + (num_seqs - 1)
    return choose_prefill_splits(q_tiles, q_heads, max_context, num_sms, programs_per_sm)


def launch_splits(num_tokens: int, num_seqs: int, q_heads: int, max_context: int, device: torch.device,
                  layout: CacheLayout | None = None) -> int:
    """The split count ``paged_prefill`` launches with its default tiles when the longest of its
    ``context_lens`` is ``max_context`` (``plan_prefill``: give the cache's ``layout`` where a Gluon kernel may
    take the launch). A CUDA graph captured with a context hint replays that launch for any context (the
    kernel divides each sequence's keys among the splits at run time), so a graph runner keys its graphs
    by this (engine/prefill_graphs.py)."""
    return plan_prefill(num_tokens, num_seqs, q_heads, max_context, device, layout).splits


class PrefillKernel(enum.Enum):
    """The kernel a 16-bit GPU launch runs (``gluon_kernel``): unsplit of at least ``GLUON_MIN_TOKENS`` rows,
    or split of at least ``GLUON_SPLIT_MIN_TOKENS`` (the specialised kernel only)."""

    TRITON = "triton"  # _prefill_kernel below: every dtype, splits, the CPU interpreter
    OVERLAP = "overlap"  # prefixgate_kernels/prefill_overlap.py (Gluon): the softmax under P V in one program
    SPECIALIZED = "specialized"  # prefixgate_kernels/prefill_specialized.py (Gluon): a loader, two consumers


# The warp-specialised Gluon kernel takes the unsplit 16-bit launches at head dims 64 and 128: graph replays
# on the H200 (session 22 call 2, docs/gpu.md), 32 / 8 heads, against this kernel: head dim 128 1 x (7,680 +
# 512) 0.192 -> 0.133 ms, 4 x (8,192 + 512) 0.760 -> 0.579, a cold 2K prompt 0.133 -> 0.099; head dim 64
# 0.147 -> 0.095, 0.574 -> 0.382, 0.095 -> 0.073 (the overlapped kernel, session 21's choice there: 0.131,
# 0.395, 0.077), at these tiles.
# Its split form takes the launches Triton would split (few heads, short chunks over long prefixes),
# splitting over its own 128-row tiles (session 24 call 1, graph replays against Triton's split launches):
# head dim 64 9 / 3 heads 1 x (7,680 + 512) 0.0676 -> 0.0526 ms at 8 splits (its own pick; 0.0575 at 4), a
# 64-token suffix over 8,128 cached at 32 / 8 heads 0.0491 -> 0.0446 at 4 splits (head dim 64 0.0354 ->
# 0.0341). Where its own tiles would not split (a short chunk whose heads fill the GPU) Triton keeps it:
# its unsplit form on 64 rows (half a program) was not measured faster (0.1228 ms on that suffix).
PREFILL_KERNEL = PrefillKernel.SPECIALIZED  # the benchmarks' switch (kernels.py, engine_gpu.py --prefill-attention)
GLUON_HEAD_DIMS = (64, 128)
GLUON_MIN_TOKENS = 128
GLUON_SPLIT_MIN_TOKENS = 64
SPECIALIZED_ROWS = 128  # a program's query rows: two consumer warpgroups of 64


class OverlapTiles(TypedDict):  # paged_prefill_overlap's tile arguments
    block_m: int
    block_n: int
    num_buf: int
    num_warps: int


class SpecializedTiles(TypedDict):  # paged_prefill_specialized's
    block_n: int
    num_buf: int
    pingpong: bool


OVERLAP_TILES: OverlapTiles = {"block_m": 128, "block_n": 64, "num_buf": 3, "num_warps": 8}
SPECIALIZED_TILES: SpecializedTiles = {"block_n": 128, "num_buf": 3, "pingpong": True}


# Gluon (triton.experimental.gluon) is experimental and its API moves between releases (3.9 removed the
# async_copy_global_to_shared these kernels call), and their MMAs are Hopper's wgmma (sm_90 only: Ampere
# and Ada lack it, Blackwell replaced it). So they run where they were written and measured, Triton 3.6 on
# an sm_90 GPU; anywhere else the Triton kernel takes their launches.
GLUON_TRITON = (3, 6)
GLUON_CAPABILITY = (9, 0)


def gluon_supported(capability: tuple[int, int], triton_version: str) -> bool:
    """Whether the Gluon prefills can run: an sm_90 device and the Triton release they were written for."""
    major_minor = tuple(int(part) for part in triton_version.split(".")[:2] if part.isdigit())
    return tuple(capability) == GLUON_CAPABILITY and major_minor == GLUON_TRITON


_GLUON_ON: dict[torch.device, bool] = {}


def gluon_runs_on(device: torch.device) -> bool:
    """``gluon_supported`` for a CUDA device (cached per device: the capability query is a driver call)."""
    if device.type != "cuda":
        return False
    if device not in _GLUON_ON:
        _GLUON_ON[device] = gluon_supported(torch.cuda.get_device_capability(device), triton.__version__)
    return _GLUON_ON[device]


def gluon_kernel(num_tokens: int, head_dim: int, block_size: int, q_dtype: torch.dtype, k_dtype: torch.dtype,
                 v_dtype: torch.dtype, *, split: bool = False) -> PrefillKernel:
    """``PREFILL_KERNEL`` where a GPU launch fits it (16-bit, one dtype, a measured head dim, cache blocks
    that tile its key tiles whole, at least ``GLUON_MIN_TOKENS`` rows), else ``TRITON``. A ``split`` launch
    fits the specialised kernel alone (the overlapped one has no split form), from
    ``GLUON_SPLIT_MIN_TOKENS`` rows."""
    kernel = PREFILL_KERNEL
    tiles = {PrefillKernel.OVERLAP: OVERLAP_TILES, PrefillKernel.SPECIALIZED: SPECIALIZED_TILES}.get(kernel)
    min_tokens = GLUON_SPLIT_MIN_TOKENS if split else GLUON_MIN_TOKENS
    if (tiles is None or head_dim not in GLUON_HEAD_DIMS or num_tokens < min_tokens
            or (split and kernel is not PrefillKernel.SPECIALIZED)
            or tiles["block_n"] % block_size
            or q_dtype not in (torch.bfloat16, torch.float16) or k_dtype != q_dtype or v_dtype != q_dtype):
        return PrefillKernel.TRITON
    return kernel


@dataclass(frozen=True)
class PrefillPlan:
    """The kernel a launch runs and its KV split count."""

    kernel: PrefillKernel
    splits: int


def plan_prefill(num_tokens: int, num_seqs: int, q_heads: int, max_context: int | None, device: torch.device,
                 layout: CacheLayout | None) -> PrefillPlan:
    """What ``paged_prefill`` launches at its default tiles for ``num_tokens`` new tokens of ``num_seqs``
    sequences, the longest context after the step being ``max_context`` (None: no hint, no split).

    Triton's tiles decide whether the launch splits at all (``choose_prefill_splits``: a grid that leaves
    SMs idle). Where it does, and the specialised Gluon kernel fits (``gluon_kernel(split=True)``), that
    kernel takes it with the split count its own 128-row tiles ask for, one program an SM; should those
    ask for none, Triton keeps the launch. An unsplit launch goes to the Gluon kernel that fits, if any.
    ``layout`` None (a caller that does not describe its cache) or a device the Gluon kernels do not run
    on: Triton."""
    on_gpu = device.type == "cuda"
    tiles = choose_prefill_tiles(num_tokens, on_gpu)
    splits = 1
    if max_context is not None:
        splits = splits_for_launch(num_tokens, num_seqs, q_heads, max_context, num_sms(device), tiles.block_m,
                                   tiles.programs_per_sm)
    if layout is None or not gluon_runs_on(device):
        return PrefillPlan(PrefillKernel.TRITON, splits)
    kernel = gluon_kernel(num_tokens, layout.head_dim, layout.block_size, layout.q_dtype, layout.kv_dtype,
                          layout.kv_dtype, split=splits > 1)
    if kernel is PrefillKernel.TRITON or splits == 1:
        return PrefillPlan(kernel, splits)
    # from 65 rows on Triton's tiles are the specialised kernel's (128 rows, one an SM): the same count
    same_tiles = (tiles.block_m, tiles.programs_per_sm) == (SPECIALIZED_ROWS, 1)
    assert max_context is not None  # splits > 1 came from it
    own = splits if same_tiles else splits_for_launch(num_tokens, num_seqs, q_heads, max_context, num_sms(device),
                                                      SPECIALIZED_ROWS, 1)
    return PrefillPlan(kernel, own) if own > 1 else PrefillPlan(PrefillKernel.TRITON, splits)


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
    num_splits: int | None = None,
    context_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Launch the ragged prefill kernel (+ the split merge). Inputs are checked by ``prefixgate_kernels.triton_ops``.

    ``max_q_len`` sizes the grid; when None the bound ``T`` is used: reading the real maximum off
    the device costs a host sync (~0.1 ms, measured) while surplus tiles exit after two loads.
    ``context_lens`` (host ints, each sequence's context after this chunk, as the scheduler knows
    it) lets ``choose_prefill_splits`` split a launch that would leave the GPU idle; without it,
    or with ``num_splits`` given, no guess is made (one split unless told). At the default tiles the
    kernel and its splits are ``plan_prefill``'s.
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
    tiles = choose_prefill_tiles(num_tokens, on_gpu)
    overridden = (block_m, block_n, num_warps) != (None, None, None)
    block_m = block_m if block_m is not None else tiles.block_m
    block_n = block_n if block_n is not None else tiles.block_n
    if num_warps is None:
        num_warps = tiles.num_warps if not overridden else (8 if block_m >= 128 else 4)
    longest = max(int(n) for n in context_lens) if context_lens is not None and len(context_lens) == num_seqs else None
    if overridden or not on_gpu:
        # the benchmarks' tile sweeps and the interpreter: Triton, split as those tiles ask
        kernel = PrefillKernel.TRITON
        if num_splits is None:
            per_sm = 1 if overridden else tiles.programs_per_sm
            num_splits = 1 if longest is None else splits_for_launch(
                num_tokens, num_seqs, q_heads, longest, num_sms(q.device), block_m, per_sm)
    elif num_splits is None:
        layout = CacheLayout.of(q.dtype, k_cache) if k_cache.dtype == v_cache.dtype else None
        plan = plan_prefill(num_tokens, num_seqs, q_heads, longest, q.device, layout)
        kernel, num_splits = plan.kernel, plan.splits
    else:
        # a caller's own split count: the Gluon kernel for an unsplit launch that fits it, Triton's splits
        # otherwise (the benchmarks time Triton's split launches by this)
        kernel = (gluon_kernel(num_tokens, head_dim, block_size, q.dtype, k_cache.dtype, v_cache.dtype)
                  if num_splits == 1 and gluon_runs_on(q.device) else PrefillKernel.TRITON)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    code = kv_code(k_cache)
    if kernel is PrefillKernel.SPECIALIZED:
        # Gluon: compiled GPUs only
        from prefixgate_kernels.prefill_specialized import paged_prefill_specialized

        return paged_prefill_specialized(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                         max_q_len=max_q_len, num_splits=num_splits, **SPECIALIZED_TILES)
    if kernel is PrefillKernel.OVERLAP:
        from prefixgate_kernels.prefill_overlap import paged_prefill_overlap

        return paged_prefill_overlap(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                     max_q_len=max_q_len, **OVERLAP_TILES)
    ks, vs, sc_strides = scale_args(k_cache, k_scale, v_scale)
    part_out, part_lse = split_partials(num_splits, q)
    grid = (q_heads, cdiv(max_q_len, block_m), num_seqs * num_splits)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, ks, vs, out, part_out, part_lse,
        scale * LOG2E, num_tokens, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *sc_strides,
        out.stride(0), out.stride(1),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, KV_QUANT=code, DOT_TY=dot_dtype(q.dtype, k_cache), SPLIT=num_splits > 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        merge_splits(part_out, part_lse, out)
    return out


def split_partials(num_splits: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partials for queries ``q`` [T, Hq, D]: ``part_out`` [S, T, Hq, D] and ``part_lse``
    [S, T, Hq], fp32; one split writes none, and gets a placeholder for both (one kernel signature)."""
    if num_splits == 1:
        holder = placeholder(q.device, torch.float32)
        return holder, holder
    num_tokens, q_heads, head_dim = q.shape
    return (torch.empty(num_splits, num_tokens, q_heads, head_dim, dtype=torch.float32, device=q.device),
            torch.empty(num_splits, num_tokens, q_heads, dtype=torch.float32, device=q.device))


def split_counts() -> tuple[int, ...]:
    """Every split count above one that ``choose_prefill_splits`` may pick."""
    return tuple(2**i for i in range(1, MAX_PREFILL_SPLITS.bit_length()))


def compile_merges(q_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch the split merge once for each count of ``split_counts`` on empty partials, as a prefill of
    ``q_heads`` heads of ``head_dim`` in ``dtype`` launches it, so that each variant (``NUM_SPLITS`` is a
    constexpr) is compiled before a step asks for it: which counts a server's steps reach depends on
    their sequence counts and contexts in ways a warm-up's grid of steps can miss (session 41: three
    sequences just past 8,192 tokens took eight splits; no step of the grid did)."""
    for splits in split_counts():
        part_out = torch.zeros(splits, 1, q_heads, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.zeros(splits, 1, q_heads, dtype=torch.float32, device=device)
        merge_splits(part_out, part_lse, torch.empty(1, q_heads, head_dim, dtype=dtype, device=device))


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Combine the KV splits' partials (``part_out`` [S, T, Hq, D] fp32 holding o_s = acc / l, ``part_lse``
    [S, T, Hq] holding m + log2 l, -inf for a row that saw no key of its split) into ``out`` [T, Hq, D]."""
    num_splits, num_tokens, q_heads, head_dim = part_out.shape
    _merge_kernel[(num_tokens,)](
        part_out, part_lse, out, num_tokens, q_heads, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEADS_PAD=next_pow2(q_heads), HEAD_DIM=head_dim, num_warps=4,
    )
