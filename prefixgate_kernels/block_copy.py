"""Whole-block copies along dim 0 of any tensor: copy-on-write, swap, staging for tier transfers.

Every tensor is seen as rows of raw words, one row per block::

    tensor [N, *rest] (row stride = tensor.stride(0), each row contiguous)
      -> words [N, row_words] of int64 / int32 / int16 / uint8 (the widest that divides evenly)

so one kernel serves every dtype (bf16, fp8, int8, fp32 scales) and every block-major layout,
and the copy is bit-exact. grid = (num_blocks_to_copy, ceil(row_words / CHUNK)).

``copy_pages`` moves KV blocks between two page layouts in one pass: both tensors are the logical
[N, layers, 2, block_size, kv_heads, head_dim] (a head-major pool's token view has slot and head
strides swapped), and one program copies one (block, layer, K/V, head) tile of block_size x head_dim,
each head_dim row as words. A tier restore into a head-major pool writes the token-ordered transfer
rows straight into their places, where a transpose to the pool's order and then a row copy read and
wrote every byte twice.
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


def rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each block (dims after the first) of ``t`` is one contiguous run: what ``copy_rows`` takes."""
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


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


@triton.jit
def _copy_pages_kernel(
    src_ptr,  # words, logical [*, planes, slots, heads, row_words] with the strides below
    dst_ptr,
    src_idx_ptr,  # [N] block indices into src (used when SRC_INDEXED)
    dst_idx_ptr,  # [N] block indices into dst (used when DST_INDEXED)
    src_block, src_plane, src_slot, src_head,
    dst_block, dst_plane, dst_slot, dst_head,
    heads,
    slots,
    row_words,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0)
    tile = tl.program_id(1)  # plane * heads + head
    plane = (tile // heads).to(tl.int64)
    head = (tile % heads).to(tl.int64)
    src_blk = i.to(tl.int64)
    dst_blk = i.to(tl.int64)
    if SRC_INDEXED:
        src_blk = tl.load(src_idx_ptr + i).to(tl.int64)
    if DST_INDEXED:
        dst_blk = tl.load(dst_idx_ptr + i).to(tl.int64)
    slot = tl.arange(0, BLOCK_S)[:, None]
    word = tl.arange(0, BLOCK_W)[None, :]
    ok = (slot < slots) & (word < row_words)
    src = src_ptr + src_blk * src_block + plane * src_plane + head * src_head + slot * src_slot + word
    dst = dst_ptr + dst_blk * dst_block + plane * dst_plane + head * dst_head + slot * dst_slot + word
    tl.store(dst, tl.load(src, mask=ok), mask=ok)


def _check_pages(t: torch.Tensor, name: str) -> None:
    assert t.dim() == 6, f"{name} must be [N, layers, 2, block_size, kv_heads, head_dim], got {tuple(t.shape)}"
    assert t.stride(5) == 1, f"{name}'s head_dim must be contiguous (strides {t.stride()})"
    assert t.shape[1] == 1 or t.stride(1) == 2 * t.stride(2), (
        f"{name}'s layer and K/V dims must be one run of planes (strides {t.stride()})"
    )


def _page_words(t: torch.Tensor, word: torch.dtype) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """t [N, layers, 2, slots, heads, D] (head_dim contiguous; layers and K/V one run of planes) -> a
    words view of its storage from t's first element and the (block, plane, slot, head) strides in words."""
    size = t.element_size()
    wsize = word.itemsize
    flat = t.as_strided((t.shape[0], t.stride(0)), (t.stride(0), 1)) if t.shape[0] else t.reshape(0, 1)
    if flat.dtype.is_floating_point and size == 1:
        flat = flat.view(torch.uint8)
    words = flat.view(word)  # checks the base's alignment for this word size
    strides = tuple(t.stride(d) * size // wsize for d in (0, 2, 3, 4))
    return words, strides  # type: ignore[return-value]


def _page_word_for(*tensors: torch.Tensor) -> torch.dtype:
    """The widest word that divides every row (head_dim) and every stride of the tensors, in bytes."""
    for w in _WORDS:
        wsize = w.itemsize
        if all(t.shape[5] * t.element_size() % wsize == 0
               and all(t.stride(d) * t.element_size() % wsize == 0 for d in (0, 2, 3, 4))
               and t.data_ptr() % wsize == 0 for t in tensors):
            return w
    return torch.uint8


def copy_pages(
    src: torch.Tensor,  # [Ns, layers, 2, block_size, kv_heads, head_dim], any slot / head strides
    dst: torch.Tensor,  # [Nd, layers, 2, block_size, kv_heads, head_dim], any slot / head strides
    src_idx: torch.Tensor | None,  # [N] int, or None = blocks 0..N-1
    dst_idx: torch.Tensor | None,  # [N] int, or None = blocks 0..N-1
    n: int,
) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < n, bit-exact, each in its own page layout (one pass).
    Blocks written twice in one call race."""
    if n == 0:
        return
    assert src.shape[1:] == dst.shape[1:], f"block shapes differ: {tuple(src.shape[1:])} vs {tuple(dst.shape[1:])}"
    assert src.element_size() == dst.element_size(), f"element sizes differ: {src.dtype} vs {dst.dtype}"
    for t, name in ((src, "source"), (dst, "destination")):
        _check_pages(t, name)
    word = _page_word_for(src, dst)
    s, (sb, sp, ss, sh) = _page_words(src, word)
    d, (db, dp, ds, dh) = _page_words(dst, word)
    _, layers, _, slots, heads, head_dim = src.shape
    row_words = head_dim * src.element_size() // word.itemsize
    dummy = placeholder(src.device, torch.int64)
    _copy_pages_kernel[(n, layers * 2 * heads)](
        s, d,
        src_idx if src_idx is not None else dummy,
        dst_idx if dst_idx is not None else dummy,
        sb, sp, ss, sh, db, dp, ds, dh,
        heads, slots, row_words,
        SRC_INDEXED=src_idx is not None, DST_INDEXED=dst_idx is not None,
        BLOCK_S=triton.next_power_of_2(slots), BLOCK_W=triton.next_power_of_2(row_words),
        num_warps=4,
    )
