"""CPU paged attention (the CPU engine path): a native kernel or SDPA for prefill, grouped-query
matmuls for decode.

Prefill chunks of bf16 models over a bf16 cache go to the native AVX-512 BF16 kernel
(``prefixgate_kernels.cpu_native``: 4x SDPA's speed at head dim 32, 213 vs 53 GFLOP/s on one Zen 5 core for
a 1,600-token causal prompt) where it builds and the CPU has the instructions; everything else
(fp32, quantized caches, other head dims, no compiler) takes SDPA as below. In decode steps
the same kernel runs every sequence that shares no block with another (one call for all of them:
batch-1 decode 6.0 -> 4.6 ms of CPU per token); sequences sharing a prefix keep the cascade below.

Same signatures and cache layout as ``prefixgate_kernels.reference`` (whose plain einsum-softmax ``_attend``
stays the test oracle); the block moves, ``write_kv`` and the fused layer ops (``rms_norm`` ..
``mlp_partials``) are the reference ones. The CPU runner never fuses, so the engine calls only the
attention, ``write_kv`` and the block moves here; with the fused ops too the module is a whole ops module
(``engine.models.kernel_ops.KernelOps``), as ``reference`` and ``triton_ops`` are, and a fused model
runs on it as on ``reference``.

Prefill (why SDPA): the reference materializes a float32 [heads, Tq, Tk] score matrix per
sequence (a 4K prompt: 4K x 4K x heads floats) and softmaxes it out of cache; PyTorch's fused
``scaled_dot_product_attention`` tiles it. A sequence's new tokens sit at positions n - Tq .. n - 1
of an n-token context, so token i may see keys 0 .. n - Tq + i: with no cached prefix (Tq == n)
that is SDPA's own ``is_causal``; with one, an explicit boolean mask shifted by the prefix length.

Decode (why not SDPA): one query token per sequence gains nothing from a fused kernel, while
repeating K/V for every query head of a group (what the reference and SDPA's GQA path do) triples
the bytes read for a 9/3-head model. Grouping the query heads by KV head instead reads each K/V
once (measured 3x faster than either at batch 1, context 2048, on one core):

    q [Hq, D] -> [Hkv, G, D];  k, v [n, Hkv, D];  scores [Hkv, G, n] = einsum("hgd,nhd->hgn")

Decode batches (why batched): a per-sequence loop costs ~10 small torch calls per sequence and
layer (a 256-sequence decode step: 10,000 calls of host time for a few MFLOP each). Sequences of
similar length run as one group instead: one gather of every group member's blocks, padded to the
longest, keys past each sequence's end masked out::

    ids [B, nb] = block_tables[group, :nb];  k, v = cache[ids, heads] -> [B, Hkv, nb * BS, D]
    scores [B, Hkv, G, L] = q [B, Hkv, G, D] @ k^T;  position >= seq_len -> -inf

A group's padding is bounded (``_PAD_SLACK``), so a short sequence never pays for a long one.
Decode tokens inside a mixed prefill step (one new token, ``tq == 1``) take the same path.

Math dtype: scores and outputs are computed in the query's dtype with float32 softmax, as
transformers' eager attention does (bf16 models: bf16 GEMMs; fp32 models: fp32 throughout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prefixgate_kernels import cpu_native
from prefixgate_kernels.reference import (
    add_rms_norm,
    copy_blocks,
    dequantize,
    gather_blocks,
    gather_context,
    linear,
    linear_partials,
    mlp_partials,
    prefill_splits,
    qkv_projection,
    rms_norm,
    rotary_decode_attention,
    rotary_write_kv,
    scatter_blocks,
    silu_mul,
    write_kv,
)

__all__ = [
    "copy_blocks", "gather_blocks", "scatter_blocks", "write_kv",
    "paged_decode_attention", "paged_prefill_attention", "prefill_splits",
    "rms_norm", "add_rms_norm", "rotary_write_kv", "rotary_decode_attention", "silu_mul", "linear", "linear_partials",
    "qkv_projection", "mlp_partials",
]


# SDPA's enable_gqa (no K/V repeat) exists from torch 2.5; the project admits 2.4.
_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
          attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> [B, Hq, Tq, D]; kv heads shared by Hq/Hkv query heads."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and _HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


# A decode group's padded length may exceed its shortest member's by this factor plus one block.
_PAD_SLACK = 1.25
# Most gathered K (or V) elements per decode group (bounds the gather buffer: 32M bf16 = 64 MB).
_GROUP_ELEMS = 32 * 1024 * 1024


def _length_groups(lens: list[int], block_size: int, row_elems: int) -> list[list[int]]:
    """Indices of ``lens`` grouped so that each group's longest is at most _PAD_SLACK x its
    shortest + one block, and its padded gather stays under _GROUP_ELEMS."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            shortest = lens[g[0]]
            if lens[i] <= shortest * _PAD_SLACK + block_size and (len(g) + 1) * lens[i] * row_elems <= _GROUP_ELEMS:
                g.append(i)
                continue
        groups.append([i])
    return groups


def _gather(cache: torch.Tensor, scale_t: torch.Tensor | None, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``ids`` [B, nb] of one layer's cache -> [B, Hkv, nb * BS, D] in ``dtype``, laid out so
    that matmul reads it as is (einsum over [B, L, Hkv, D] would permute-copy it once more).

    ``index_select`` of whole blocks, then one permuting copy: measured 10-15x faster than indexing
    blocks and kv heads together (0.9 vs 13.7 ms for 64 x 1,600 tokens, bf16)."""
    bsz, nb = ids.shape
    bs, hkv, d = cache.shape[1:]
    flat = ids.reshape(-1).long()
    x = cache.index_select(0, flat).view(bsz, nb, bs, hkv, d).permute(0, 3, 1, 2, 4)  # [B, Hkv, nb, BS, D]
    s = None
    if scale_t is not None:  # int8: per (block, slot, head) [NB, BS, Hkv] -> [B, Hkv, nb, BS]
        s = scale_t.index_select(0, flat).view(bsz, nb, bs, hkv).permute(0, 3, 1, 2) if cache.dtype == torch.int8 else scale_t
    return dequantize(x, s, dtype).reshape(bsz, hkv, nb * bs, d)


def _partial(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalized softmax attention: scores [..., L] float32, v [..., L, D] -> (sum_l e_l v_l
    [..., D] float32, max score m [..., 1], sum_l e_l [..., 1]) with e_l = exp(score_l - m)."""
    m = scores.amax(-1, keepdim=True)
    e = torch.exp(scores - m)
    return torch.matmul(e.to(v.dtype), v).float(), m, e.sum(-1, keepdim=True)


def _shared_blocks(tables: torch.Tensor, min_len: int, block_size: int) -> int:
    """Leading block-table columns that every row holds alike (a shared cached prefix), capped so
    that each sequence keeps at least its newest token outside them."""
    cols = (min_len - 1) // block_size
    if tables.shape[0] < 2 or cols == 0:
        return 0
    same = (tables[:, :cols] == tables[:1, :cols]).all(dim=0)  # [cols]
    return int(same.int().cumprod(0).sum())


# Shared prefixes shorter than this many blocks are not worth a separate pass.
_MIN_SHARED_BLOCKS = 4


def _decode_group(
    q: torch.Tensor,  # [B, Hq, D], one query token per sequence of the group
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [B, max_blocks]
    lens: torch.Tensor,  # [B] int64
    max_len: int,
    min_len: int,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """One query token per sequence over its first lens[b] cached tokens -> [B, Hq, D].

    Blocks that every sequence of the group shares (tenants' common prompt prefixes, held once
    in the cache) are read once for all of them, as one GEMM of all the group's query rows,
    instead of once per sequence; the rest per sequence; the two halves merge by their softmax
    maxima and sums (the log-sum-exp merge of cascade attention)::

        shared keys  [Hkv, P, D]  <- q rows [Hkv, B*G, D]         (o_p, m_p, s_p)
        own keys     [B, Hkv, L - P, D] <- q [B, Hkv, G, D]       (o_s, m_s, s_s)
        out = (o_p e^(m_p - m) + o_s e^(m_s - m)) / (s_p e^(m_p - m) + s_s e^(m_s - m)),  m = max(m_p, m_s)
    """
    bsz, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    nb = -(-max_len // bs)
    qg = q.view(bsz, hkv, g, d)  # [B, Hkv, G, D]
    shared = _shared_blocks(tables, min_len, bs)
    if shared < _MIN_SHARED_BLOCKS:
        shared = 0
    own = tables[:, shared:nb]  # [B, nb - shared]
    k, v = _gather(k_cache, k_scale, own, q.dtype), _gather(v_cache, v_scale, own, q.dtype)  # [B, Hkv, L', D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L']
    past_end = torch.arange(k.shape[2], device=q.device).unsqueeze(0) >= (lens - shared * bs).unsqueeze(1)
    scores.masked_fill_(past_end[:, None, None, :], float("-inf"))
    if not shared:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).reshape(bsz, hq, d)  # [B, Hkv, G, D] -> [B, Hq, D]
    o_s, m_s, s_s = _partial(scores, v)  # [B, Hkv, G, D], [B, Hkv, G, 1] x 2
    pre = tables[:1, :shared]
    kp, vp = _gather(k_cache, k_scale, pre, q.dtype)[0], _gather(v_cache, v_scale, pre, q.dtype)[0]  # [Hkv, P, D]
    rows = qg.permute(1, 0, 2, 3).reshape(hkv, bsz * g, d)  # [Hkv, B*G, D]
    o_p, m_p, s_p = _partial(torch.matmul(rows, kp.transpose(-1, -2)).float() * scale, vp)
    o_p, m_p, s_p = (t.view(hkv, bsz, g, -1).permute(1, 0, 2, 3) for t in (o_p, m_p, s_p))  # [B, Hkv, G, .]
    m = torch.maximum(m_p, m_s)
    a, b = torch.exp(m_p - m), torch.exp(m_s - m)
    return ((o_p * a + o_s * b) / (s_p * a + s_s * b)).to(q.dtype).reshape(bsz, hq, d)


def _native_kernel(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> cpu_native.NativeKernel | None:
    """The native kernel when it runs this call: bf16 queries and an unquantized bf16 cache on CPU
    whose pages are laid token by token, a compiled (head dim, group) instance, and a machine where it
    built and loaded."""
    if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or k_scale is not None or q.device.type != "cpu":
        return None
    _, _, kv_heads, head_dim = k_cache.shape
    if k_cache.stride()[1:] != (kv_heads * head_dim, head_dim, 1):  # it reads whole token rows (not head-major pages)
        return None
    kernel = cpu_native.load()
    if kernel is None or not kernel.supports(q.shape[-1], q.shape[1] // k_cache.shape[2]):
        return None
    return kernel


def _decode_rows(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    lens: list[int],
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out: torch.Tensor,  # [B, Hq, D] written
) -> None:
    row_elems = k_cache.shape[2] * k_cache.shape[3]
    # Sequences that start in the same block share at least that prefix block (a block is only
    # ever shared as part of a common prefix): grouping by it first lets _decode_group read a
    # tenant's shared prompt blocks once for all its sequences.
    by_first: dict[int, list[int]] = {}
    padding = []
    for i, first in enumerate(block_tables[:, 0].tolist()):
        if lens[i] == 0:  # a padding row of a fixed-size batch (a captured graph's unused slots)
            padding.append(i)
        else:
            by_first.setdefault(first, []).append(i)
    if padding:  # attends to no key: zeros (nothing reads them; an empty softmax has no value)
        out[torch.tensor(padding, dtype=torch.long, device=q.device)] = 0
    native = _native_kernel(q, k_cache, k_scale)
    if native is not None:
        # Sequences that share no block with another run natively, all in one call (no gather
        # copy, no per-group torch calls); groups sharing a prefix keep the cascade below, which
        # reads the shared blocks once for the whole group.
        alone = [m[0] for m in by_first.values() if len(m) == 1]
        if alone:
            idx = torch.tensor(alone, dtype=torch.long, device=q.device)
            got = torch.empty((len(alone), *q.shape[1:]), dtype=q.dtype, device=q.device)
            native.attention(q.index_select(0, idx).contiguous(), k_cache, v_cache,
                             block_tables.index_select(0, idx).to(torch.int32).contiguous(),
                             torch.arange(len(alone) + 1, dtype=torch.int32),
                             torch.tensor([lens[i] for i in alone], dtype=torch.int32), scale, got, min_tq=1)
            out[idx] = got
            by_first = {f: m for f, m in by_first.items() if len(m) > 1}
    groups = []
    for members in by_first.values():
        sub = _length_groups([lens[i] for i in members], k_cache.shape[1], row_elems)
        groups += [[members[j] for j in g] for g in sub]
    for group in groups:
        longest, shortest = max(lens[i] for i in group), min(lens[i] for i in group)
        idx = torch.tensor(group, dtype=torch.long, device=q.device)
        lens_t = torch.tensor([lens[i] for i in group], dtype=torch.long, device=q.device)
        out[idx] = _decode_group(q[idx], k_cache, v_cache, block_tables[idx], lens_t, longest, shortest, scale,
                                 k_scale, v_scale)


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
    _decode_rows(q, k_cache, v_cache, block_tables, seq_lens.tolist(), scale, k_scale, v_scale, out)
    return out


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
    *,
    context_lens: Sequence[int] | None = None,  # host-side copy of seq_lens: a launch hint, unused here
) -> torch.Tensor:
    """New tokens attend causally among themselves and fully to their cached prefix (K/V written first)."""
    native = _native_kernel(q, k_cache, k_scale)
    if native is not None:
        q = q.contiguous()
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    if native is not None:  # every sequence of two or more new tokens, in one call
        native.attention(q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                         cu_seqlens_q.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(), scale, out, min_tq=2)
    single = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]  # decode tokens of a mixed step
    if single:
        rows = torch.tensor([cu[b] for b in single], dtype=torch.long, device=q.device)
        got = torch.empty((len(single), *q.shape[1:]), dtype=q.dtype, device=q.device)
        _decode_rows(q[rows], k_cache, v_cache, block_tables[torch.tensor(single, device=q.device)],
                     [lens[b] for b in single], scale, k_scale, v_scale, got)
        out[rows] = got
    for b in range(block_tables.shape[0]):
        lo, hi = cu[b], cu[b + 1]
        if hi - lo <= 1 or native is not None:
            continue
        n, tq = lens[b], hi - lo
        k = gather_context(k_cache, block_tables[b], n, k_scale, q.dtype).transpose(0, 1).unsqueeze(0)  # [1,Hkv,n,D]
        v = gather_context(v_cache, block_tables[b], n, v_scale, q.dtype).transpose(0, 1).unsqueeze(0)
        qb = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, Tq, D]
        if tq == n:
            o = _sdpa(qb, k, v, scale, is_causal=True)
        else:
            q_pos = torch.arange(n - tq, n, device=q.device).unsqueeze(1)
            mask = torch.arange(n, device=q.device).unsqueeze(0) <= q_pos  # [Tq, n]
            o = _sdpa(qb, k, v, scale, attn_mask=mask)
        out[lo:hi] = o.squeeze(0).transpose(0, 1)
    return out
