"""Sampling penalties over a step's penalised logits rows in one launch, and the step's picks counted
in another (the device tables of ``engine.penalties.OutputCounts``).

In torch the same arithmetic is ~30 small ops a step (gathers of the count and prompt rows, the
comparisons and ``where``s, the indexed write back, and an accumulating scatter for the picks): on an
H100 they held the device ~140 us between two decode graphs with a single penalised row, 3 % of a
batch-1 step, paid by every request in the batch (session 28, call 3). Here::

    program (p, c), p = a penalised row, c = a chunk of BLOCK columns:
        x = logits[row_p, cols]; n = counts[slot_p, cols]; seen = n > 0 or in_prompt[slot_p, cols]
        x = seen ? (x > 0 ? x / repetition_p : x * repetition_p) : x      (vLLM's repetition penalty)
        logits[row_p, cols] = x - n * frequency_p - [n > 0] * presence_p   (OpenAI's two penalties)

    program p (second launch, after the pick): counts[slot_p, picks[row_p]] += 1

The arithmetic is the torch reference's (``engine.penalties``) operation for operation, the division
rounded to nearest (``div_rn``, not the approximate fp32 division) and no multiply fused into an add
(``enable_fp_fusion=False``), so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import cdiv

BLOCK = 4096  # columns a program: 16 KiB of fp32 logits; a 128K vocabulary is 32 programs a row


# The penalised row count only offsets into ``index`` and bounds the grid: left specialised (equal to 1,
# divisible by 16, or neither), a batch with a new count class would compile another variant on the
# engine's thread while every request waits (issue 19, session 41).
@triton.jit(do_not_specialize=["n_rows_p"])
def _penalise_kernel(
    logits_ptr,  # [N, V] fp32, rows contiguous
    counts_ptr,  # [slots, V] fp32
    in_prompt_ptr,  # [slots, V] uint8
    index_ptr,  # [2, P] int64: the rows, then their slots
    params_ptr,  # [P, 3] fp32: repetition, frequency, presence
    n_cols,
    n_rows_p,
    stride_logits,
    stride_table,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(index_ptr + p)
    slot = tl.load(index_ptr + n_rows_p + p)
    repetition = tl.load(params_ptr + p * 3)
    frequency = tl.load(params_ptr + p * 3 + 1)
    presence = tl.load(params_ptr + p * 3 + 2)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=ok, other=0.0)
    n = tl.load(counts_ptr + slot * stride_table + cols, mask=ok, other=0.0)
    in_prompt = tl.load(in_prompt_ptr + slot * stride_table + cols, mask=ok, other=0)
    seen = (n > 0) | (in_prompt != 0)
    x = tl.where(seen, tl.where(x > 0, tl.div_rn(x, repetition), x * repetition), x)
    x = x - (n * frequency + tl.where(n > 0, 1.0, 0.0) * presence)
    tl.store(logits_ptr + row * stride_logits + cols, x, mask=ok)


@triton.jit(do_not_specialize=["n_rows_p"])
def _count_kernel(
    counts_ptr,  # [slots, V] fp32
    index_ptr,  # [2, P] int64: the rows, then their slots
    picks_ptr,  # [N] int64: the step's picks, by row
    n_rows_p,
    stride_table,
):
    p = tl.program_id(0)
    row = tl.load(index_ptr + p)
    slot = tl.load(index_ptr + n_rows_p + p)
    token = tl.load(picks_ptr + row)
    tl.atomic_add(counts_ptr + slot * stride_table + token, 1.0)


def _check(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, index: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] fp32 with contiguous rows, got {tuple(logits.shape)} {logits.dtype}")
    if counts.shape != in_prompt.shape or counts.shape[1] != logits.shape[1] or not counts.is_contiguous() \
            or not in_prompt.is_contiguous() or counts.dtype != torch.float32 or in_prompt.dtype != torch.uint8:
        raise ValueError("counts (fp32) and in_prompt (uint8) must be contiguous [slots, V] tables of the logits' V")
    if index.dim() != 2 or index.shape[0] != 2 or index.dtype != torch.int64 or not index.is_contiguous():
        raise ValueError(f"index must be a contiguous [2, P] int64 tensor, got {tuple(index.shape)} {index.dtype}")


def penalise_rows(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, index: torch.Tensor,
                  params: torch.Tensor) -> None:
    """Apply the penalties to the rows ``index[0]`` of ``logits`` in place, from the table rows
    ``index[1]``; ``params`` [P, 3] fp32: (repetition, frequency, presence) per row."""
    _check(logits, counts, in_prompt, index)
    n_p = index.shape[1]
    if params.shape != (n_p, 3) or params.dtype != torch.float32 or not params.is_contiguous():
        raise ValueError(f"params must be a contiguous [P, 3] fp32 tensor, got {tuple(params.shape)} {params.dtype}")
    if n_p == 0:
        return
    n_cols = logits.shape[1]
    # no fused multiply-add: torch rounds n * frequency before the sum, and so must this kernel
    _penalise_kernel[(n_p, cdiv(n_cols, BLOCK))](
        logits, counts, in_prompt, index, params, n_cols, n_p, logits.stride(0), counts.stride(0), BLOCK=BLOCK,
        enable_fp_fusion=False)


def count_picks(counts: torch.Tensor, index: torch.Tensor, picks: torch.Tensor) -> None:
    """counts[index[1][p], picks[index[0][p]]] += 1 for every p (the slots are distinct)."""
    if index.dim() != 2 or index.shape[0] != 2 or index.dtype != torch.int64 or not index.is_contiguous():
        raise ValueError(f"index must be a contiguous [2, P] int64 tensor, got {tuple(index.shape)} {index.dtype}")
    if picks.dtype != torch.int64 or picks.dim() != 1 or counts.dtype != torch.float32 or not counts.is_contiguous():
        raise ValueError("picks must be [N] int64 and counts a contiguous fp32 table")
    n_p = index.shape[1]
    if n_p:
        _count_kernel[(n_p,)](counts, index, picks, n_p, counts.stride(0))
