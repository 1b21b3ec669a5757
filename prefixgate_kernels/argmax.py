"""Greedy decoding's argmax over a step's logits rows, in one launch.

``torch.argmax`` over a [B, V] fp32 logits tensor (V = 128,256 for Llama 3) reduces each row in one
thread block: a batch-1 decode step spent 27.6 us of the H200 in it (session 19's profile, 0.6 % of
the step), streaming 0.5 MB from one SM. Here each row is cut into chunks of ``CHUNK`` columns, one
program a chunk (32 programs a row at V = 128K); each writes its chunk's (max, first index of it),
and the last of a row's programs to finish, counted in a zeroed int32 buffer it leaves zero (the
pattern of ``prefixgate_kernels.decode_attention``'s in-kernel merge), reduces those partials::

    program (row, c):  m_c, i_c = max and first argmax of row[c * CHUNK : (c + 1) * CHUNK]
                       store (m_c, i_c) -> bar.sync; one thread: n = atomic_add(ctr[row], 1) (acq_rel)
                       -> if n == chunks - 1: ctr[row] = 0; out[row] = min i_c over the c with m_c == max m

``torch.argmax``'s semantics, bit for bit: the first index of the maximum, a NaN counts as the
maximum (the first NaN wins), a row of -inf gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import cdiv, next_pow2

CHUNK = 4096  # columns a program: 16 KiB of fp32 logits, one load of 32 values a thread at 4 warps
_MAX_COLS = 2**31 - 1  # int32 indices; the largest is the kernel's "no index"
_NO_INDEX = tl.constexpr(_MAX_COLS)


@triton.jit
def _argmax_kernel(
    x_ptr,  # [B, V] float (rows contiguous)
    out_ptr,  # [B] int64
    part_max_ptr,  # [B, CHUNKS] fp32: each chunk's maximum (NaN where the chunk holds one)
    part_idx_ptr,  # [B, CHUNKS] int32: the first index of it
    counters_ptr,  # [>= B] int32, zero between launches
    n_cols,
    stride_row,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    nan = x != x
    first_nan = tl.min(tl.where(nan, cols, _NO_INDEX), 0)
    top = tl.max(tl.where(nan, float("-inf"), x), 0)
    first_top = tl.min(tl.where(ok & (x == top), cols, _NO_INDEX), 0)
    has_nan = first_nan < _NO_INDEX
    tl.store(part_max_ptr + row * CHUNKS + c, tl.where(has_nan, float("nan"), top))
    tl.store(part_idx_ptr + row * CHUNKS + c, tl.where(has_nan, first_nan, first_top))
    # every thread's stores issued (bar.sync), then one acq_rel add at GPU scope releases them and, for
    # the last arrival, acquires the others'; the partials are read from L2 (.cg)
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == CHUNKS - 1:
        tl.store(counters_ptr + row, 0)
        k = tl.arange(0, CHUNKS_PAD)
        k_ok = k < CHUNKS
        m = tl.load(part_max_ptr + row * CHUNKS + k, mask=k_ok, other=float("-inf"), cache_modifier=".cg")
        idx = tl.load(part_idx_ptr + row * CHUNKS + k, mask=k_ok, other=_NO_INDEX, cache_modifier=".cg")
        m_nan = m != m
        nan_idx = tl.min(tl.where(m_nan, idx, _NO_INDEX), 0)
        best = tl.max(tl.where(m_nan, float("-inf"), m), 0)
        best_idx = tl.min(tl.where(k_ok & (m == best), idx, _NO_INDEX), 0)
        tl.store(out_ptr + row, tl.where(nan_idx < _NO_INDEX, nan_idx, best_idx).to(tl.int64))


def argmax_rows(logits: torch.Tensor, counters: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (fp32, fp16 or bf16; rows contiguous) -> [B] int64, ``logits.argmax(dim=-1)``.

    ``counters``: int32, at least B values, all zero (the kernel leaves them zero), for a caller that
    launches on one stream and keeps one buffer; without it each call zeroes a fresh one."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V > 0] with contiguous rows, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be fp32, fp16 or bf16, got {logits.dtype}")
    rows, cols = logits.shape
    if cols >= _MAX_COLS:
        raise ValueError(f"{cols} columns: the kernel's indices are int32")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if counters is None:
        counters = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    elif counters.dtype != torch.int32 or counters.numel() < rows or not counters.is_contiguous():
        raise ValueError(f"counters must be a contiguous int32 buffer of at least {rows} zeros")
    chunks = cdiv(cols, CHUNK)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, chunks)](logits, out, part_max, part_idx, counters, cols, logits.stride(0),
                                   CHUNK=CHUNK, CHUNKS=chunks, CHUNKS_PAD=max(2, next_pow2(chunks)), num_warps=4)
    return out
