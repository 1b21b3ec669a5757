"""CPU paged attention through PyTorch's fused ``scaled_dot_product_attention`` (the CPU engine path).

Same signatures and cache layout as ``kernels.reference`` (whose plain einsum-softmax ``_attend``
stays the test oracle); the block moves and ``write_kv`` are the reference ones. Why: the
reference materializes a float32 [heads, Tq, Tk] score matrix per sequence (a 4K prompt holds
4K x 4K x heads floats), while SDPA's CPU flash kernel tiles it and fuses the softmax.

Decode gathers every sequence's blocks at once, padded to the longest context, and runs one SDPA
call for the whole batch with a key-padding mask (no Python loop per sequence):

    q      [B, Hq, 1, D]
    k, v   [B, Hkv, max_blocks * block_size, D]    (blocks of block_tables, dequantized)
    mask   [B, 1, 1, max_blocks * block_size]       key position < seq_len

Prefill runs per sequence: its new tokens sit at positions n - Tq .. n - 1 of an n-token context,
so token i may see keys 0 .. n - Tq + i. With no cached prefix (Tq == n) that is SDPA's own
``is_causal``; with one, an explicit boolean mask shifted by the prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import copy_blocks, gather_blocks, gather_context, scatter_blocks, write_kv

__all__ = [
    "copy_blocks", "gather_blocks", "scatter_blocks", "write_kv",
    "paged_decode_attention", "paged_prefill_attention",
]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw) -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> [B, Hq, Tq, D]; kv heads shared by Hq/Hkv query heads."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # SDPA's enable_gqa needs torch >= 2.5 and its CPU path repeats K/V itself anyway
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **kw)


def _gather_padded(
    cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Every sequence's blocks, padded to max_blocks: [B, Hkv, max_blocks * BS, D] in ``out_dtype``."""
    b, max_blocks = block_tables.shape
    bs, hkv, d = cache.shape[1:]
    ids = block_tables.long().clamp(0, cache.shape[0] - 1)  # padding entries may hold anything
    x = cache[ids].reshape(b, max_blocks * bs, hkv, d)
    if cache.dtype == torch.int8:
        s = scale[ids].reshape(b, max_blocks * bs, hkv, 1)
        x = x.float() * s
    elif cache.dtype == torch.float8_e4m3fn:
        x = x.float() * scale.float().reshape(())
    return x.to(out_dtype).transpose(1, 2)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32 (context including the current token)
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its whole cached context -> [B, Hq, D]."""
    bsz = q.shape[0]
    max_len = int(seq_lens.max())
    block_size = k_cache.shape[1]
    tables = block_tables[:, : (max_len + block_size - 1) // block_size]
    k = _gather_padded(k_cache, tables, k_scale, q.dtype)  # [B, Hkv, L, D]
    v = _gather_padded(v_cache, tables, v_scale, q.dtype)
    if bsz == 1:  # no padding: the whole gathered context up to seq_len is valid
        k, v = k[:, :, :max_len], v[:, :, :max_len]
        return _sdpa(q.unsqueeze(2), k, v, scale).squeeze(2)
    key_pos = torch.arange(k.shape[2], device=q.device)
    mask = (key_pos.unsqueeze(0) < seq_lens.to(q.device).long().unsqueeze(1))[:, None, None, :]  # [B,1,1,L]
    return _sdpa(q.unsqueeze(2), k, v, scale, attn_mask=mask).squeeze(2)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D] new tokens of all sequences, packed
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length after this chunk (cached + new)
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens attend causally among themselves and fully to their cached prefix (K/V written first)."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(block_tables.shape[0]):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        n, tq = lens[b], hi - lo
        k = gather_context(k_cache, block_tables[b], n, k_scale, q.dtype).transpose(0, 1).unsqueeze(0)  # [1,Hkv,n,D]
        v = gather_context(v_cache, block_tables[b], n, v_scale, q.dtype).transpose(0, 1).unsqueeze(0)
        qb = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, Tq, D]
        if tq == n:
            o = _sdpa(qb, k, v, scale, is_causal=True)
        elif tq == 1:
            o = _sdpa(qb, k, v, scale)
        else:
            q_pos = torch.arange(n - tq, n, device=q.device).unsqueeze(1)
            mask = torch.arange(n, device=q.device).unsqueeze(0) <= q_pos  # [Tq, n]
            o = _sdpa(qb, k, v, scale, attn_mask=mask)
        out[lo:hi] = o.squeeze(0).transpose(0, 1)
    return out
