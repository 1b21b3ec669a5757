"""Typed launchers for the Triton kernels, drop-in for ``prefixgate_kernels.reference`` (same names, same arguments).

The engine picks ``prefixgate_kernels.reference`` on CPU and this module on CUDA. Each launcher checks
shapes, dtypes, devices and strides and fails with an AssertionError that says what was wrong;
the kernels themselves live in ``decode_attention``, ``prefill_attention``, ``kv_write``,
``block_copy`` and, for the fused layer path, ``rmsnorm``, ``rotary`` and ``activation``. Conventions (cache layout, quantization scales) are those of ``prefixgate_kernels.reference``.

Differences from the reference, all on inputs the reference would also mishandle:
  * ``copy_blocks``: a block that is both a source and a destination in one call races (the
    reference reads every source first). Copy-on-write never does this: destinations are fresh.
  * attention: every sequence needs ``seq_len >= 1``; head_dim must be a power of two >= 16.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence

import torch

from prefixgate_kernels import (
    activation,
    block_copy,
    decode_attention,
    gate_up_silu,
    kv_write,
    partial_gemm,
    prefill_attention,
    rmsnorm,
    rotary,
    skinny_gemm,
)
from prefixgate_kernels._common import ATTN_DTYPES, check_kv_scales, check_paged_cache, interpreting, num_sms
from prefixgate_kernels.launch_layout import CacheLayout
from prefixgate_kernels.reference import FP8_DTYPE, dequantize, is_quantized, quantize  # noqa: F401  (re-exported)

__all__ = [
    "copy_blocks", "gather_blocks", "scatter_blocks", "paged_decode_attention", "paged_prefill_attention",
    "prefill_splits",
    "write_kv", "is_quantized", "quantize", "dequantize", "FP8_DTYPE",
    "rms_norm", "add_rms_norm", "rotary_write_kv", "rotary_decode_attention", "silu_mul", "linear", "linear_partials",
    "qkv_projection", "mlp_partials",
]

# Programmatic dependent launch (PDL) between a decode step's latency-bound kernels and the weight-streaming
# ones after them (docs/gpu.md, session 30): the decode attention and ``add_rms_norm`` let the next kernel
# launch at their start; gate|up + SiLU (its first K slice) and, at 1 to ``gemv_pdl.MAX_ROWS`` rows, the o
# projection (``gemv_pdl``, ``linear_partials(..., pdl=True)``) load weights before they wait for their input.
# Every part is correct whatever runs before it (without an early launch PDL waits as a plain launch does);
# sm_90 or newer only.
# Measured in the engine on the H200 (session 30, call 10): the overlapped batch-1 step 4.49 / 4.53 -> 4.44 /
# 4.42 ms (-1.8 %), batch 8 -0.2 %, batches 32 and 128 unchanged; with ``gemv_pdl``'s MMA form for 2 to 32 rows
# (session 31, calls 2-3, H100) batches 4 / 8 / 16 / 32 a further -3.0 / -2.4 / -2.0 / -1.3 %.
DECODE_PDL = True
# The q|k|v projection as the same kind of launch under the input norm (``qkv_projection``), its partials summed
# by the decode attention. Measured in the engine on an H100 (session 30, call 13; the links above on in both
# arms): the overlapped batch-1 step 5.785 / 5.797 -> 5.725 / 5.736 ms (-1.1 %), batches 8 and 32 unchanged.
QKV_PDL = True
# The down projection as the same kind of launch under gate|up + SiLU (``gate_up_silu``, which then lets it start
# as its programs run out): where gate|up + SiLU runs and ``gemv_pdl`` takes the rows (1 to 8 at Llama-8B's
# 14,336-wide K), down's first weight tiles stream under gate|up's last wave instead of after it. Measured in the
# engine on an H100 (session 37, ``benchmarks/engine_gpu.py --sections ceilings,decode_down_pdl``, the links above
# on in both arms): the overlapped step at batch 1 5.907 / 5.909 -> 5.776 / 5.768 ms (-2.3 %), batch 4 -1.9 %,
# batch 8 -1.8 %, batch 32 (no link) -0.2 %.
DOWN_PDL = True
# The norm after a ``gemv_pdl`` projection (o, and down under ``DOWN_PDL``) as the same kind of launch: the projection
# lets it launch once its own wait has returned, and ``add_rms_norm`` loads its weight and parks until the
# projection's partials are written, instead of launching after the projection's last program ends. Measured in
# the engine on an H100 (session 38, ``benchmarks/engine_gpu.py --sections decode_reader_pdl``, now
# ``decode_norm_pdl``; the links above on in both arms): the overlapped step over its floor at batch 1 / 4 / 8
# 1.109-1.111 -> 1.105-1.108, 1.104-1.107 -> 1.102, 1.103-1.106 -> 1.101 (-0.3 % each), batch 32 unchanged. The
# same link for the decode attention under the q|k|v projection lost (+0.6 / +1.7 / +1.5 % at 1 / 4 / 8) and is
# not kept (docs/gpu.md, session 38).
NORM_PDL = True


class _LinkedOutput(threading.local):
    """The output of the last launch on this thread that lets the next kernel launch early (a ``gemv_pdl``
    projection under ``NORM_PDL``): ``add_rms_norm`` is launched with PDL only when that output is its x, so that
    it parks under that projection and no other kernel (the link is a scheduling choice, correct either way: the
    norm waits for the kernel before it). A weak reference: the launcher holds no tensor."""

    ref: weakref.ReferenceType[torch.Tensor] | None = None


_linked = _LinkedOutput()


def _linked_to_next(out: torch.Tensor) -> torch.Tensor:
    """``out``, remembered as the output whose reader may be launched with PDL (``_takes_link``)."""
    _linked.ref = weakref.ref(out)
    return out


def _takes_link(x: torch.Tensor) -> bool:
    """Whether ``x`` is the output of the launch just made that lets its reader launch early (forgotten once asked)."""
    ref, _linked.ref = _linked.ref, None
    return ref is not None and ref() is x


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _pdl(device: torch.device) -> bool:
    """``DECODE_PDL`` and a device whose kernels can launch dependents (compute capability 9.0 or newer)."""
    return (DECODE_PDL and device.type == "cuda" and not interpreting()
            and _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9)


def _check_int_vector(name: str, t: torch.Tensor, length: int | None, device: torch.device) -> None:
    assert t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}"
    assert t.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {t.dtype}"
    assert t.device == device, f"{name} is on {t.device}, expected {device}"
    assert t.is_contiguous(), f"{name} must be contiguous"
    if length is not None:
        assert t.shape[0] == length, f"{name} must have {length} entries, got {t.shape[0]}"


def _check_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> None:
    assert q.dim() == 3, f"q must be [tokens, q_heads, head_dim], got {tuple(q.shape)}"
    assert q.dtype in ATTN_DTYPES, f"q must be fp16/bf16/fp32, got {q.dtype}"
    assert q.stride(2) == 1, f"q's head_dim must be contiguous, got strides {q.stride()}"
    check_paged_cache("k_cache", k_cache, q.device)
    check_paged_cache("v_cache", v_cache, q.device)
    assert k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ"
    assert k_cache.dtype == v_cache.dtype, f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}"
    _, _, kv_heads, head_dim = k_cache.shape
    assert q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert q.shape[1] % kv_heads == 0, f"q_heads {q.shape[1]} must be a multiple of kv_heads {kv_heads}"
    assert block_tables.dim() == 2, f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}"
    assert block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}"
    assert block_tables.device == q.device, f"block_tables is on {block_tables.device}, expected {q.device}"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    check_kv_scales(k_cache, k_scale, v_scale)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], any block stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32 (context including the current token), >= 1
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    context_lens: Sequence[int] | None = None,
    merge_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its whole cached context -> [B, Hq, D] (q's dtype).

    ``context_lens``: the same lengths as ``seq_lens``, on the host (optional): with them the split
    count fits a batch of unequal lengths (``decode_attention.choose_num_splits``) with no device
    read. Leave it out in a CUDA graph (the launch must not depend on the batch).
    ``merge_counters``: int32 zeros, at least B x kv_heads, that a caller launching on one stream
    keeps for all its launches (the kernel leaves them zero); without it a launch that splits
    zeroes its own (``decode_attention.paged_decode``)."""
    _check_decode_launch(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, context_lens, merge_counters)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return decode_attention.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                                         context_lens=context_lens, merge_counters=merge_counters)


def _check_decode_launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    context_lens: Sequence[int] | None, merge_counters: torch.Tensor | None,
) -> None:
    _check_attention_inputs(q, k_cache, v_cache, block_tables, k_scale, v_scale)
    assert block_tables.shape[0] == q.shape[0], f"block_tables has {block_tables.shape[0]} rows, q has {q.shape[0]} seqs"
    _check_int_vector("seq_lens", seq_lens, q.shape[0], q.device)
    if context_lens is not None:
        assert len(context_lens) == q.shape[0], f"context_lens has {len(context_lens)} entries, q has {q.shape[0]} seqs"
    if merge_counters is not None:
        _check_int_vector("merge_counters", merge_counters, None, q.device)
        assert merge_counters.dtype == torch.int32, f"merge_counters must be int32, got {merge_counters.dtype}"
        need = q.shape[0] * k_cache.shape[2]
        assert merge_counters.shape[0] >= need, (
            f"merge_counters holds {merge_counters.shape[0]} counters, the launch needs {need} (seqs x kv_heads)")


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D] new tokens of all sequences, packed
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context after this chunk (cached + new)
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    context_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """New tokens attend causally among themselves and fully to their cached prefix -> [T, Hq, D].

    The new tokens' K/V must already be in the cache (write_kv first). ``context_lens``: the same
    lengths as ``seq_lens`` on the host (optional): with them a launch that would leave the GPU
    idle (a short suffix over a long prefix) splits the keys (``prefill_attention.choose_prefill_splits``).
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, k_scale, v_scale)
    num_seqs = block_tables.shape[0]
    _check_int_vector("cu_seqlens_q", cu_seqlens_q, num_seqs + 1, q.device)
    _check_int_vector("seq_lens", seq_lens, num_seqs, q.device)
    if context_lens is not None:
        assert len(context_lens) == num_seqs, f"context_lens has {len(context_lens)} entries, expected {num_seqs}"
    return prefill_attention.paged_prefill(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale, context_lens=context_lens
    )


def prefill_splits(num_tokens: int, num_seqs: int, q_heads: int, max_context: int, device: torch.device,
                   layout: CacheLayout | None = None) -> int:
    """How many KV splits ``paged_prefill_attention`` launches for ``num_tokens`` new tokens of
    ``num_seqs`` sequences when the longest context (its ``context_lens`` hint) is ``max_context``, on a
    cache of ``layout`` (which decides whether a Gluon kernel, with its own tiles, takes the launch; None:
    Triton's count)."""
    assert num_tokens >= 1 and num_seqs >= 1 and q_heads >= 1 and max_context >= 1, "sizes must be >= 1"
    return prefill_attention.launch_splits(num_tokens, num_seqs, q_heads, max_context, device, layout)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V into their cache slots (reshape_and_cache), quantizing on the way."""
    for name, x in (("key", key), ("value", value)):
        assert x.dim() == 3, f"{name} must be [tokens, kv_heads, head_dim], got {tuple(x.shape)}"
        assert x.dtype in ATTN_DTYPES, f"{name} must be fp16/bf16/fp32, got {x.dtype}"
        assert x.stride(2) == 1, f"{name}'s head_dim must be contiguous, got strides {x.stride()}"
    assert key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    device = key.device
    assert value.device == device, f"value is on {value.device}, key on {device}"
    check_paged_cache("k_cache", k_cache, device)
    check_paged_cache("v_cache", v_cache, device)
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype, "k_cache and v_cache must match"
    assert tuple(k_cache.shape[2:]) == tuple(key.shape[1:]), (
        f"key heads/dim {tuple(key.shape[1:])} != cache heads/dim {tuple(k_cache.shape[2:])}"
    )
    _check_int_vector("slot_mapping", slot_mapping, key.shape[0], device)
    check_kv_scales(k_cache, k_scale, v_scale)
    kv_write.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _check_block_ids(name: str, ids: torch.Tensor, cache: torch.Tensor) -> None:
    _check_int_vector(name, ids, None, cache.device)


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache[dst[i]] = cache[src[i]] for every i (block-major cache: dim 0 indexes blocks).

    Bit-exact for any dtype. src and dst must not share a block (see the module docstring).
    """
    _check_block_ids("src", src, cache)
    _check_block_ids("dst", dst, cache)
    assert src.shape == dst.shape, f"src has {src.shape[0]} ids, dst has {dst.shape[0]}"
    block_copy.copy_rows(cache, cache, src, dst, src.shape[0])


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack blocks into a contiguous staging buffer: [N, *cache.shape[1:]] on cache's device."""
    _check_block_ids("block_ids", block_ids, cache)
    n = block_ids.shape[0]
    if out is None:
        out = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    assert tuple(out.shape) == (n, *cache.shape[1:]), f"out must be {(n, *cache.shape[1:])}, got {tuple(out.shape)}"
    assert out.dtype == cache.dtype, f"out is {out.dtype}, cache is {cache.dtype}"
    assert out.device == cache.device, f"out is on {out.device}, cache on {cache.device} (copy D2H afterwards)"
    _copy_blocks_as_laid_out(cache, out, block_ids, None, n)
    return out


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Unpack a staging buffer [N, *cache.shape[1:]] into the given blocks (converted to cache's dtype)."""
    _check_block_ids("block_ids", block_ids, cache)
    n = block_ids.shape[0]
    assert tuple(staging.shape) == (n, *cache.shape[1:]), (
        f"staging must be {(n, *cache.shape[1:])}, got {tuple(staging.shape)}"
    )
    assert staging.device == cache.device, f"staging is on {staging.device}, cache on {cache.device} (copy H2D first)"
    if staging.dtype != cache.dtype:
        staging = staging.to(cache.dtype)
    _copy_blocks_as_laid_out(staging, cache, None, block_ids, n)


def _copy_blocks_as_laid_out(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor | None,
                             dst_idx: torch.Tensor | None, n: int) -> None:
    """Whole blocks as rows of bytes where both sides' blocks are contiguous; else (a head-major pool's
    token view against token-ordered staging) tile by tile in one pass (``block_copy.copy_pages``)."""
    if (block_copy.rows_contiguous(src) and block_copy.rows_contiguous(dst)) or src.dim() != 6:
        block_copy.copy_rows(src, dst, src_idx, dst_idx, n)
    else:
        block_copy.copy_pages(src, dst, src_idx, dst_idx, n)


# ------------------------------------------------------------------ fused layer ops (decode/prefill)
def _check_rows(name: str, x: torch.Tensor, width: int | None = None) -> None:
    assert x.dim() == 2, f"{name} must be [tokens, features], got {tuple(x.shape)}"
    assert x.dtype in ATTN_DTYPES, f"{name} must be fp16/bf16/fp32, got {x.dtype}"
    assert x.stride(1) == 1, f"{name}'s rows must be contiguous, got strides {x.stride()}"
    if width is not None:
        assert x.shape[1] == width, f"{name} must have {width} columns, got {x.shape[1]}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> weight * (x / rms(x)) [T, H]: normalise in fp32, scale in x's dtype (transformers)."""
    _check_rows("x", x)
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), f"weight must be [{x.shape[1]}] contiguous"
    assert weight.device == x.device, f"weight is on {weight.device}, x on {x.device}"
    return rmsnorm.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place, rounded to residual's dtype), then -> rms_norm(residual) [T, H].
    ``x`` may be a projection's fp32 partials [S, T, H] (``linear_partials``): their sum, rounded to
    residual's dtype, is added."""
    if x.dim() == 3:
        assert x.dtype == torch.float32 and x.is_contiguous(), (
            f"partials must be contiguous float32 [S, T, H], got {x.dtype} strides {x.stride()}")
        assert x.shape[1:] == residual.shape, f"partials {tuple(x.shape)} must be [S, *{tuple(residual.shape)}]"
        _check_rows("residual", residual)
    else:
        _check_rows("x", x)
        _check_rows("residual", residual, x.shape[1])
        assert residual.shape == x.shape and residual.dtype == x.dtype, (
            f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}"
        )
    hidden = residual.shape[1]
    assert residual.device == x.device and weight.device == x.device, "x, residual and weight must share a device"
    assert weight.shape == (hidden,) and weight.is_contiguous(), f"weight must be [{hidden}] contiguous"
    return rmsnorm.add_rms_norm(x, residual, weight, eps, launch_dependents=_pdl(x.device), pdl=_takes_link(x))


def rotary_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], q | k | v columns (a merged projection's output)
    cos: torch.Tensor,  # [T, D] float32
    sin: torch.Tensor,  # [T, D] float32
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    num_q_heads: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,  # [Hkv, D], subtracted from the rotated keys (fp8 calibration)
) -> torch.Tensor:
    """RoPE on q and k, K/V written into their cache slots -> rotated q [T, Hq, D] (contiguous)."""
    _check_rotary_inputs(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, k_scale, v_scale, k_bias)
    return rotary.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, k_scale, v_scale,
                                  k_bias)


def rotary_decode_attention(
    qkv: torch.Tensor,  # [B, (Hq + 2 Hkv) * D]: each sequence's one new token
    cos: torch.Tensor,  # [B, D] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [B] int64, -1 = padding
    num_q_heads: int,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, including the new token
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    *,
    context_lens: Sequence[int] | None = None,
    merge_counters: torch.Tensor | None = None,
    qkv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``rotary_write_kv`` then ``paged_decode_attention`` -> [B, Hq, D], in one launch
    (``decode_attention.RopeWrite``) except where the launcher reads KV heads joined in pairs
    (``decode_attention.launcher_joined_heads``: fp8 at head dim <= 64 on pages laid token by token), which
    keeps the two kernels.
    ``qkv`` may be ``qkv_projection``'s fp32 K-slice partials [S, B, N] of a ``qkv_dtype`` projection: the one
    launch sums them (the two kernels are given their rounded sum)."""
    partials = qkv.dim() == 3
    if partials:
        assert qkv.dtype == torch.float32 and qkv.is_contiguous() and qkv_dtype in (torch.bfloat16, torch.float16), (
            f"q|k|v partials must be contiguous fp32 [S, B, N] of a 16-bit projection, got {qkv.dtype} "
            f"{tuple(qkv.shape)} of {qkv_dtype}")
    rows = qkv[0] if partials else qkv
    _check_rotary_inputs(rows, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, k_scale, v_scale, k_bias)
    head_dim = k_cache.shape[3]
    fused = (rows.shape[0] > 0 and decode_attention.FUSE_ROPE_WRITE
             and decode_attention.launcher_joined_heads(k_cache, v_cache) == 1)
    if partials and not fused:  # the two kernels read the projection itself
        assert qkv_dtype is not None  # checked with the partials above
        qkv, partials = partial_gemm.summed(qkv, qkv_dtype), False
        rows = qkv
    # the inputs are checked once here; the launchers below are the unchecked ones
    q = (rows[:, : num_q_heads * head_dim].view(rows.shape[0], num_q_heads, head_dim) if fused else
         rotary.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, k_scale, v_scale, k_bias))
    _check_decode_launch(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, context_lens, merge_counters)
    if q.shape[0] == 0:
        return torch.empty(q.shape, dtype=qkv_dtype if partials else q.dtype, device=q.device)
    rope = None
    if fused:
        rope = decode_attention.RopeWrite(cos, sin, slot_mapping, k_bias, slices=qkv.shape[0] if partials else 1,
                                          slice_stride=qkv.stride(0) if partials else 0,
                                          dtype=qkv_dtype if partials else None)
    return decode_attention.paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, context_lens=context_lens,
        merge_counters=merge_counters, rope=rope,
        launch_dependents=_pdl(q.device))


def _check_rotary_inputs(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_q_heads: int, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    k_bias: torch.Tensor | None,
) -> None:
    device = qkv.device
    check_paged_cache("k_cache", k_cache, device)
    check_paged_cache("v_cache", v_cache, device)
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype, "k_cache and v_cache must match"
    _, _, kv_heads, head_dim = k_cache.shape
    assert head_dim % 2 == 0 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    _check_rows("qkv", qkv, (num_q_heads + 2 * kv_heads) * head_dim)
    for name, t in (("cos", cos), ("sin", sin)):
        assert t.dtype == torch.float32, f"{name} must be float32, got {t.dtype}"
        assert tuple(t.shape) == (qkv.shape[0], head_dim) and t.stride(1) == 1, (
            f"{name} must be [{qkv.shape[0]}, {head_dim}] with contiguous rows, got {tuple(t.shape)}"
        )
        assert t.device == device, f"{name} is on {t.device}, expected {device}"
    _check_int_vector("slot_mapping", slot_mapping, qkv.shape[0], device)
    check_kv_scales(k_cache, k_scale, v_scale)
    if k_bias is not None:
        assert tuple(k_bias.shape) == (kv_heads, head_dim) and k_bias.is_contiguous(), (
            f"k_bias must be [{kv_heads}, {head_dim}] contiguous, got {tuple(k_bias.shape)}"
        )
        assert k_bias.dtype in ATTN_DTYPES and k_bias.device == device, (
            f"k_bias must be a float tensor on {device}, got {k_bias.dtype} on {k_bias.device}"
        )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up columns) -> silu(gate) * up [T, I] in gate_up's dtype."""
    _check_rows("gate_up", gate_up)
    assert gate_up.shape[1] % 2 == 0, f"gate_up must have an even number of columns, got {gate_up.shape[1]}"
    return activation.silu_mul(gate_up)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N]: cuBLAS (``F.linear``), or the weight-streaming
    kernel for 16-bit batches of at most ``skinny_gemm.ENGINE_MAX_ROWS`` rows (0 now: off)."""
    _check_rows("x", x)
    assert weight.dim() == 2 and weight.shape[1] == x.shape[1], (
        f"weight must be [out, {x.shape[1]}], got {tuple(weight.shape)}"
    )
    assert weight.dtype == x.dtype and weight.device == x.device, "x and weight must share dtype and device"
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous()), "bias must be [out] contiguous"
    config = None
    if x.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1 and x.device.type == "cuda":
        config = skinny_gemm.chain_config(x.shape[0], weight.shape[0], x.shape[1], num_sms(x.device),
                                          max_rows=skinny_gemm.ENGINE_MAX_ROWS)
    if config is None:
        return torch.nn.functional.linear(x, weight, bias)
    return skinny_gemm.skinny_linear(x, weight, bias, config)


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A decode-only step's merged q|k|v projection, read only by ``rotary_decode_attention``: ``linear``'s
    [T, N], or with ``DECODE_PDL`` and ``QKV_PDL`` at 1 to ``gemv_pdl.MAX_ROWS`` 16-bit rows ``gemv_pdl``'s fp32
    K-quarter partials [4, T, N], launched under the norm before it (which lets it start early); the attention
    sums them."""
    if QKV_PDL and x.dim() == 2 and _pdl(x.device):
        from prefixgate_kernels import gemv_pdl  # Gluon: imported where it can run

        if gemv_pdl.supports(x, weight, bias):
            return gemv_pdl.partials_gemv(x, weight)
    return linear(x, weight, bias)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    pdl: bool = False) -> torch.Tensor:
    """``linear`` for a projection whose only reader is ``add_rms_norm``: at decode-sized 16-bit batches
    its split-K fp32 partials [S, M, N] (one batched GEMM, no reduce kernel; ``prefixgate_kernels.partial_gemm``),
    else the [M, N] product as ``linear`` returns it. ``pdl``: x comes from a kernel that lets the next one
    launch early (the decode attention); with ``DECODE_PDL`` a projection of 1 to ``gemv_pdl.MAX_ROWS`` rows then
    runs as ``gemv_pdl.partials_gemv``, its weights streaming under that kernel (the same [4, M, N] partials)."""
    assert x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1], (
        f"x [M, K] and weight [out, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}"
    )
    assert weight.device == x.device, "x and weight must share a device"
    if pdl and _pdl(x.device) and x.is_contiguous() and _gemv_pdl_takes(x.shape[0], x.dtype, weight, bias):
        return _gemv_partials_for_norm(x, weight)
    return partial_gemm.linear_partials(x, weight, bias, linear)


def _gemv_partials_for_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``gemv_pdl``'s partials launched with PDL for the ``add_rms_norm`` that reads them: under ``NORM_PDL`` it lets
    that norm launch early, and the norm is told so (``_takes_link``)."""
    from prefixgate_kernels import gemv_pdl  # Gluon: imported where it can run

    parts = gemv_pdl.partials_gemv(x, weight, launch_dependents=NORM_PDL)
    return _linked_to_next(parts) if NORM_PDL else parts


def _gemv_pdl_takes(rows: int, dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear_partials(x, weight, bias, pdl=True)`` runs ``gemv_pdl`` for ``rows`` contiguous rows of
    ``dtype``: it stands in for ``partial_gemm`` only where that would return as many partials and the kernel
    takes the shapes."""
    if partial_gemm.slices_for(rows, weight.shape[1], dtype, bias is not None, weight.is_cuda) <= 1:
        return False
    from prefixgate_kernels import gemv_pdl  # Gluon: imported where it can run

    return gemv_pdl.QUARTERS == partial_gemm.SLICES and gemv_pdl.takes(rows, dtype, weight, bias)


def mlp_partials(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
                 down_weight: torch.Tensor, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP after its norm, down(silu(x @ gate.T) * (x @ up.T)), as ``linear_partials`` returns it
    (fp32 partials [S, M, N] or the [M, N] product) for the next ``add_rms_norm``. For 16-bit CUDA
    batches of at most ``gate_up_silu.ENGINE_MAX_ROWS`` rows without a gate|up bias, the gate|up GEMM
    stores silu(gate) * up itself (``prefixgate_kernels.gate_up_silu``); else gate|up, ``silu_mul``."""
    _check_rows("x", x)
    assert gate_up_weight.dim() == 2 and gate_up_weight.shape[1] == x.shape[1] and gate_up_weight.shape[0] % 2 == 0, (
        f"gate_up_weight must be [2 * inter, {x.shape[1]}], got {tuple(gate_up_weight.shape)}")
    inter = gate_up_weight.shape[0] // 2
    assert down_weight.dim() == 2 and down_weight.shape[1] == inter, (
        f"down_weight must be [out, {inter}], got {tuple(down_weight.shape)}")
    assert gate_up_weight.device == x.device and down_weight.device == x.device, "x and the weights must share a device"
    config = None
    if (gate_up_bias is None and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)
            and gate_up_weight.dtype == x.dtype and gate_up_weight.is_contiguous()):
        config = gate_up_silu.choose_config(x.shape[0], inter, x.shape[1], num_sms(x.device),
                                            max_rows=gate_up_silu.ENGINE_MAX_ROWS)
    if config is None:
        return linear_partials(silu_mul(linear(x, gate_up_weight, gate_up_bias)), down_weight, down_bias)
    # the down link (``DOWN_PDL``): gate|up + SiLU lets down launch early only where down will be the
    # ``gemv_pdl`` launch that uses it (a cuBLAS GEMM after it would gain nothing); decided once, here
    pdl = _pdl(x.device)
    link = DOWN_PDL and pdl and _gemv_pdl_takes(x.shape[0], x.dtype, down_weight, down_bias)
    act = gate_up_silu.gate_up_silu(x, gate_up_weight, config, pdl=pdl, launch_dependents=link)
    if not link:
        return linear_partials(act, down_weight, down_bias)
    return _gemv_partials_for_norm(act, down_weight)  # act: a new contiguous [M, I] of x's dtype
