"""Pull a tensor's bytes into the GPU's L2 cache ahead of the kernel that reads them.

Why: a decode step at small batch alternates weight-streaming GEMMs (bound by HBM bandwidth) with
kernels that barely touch HBM (RoPE + KV write, the attention over a short context, the norms): at
batch 1 x 2K the attention reads 8 MB a layer in ~10 us, while the HBM could have moved ~40 MB.
The next GEMM's weights do not depend on anything the step computes, so a prefetch issued on a side
stream before the attention (``engine/models/weight_prefetch.py``) moves them into L2 while the HBM
would otherwise idle, and the GEMM then streams them from L2. The o projection of a Llama-8B layer
is 32 MiB, which fits the H200's 50 MB L2 with room for the attention's own traffic.

Two ways to issue it (both Hopper and later; each a fire-and-forget hint that changes no value):

* ``BULK``: one ``cp.async.bulk.prefetch.L2.global`` per ``chunk`` bytes: the copy engine (TMA)
  walks the span, one instruction per thread, so the kernel exits in a few microseconds while L2
  fills behind it.
* lines: one ``prefetch.global.L2::evict_last`` per 128-byte line, issued by the threads themselves.

The kernel needs the CUDA compiler (inline PTX): Triton's CPU interpreter cannot run it, and a CPU
step has no L2 to fill, so ``prefetch_l2`` refuses both with a ValueError.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from kernels._common import cdiv, interpreting

LINE_BYTES = 128


class PrefetchMode(enum.Enum):
    BULK = "bulk"  # cp.async.bulk.prefetch.L2: the TMA unit fetches each chunk
    LINES = "lines"  # prefetch.global.L2::evict_last per 128-byte line


@triton.jit(do_not_specialize=["nbytes"])
def _prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, BULK: tl.constexpr):
    """Program p covers chunks [p * PER_PROGRAM, (p + 1) * PER_PROGRAM) of CHUNK bytes each. Chunks
    past the span re-prefetch the first 16 bytes (a valid address; the instruction has no mask)."""
    chunk = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    off = chunk.to(tl.int64) * CHUNK
    inside = off < nbytes
    off = tl.where(inside, off, 0)
    if BULK:
        size = tl.where(inside, tl.minimum(nbytes - off, CHUNK), 16).to(tl.int32)  # multiples of 16
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [base_ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [base_ptr + off], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, mode: PrefetchMode = PrefetchMode.BULK, chunk_bytes: int = 64 * 1024,
                per_program: int = 64) -> None:
    """Issue L2 prefetches for every byte of the contiguous CUDA tensor ``t`` on the current stream.

    ``chunk_bytes`` (BULK: a multiple of 16; LINES: ignored, one line each) times ``per_program``
    chunks per program; the grid covers the span. Returns at once; the fetch completes behind it."""
    if t.device.type != "cuda" or interpreting():
        raise ValueError("prefetch_l2 needs a CUDA tensor and compiled kernels (inline PTX; the "
                         "interpreter cannot run it)")
    if not t.is_contiguous():
        raise ValueError(f"prefetch_l2 needs a contiguous tensor, got strides {t.stride()}")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    bulk = mode is PrefetchMode.BULK
    chunk = chunk_bytes if bulk else LINE_BYTES
    if bulk and (chunk % 16 or nbytes % 16 or t.data_ptr() % 16):
        raise ValueError(f"bulk L2 prefetch needs 16-byte multiples: chunk {chunk}, {nbytes} bytes at "
                         f"address % 16 = {t.data_ptr() % 16}")
    if per_program < 1 or per_program & (per_program - 1):
        raise ValueError(f"per_program must be a power of two, got {per_program}")
    grid = (cdiv(cdiv(nbytes, chunk), per_program),)
    _prefetch_kernel[grid](t.view(-1).view(torch.uint8), nbytes, CHUNK=chunk, PER_PROGRAM=per_program, BULK=bulk,
                           num_warps=max(1, min(4, per_program // 32)))
