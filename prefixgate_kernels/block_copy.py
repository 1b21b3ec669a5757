"""Whole-block copies along dim 0 of any tensor: copy-on-write, swap, staging for tier transfers.

Every tensor is seen as rows of raw words, one row per block::

    tensor [N, *rest] (row stride = tensor.stride(0), each row contiguous)
      -> words [N, row_words] of int64 / int32 / int16 / uint8 (the widest that divides evenly)

so one kernel serves every dtype (bf16, fp8, int8, fp32 scales) and every block-major layout,
and the copy is bit-exact. grid = (num_blocks_to_copy, ceil(row_words / CHUNK)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate_kernels._common import cdiv, placeholder

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
CHUNK = 1024


@triton.jit
def _copy_rows_kernel(
    src_ptr,  # [*, row_words] words, row stride src_stride
    dst_ptr,  # [*, row_words] words, row stride dst_stride
    src_idx_ptr,  # [N] row indices into src (used when SRC_INDEXED)
    dst_idx_ptr,  # [N] row indices into dst (used when DST_INDEXED)
    src_stride,
    dst_stride,
    row_words,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    c = tl.program_id(1)
    src_row = i.to(tl.int64)
    dst_row = i.to(tl.int64)
    if SRC_INDEXED:
        src_row = tl.load(src_idx_ptr + i).to(tl.int64)
    if DST_INDEXED:
        dst_row = tl.load(dst_idx_ptr + i).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < row_words
    x = tl.load(src_ptr + src_row * src_stride + offs, mask=ok)
    tl.store(dst_ptr + dst_row * dst_stride + offs, x, mask=ok)


def _rows_as_words(t: torch.Tensor, name: str, word: torch.dtype | None = None) -> torch.Tensor:
    """t: [N, *rest] with every row contiguous -> [N, row_words] view of raw words (no copy)."""
    assert t.dim() >= 1, f"{name} must have a block dimension"
    rest = t.shape[1:]
    expect = 1
    for size, stride in zip(reversed(rest), reversed(t.stride()[1:])):
        assert size == 1 or stride == expect, (
            f"{name}'s dims after the block dim must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
        )
        expect *= size
    row_elems = expect
    rows = t.as_strided((t.shape[0], row_elems), (t.stride(0), 1))  # [N, row_elems]
    if rows.dtype.is_floating_point and rows.element_size() == 1:
        rows = rows.view(torch.uint8)  # fp8 -> raw bytes
    candidates = _WORDS if word is None else (word,)
    for w in candidates:
        try:
            return rows.view(w)  # checks row size, row stride and base alignment for this word size
        except RuntimeError:
            continue
    raise AssertionError(f"{name}: cannot view rows as {word}")


def _word_for(*tensors: torch.Tensor) -> torch.dtype:
    """The widest word every tensor's rows can be viewed as."""
    for w in _WORDS:
        try:
            for t in tensors:
                _rows_as_words(t, "tensor", w)
            return w
        except AssertionError:
            continue
    return torch.uint8


def copy_rows(
    src: torch.Tensor,  # [Ns, *rest]
    dst: torch.Tensor,  # [Nd, *rest]
    src_idx: torch.Tensor | None,  # [N] int, or None = rows 0..N-1
    dst_idx: torch.Tensor | None,  # [N] int, or None = rows 0..N-1
    n: int,
) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < n, bit-exact. Rows written twice in one call race."""
    if n == 0:
        return
    word = _word_for(src, dst)
    s = _rows_as_words(src, "source", word)
    d = _rows_as_words(dst, "destination", word)
    assert s.shape[1] == d.shape[1], f"block sizes differ: {s.shape[1]} vs {d.shape[1]} words"
    dummy = placeholder(src.device, torch.int64)
    _copy_rows_kernel[(n, cdiv(s.shape[1], CHUNK))](
        s, d,
        src_idx if src_idx is not None else dummy,
        dst_idx if dst_idx is not None else dummy,
        s.stride(0), d.stride(0), s.shape[1],
        SRC_INDEXED=src_idx is not None, DST_INDEXED=dst_idx is not None, CHUNK=CHUNK,
        num_warps=4,
    )
