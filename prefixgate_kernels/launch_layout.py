"""What a prefill launch's kernel choice reads off its tensors beyond the step's sizes.

The launcher (``prefill_attention.plan_prefill``) picks a kernel, and for a split launch a split count,
from the step's sizes and from the cache it reads: the warp-specialised Gluon kernel takes 16-bit caches
at head dims 64 and 128 whose blocks tile its 128-key tiles, and splits over its own 128-row tiles. A
CUDA-graph runner keys its graphs by that split count before any tensor of the step exists
(engine/prefill_graphs.py), so it describes the cache with this instead. Plain data, no Triton import:
the engine builds it on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheLayout:
    """The attention inputs' shape and dtypes a kernel choice depends on: query dtype, cache dtype (both
    halves of the cache share it), head dim and cache block size."""

    head_dim: int
    block_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype

    @classmethod
    def of(cls, q_dtype: torch.dtype, k_cache: torch.Tensor) -> CacheLayout:
        """The layout of a block-major cache [NB, BS, Hkv, D] read by queries of ``q_dtype``."""
        _, block_size, _, head_dim = k_cache.shape
        return cls(head_dim=head_dim, block_size=block_size, q_dtype=q_dtype, kv_dtype=k_cache.dtype)
