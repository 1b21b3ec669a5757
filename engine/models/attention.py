"""Paged attention for one layer, and the single place where the KV ops are chosen by device.

``select_ops`` returns a kernel ops module, typed as what the engine calls on it
(``engine.models.kernel_ops.KernelOps``: ``write_kv``, the paged attentions, the fused layer ops,
the block moves): ``prefixgate_kernels.cpu_attention`` on CPU (the reference ops, with a native AVX-512 BF16 kernel or
PyTorch's fused SDPA for prefill attention),
``prefixgate_kernels.triton_ops`` on CUDA when present, else ``prefixgate_kernels.reference``.
Swapping implementations is that one function.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.models.kernel_ops import AttentionOps, KernelOps
from prefixgate_kernels import cpu_attention, reference

log = logging.getLogger(__name__)


def select_ops(device: torch.device | str) -> KernelOps:
    if torch.device(device).type == "cuda":
        try:
            from prefixgate_kernels import triton_ops  # imported where it can run

            return triton_ops
        except ImportError as exc:  # the Triton launchers are not built yet / triton missing
            log.warning("prefixgate_kernels.triton_ops unavailable (%s); using the torch reference ops on CUDA", exc)
        return reference
    return cpu_attention


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step layout of the packed batch (B sequences, T new tokens in all).

    slot_mapping  [T] int64   cache slot of each new token (block_id * block_size + offset)
    block_tables  [B, max_blocks] int32, padded with 0
    cu_seqlens_q  [B + 1] int32, offsets of each sequence's new tokens in the packed tensors
    seq_lens      [B] int32, context length after this step (cached + new)
    decode_only   every sequence contributes exactly one new token
    context_lens  the same lengths on the host, when known (eager steps): a hint with which the GPU
                  decode kernel splits a batch of unequal lengths; None in a CUDA graph, whose
                  launch is fixed at capture
    merge_counters  [>= B * kv_heads] int32 zeros the GPU decode kernel counts finished splits in
                  (prefixgate_kernels/decode_attention.py), owned by whoever launches the steps on one stream
                  (the runner, its decode graphs); None: each launch zeroes its own
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    decode_only: bool
    context_lens: tuple[int, ...] | None = None
    merge_counters: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerCache:
    """One layer's views into the block-major cache: k, v [NB, BS, Hkv, D]; int8 scales [NB, BS, Hkv]
    or fp8 per-tensor scales [1]; ``k_bias`` [Hkv, D]: subtracted from keys before they are
    stored (fp8; softmax-invariant, see engine/kv_calibration.py)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None


def paged_attention(
    ops: AttentionOps,
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each sequence's whole context -> [T, Hq, D]."""
    if cache.k_bias is not None:
        k = k - cache.k_bias.to(k.dtype)  # every stored key shifts alike: scores move by q . bias per query
    ops.write_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
    if meta.decode_only:
        return ops.paged_decode_attention(
            q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, cache.k_scale, cache.v_scale
        )
    return ops.paged_prefill_attention(
        q, cache.k, cache.v, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, scale, cache.k_scale, cache.v_scale
    )
