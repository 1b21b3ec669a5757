"""Plain-torch reference ops: the CPU engine path and the test oracle for every Triton kernel.

Shapes (see engine/batch.py for the block-major cache these are views of)::

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]   (any block stride)
    block_tables     : [num_seqs, max_blocks_per_seq] int32 (unused entries may hold anything)
    seq_lens         : [num_seqs] int32, tokens of context held in the cache per sequence
    slot_mapping     : [num_tokens] int64, block_id * block_size + slot, or -1 to skip

Quantized caches:
    fp8 (torch.float8_e4m3fn): one float32 scale per tensor (shape [] or [1]); x = q * scale.
    int8: one float32 scale per (block, slot, kv head): scale shape [num_blocks, block_size,
          num_kv_heads]; x = q * scale, q = round(x / scale) clamped to [-127, 127].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixgate_kernels import partial_gemm
from prefixgate_kernels.launch_layout import CacheLayout

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in (FP8_DTYPE, torch.int8)


def quantize(
    x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [T, H, D] float -> (q [T, H, D] cache_dtype, per-token-head scale [T, H] or None).

    For fp8 the given per-tensor ``scale`` is used; for int8 a fresh scale per (token, head).
    """
    if cache_dtype == FP8_DTYPE:
        assert scale is not None, "fp8 cache needs a per-tensor scale"
        q = (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, None
    if cache_dtype == torch.int8:
        s = x.float().abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX  # [T, H]
        q = torch.round(x.float() / s.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return q, s
    return x.to(cache_dtype), None


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """q: [..., H, D]; scale: per-tensor ([] / [1]) for fp8 or [..., H] for int8."""
    if q.dtype == FP8_DTYPE:
        assert scale is not None
        return (q.float() * scale.float().reshape(())).to(out_dtype)
    if q.dtype == torch.int8:
        assert scale is not None
        return (q.float() * scale.float().unsqueeze(-1)).to(out_dtype)
    return q.to(out_dtype)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V into their cache slots (reshape_and_cache), quantizing on the way."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offs = slots // block_size, slots % block_size
    for src, cache, scale in ((key[keep], k_cache, k_scale), (value[keep], v_cache, v_scale)):
        q, token_scale = quantize(src, cache.dtype, scale)
        cache[blocks, offs] = q
        if token_scale is not None:
            assert scale is not None and scale.dim() == 3, "int8 cache needs [NB, BS, Hkv] scales"
            scale[blocks, offs] = token_scale


def gather_context(
    cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks]
    context_len: int,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One sequence's first ``context_len`` cached tokens, contiguous: [context_len, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (context_len + block_size - 1) // block_size
    ids = block_table[:n_blocks].long()
    x = cache[ids].reshape(n_blocks * block_size, *cache.shape[2:])[:context_len]
    s = None
    if scale is not None:
        if cache.dtype == torch.int8:
            s = scale[ids].reshape(n_blocks * block_size, scale.shape[2])[:context_len]
        else:
            s = scale
    return dequantize(x, s, out_dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int) -> torch.Tensor:
    """q: [Tq, Hq, D] at positions q_start..; k, v: [Tk, Hkv, D]. Causal by absolute position."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)  # [Tk, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [Hq, Tq, Tk]
    # On q's device: a CPU mask cannot index a CUDA score tensor (the GPU tests compare against this).
    q_pos = torch.arange(q_start, q_start + tq, device=q.device).unsqueeze(1)
    k_pos = torch.arange(tk, device=q.device).unsqueeze(0)
    scores = scores.masked_fill((k_pos > q_pos).unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32 (context including the current token)
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    context_lens: Sequence[int] | None = None,  # host-side copy of seq_lens: a launch hint, unused here
    merge_counters: torch.Tensor | None = None,  # the Triton kernel's split-merge workspace, unused here
) -> torch.Tensor:
    """One query token per sequence over its whole cached context -> [B, Hq, D]."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k = gather_context(k_cache, block_tables[b], n, k_scale, q.dtype)
        v = gather_context(v_cache, block_tables[b], n, v_scale, q.dtype)
        out[b] = _attend(q[b : b + 1], k, v, scale, q_start=n - 1)[0]
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D] new tokens of all sequences, packed
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, offsets of each sequence's new tokens in q
    seq_lens: torch.Tensor,  # [B] int32, context length after this chunk (cached + new)
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    context_lens: Sequence[int] | None = None,  # host-side copy of seq_lens: a launch hint, unused here
) -> torch.Tensor:
    """New tokens attend causally among themselves and fully to their cached prefix.

    The new tokens' K/V must already be written to the cache (write_kv first).
    """
    out = torch.empty_like(q)
    for b in range(block_tables.shape[0]):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if hi == lo:
            continue
        n = int(seq_lens[b])
        k = gather_context(k_cache, block_tables[b], n, k_scale, q.dtype)
        v = gather_context(v_cache, block_tables[b], n, v_scale, q.dtype)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, q_start=n - (hi - lo))
    return out


def prefill_splits(num_tokens: int, num_seqs: int, q_heads: int, max_context: int, device: torch.device,
                   layout: CacheLayout | None = None) -> int:
    """KV splits of a prefill launch (``prefixgate_kernels.triton_ops.prefill_splits``): these ops never split."""
    return 1


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache[dst[i]] = cache[src[i]] for every i (block-major cache: dim 0 indexes blocks)."""
    cache[dst.long()] = cache[src.long()]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack blocks into a contiguous staging buffer: [N, *cache.shape[1:]]."""
    packed = cache[block_ids.long()]
    if out is None:
        return packed.contiguous()
    out.copy_(packed)
    return out


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Unpack a staging buffer [N, *cache.shape[1:]] into the given blocks."""
    cache[block_ids.long()] = staging.to(cache.dtype)


# ------------------------------------------------------------------ fused layer ops (decode/prefill)
# Each mirrors the unfused torch code of engine/models/llama.py op for op (same roundings in the
# compute dtype), so the fused GPU path computes the same function as the CPU path.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> weight * (x / rms(x)) [T, H]: normalise in fp32, scale in x's dtype (transformers)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place, rounded to residual's dtype), then -> rms_norm(residual) [T, H].
    ``x`` may be fp32 partials [S, T, H] (``linear_partials``): their sum, rounded to residual's dtype."""
    if x.dim() == 3:
        x = x.sum(0).to(residual.dtype)
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] fp32 -> rotate-half RoPE in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None].to(x.dtype) + rotated * sin[:, None].to(x.dtype)


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
    k_bias: torch.Tensor | None = None,  # [Hkv, D]: subtracted from the rotated keys before the write (fp8)
) -> torch.Tensor:
    """RoPE on q and k, K/V written into their cache slots -> rotated q [T, Hq, D] (contiguous).

    ``k_bias`` is the fp8 calibration's per-channel key mean (engine/kv_calibration.py), subtracted
    as engine/models/attention.py's plain path does: ``rope(k) - bias`` rounded to k's dtype."""
    t = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    nq = num_q_heads * head_dim
    q = qkv[:, :nq].reshape(t, num_q_heads, head_dim)
    k = qkv[:, nq : nq + kv_heads * head_dim].reshape(t, kv_heads, head_dim)
    v = qkv[:, nq + kv_heads * head_dim :].reshape(t, kv_heads, head_dim)
    k = _rotate(k, cos, sin)
    if k_bias is not None:
        k = k - k_bias.to(k.dtype)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return _rotate(q, cos, sin).contiguous()


def rotary_decode_attention(
    qkv: torch.Tensor,  # [B, (Hq + 2 Hkv) * D]: each sequence's one new token
    cos: torch.Tensor,  # [B, D] float32
    sin: torch.Tensor,
    k_cache: torch.Tensor,
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
    context_lens: Sequence[int] | None = None,  # launch hints of the Triton op, unused here
    merge_counters: torch.Tensor | None = None,
    qkv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A decode step's attention from its merged q|k|v rows: ``rotary_write_kv``, then
    ``paged_decode_attention`` over the caches that now hold the new tokens -> [B, Hq, D]. ``qkv`` may be
    fp32 K-slice partials [S, B, N] of a ``qkv_dtype`` projection: their sum, rounded, is the rows."""
    if qkv.dim() == 3:
        assert qkv_dtype is not None, "q|k|v partials need qkv_dtype, the dtype to round their sum to"
        qkv = partial_gemm.summed(qkv, qkv_dtype)
    q = rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, k_scale, v_scale, k_bias)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up columns) -> silu(gate) * up [T, I] in gate_up's dtype."""
    inter = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] (``F.linear``)."""
    return torch.nn.functional.linear(x, weight, bias)


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A decode-only step's merged q|k|v projection (``linear``); the Triton op may return K-slice partials,
    which ``rotary_decode_attention`` takes either way."""
    return linear(x, weight, bias)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    pdl: bool = False) -> torch.Tensor:
    """``linear`` for a projection read only by ``add_rms_norm``: fp32 split-K partials [S, M, N] where
    ``prefixgate_kernels.partial_gemm.slices_for`` says so (decode-sized 16-bit CUDA batches), else [M, N].
    ``pdl`` (x comes from a kernel that lets the next one launch early) is a launch hint of the Triton ops:
    nothing to do here."""
    return partial_gemm.linear_partials(x, weight, bias, linear)


def mlp_partials(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
                 down_weight: torch.Tensor, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP after its norm, down(silu(x @ gate.T) * (x @ up.T)) with gate|up merged in one weight,
    as ``linear_partials`` returns it (fp32 partials [S, M, N] or the [M, N] product) for the next
    ``add_rms_norm``."""
    return linear_partials(silu_mul(linear(x, gate_up_weight, gate_up_bias)), down_weight, down_bias)
