"""Rotary position embeddings for the Llama family, with the scaling variants their configs use.

``inv_freq`` follows transformers' definitions (the oracle), so cos/sin agree with it bit for
bit in fp32. Non-interleaved ("rotate half") layout: the head dim is split in two halves.

Dynamic NTK: transformers grows the base with the longest sequence seen; that makes a token's
rotation depend on what else is in the batch, which a shared paged cache cannot allow. We fix
the base once for ``max_model_len``: inside the trained window it is plain RoPE (identical to
transformers there), beyond it the NTK-scaled base for the whole served length (as vLLM does).
"""

from __future__ import annotations

import math

import torch

from engine.models.spec import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_model_len: int) -> torch.Tensor:
    """-> inv_freq [head_dim // 2] float32."""
    base = rope.theta
    p = rope.params
    if rope.rope_type == "dynamic" and max_model_len > rope.max_position_embeddings:
        factor = float(p["factor"])
        ratio = factor * max_model_len / rope.max_position_embeddings - (factor - 1)
        base = base * ratio ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / float(p["factor"])
    elif rope.rope_type == "llama3":
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """Applies RoPE to packed query/key tensors given each token's absolute position.

    cos and sin of every position up to ``max_model_len`` are computed once, at construction, into one
    [L, 2, D] fp32 table (``max_model_len`` x D x 8 bytes: 8.6 MB at 8K positions and head dim 128,
    134 MB at 128K), as vLLM keeps its cos/sin cache: a step then gathers its positions' rows in one
    kernel instead of computing them in five (cast, multiply, concatenate, cos, sin), each of which
    was a node of every decode graph. The values are those ``compute`` gives (the same elementwise
    ops), so a gathered row equals the row computed for that position alone.

    The table runs to ``max_model_len`` rounded up to whole blocks of the largest block size
    (``TABLE_ALIGN``): a CUDA graph's block tables hold whole blocks, so its padded capacity may reach
    past ``max_model_len``, and an index past the table would be a device-side fault, not an error."""

    TABLE_ALIGN = 128  # engine.config's largest block size

    def __init__(self, rope: RopeConfig, head_dim: int, max_model_len: int, device: torch.device | str):
        self.inv_freq = inverse_frequencies(rope, head_dim, max_model_len).to(device)  # [D/2] fp32
        rows = -(-max_model_len // self.TABLE_ALIGN) * self.TABLE_ALIGN
        cos, sin = self.compute(torch.arange(rows, device=device))
        self.table = torch.stack((cos[:, 0], sin[:, 0]), dim=1)  # [L, 2, D] fp32: row p = (cos, sin) at p

    def compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, 1, D] float32, computed (transformers' ops)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos(), emb.sin()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64, each below the table's rows -> cos, sin [T, 1, D] float32 (views of one
        gathered [T, 2, D] tensor; once per forward, for all layers)."""
        rows = self.table.index_select(0, positions)  # [T, 2, D]
        return rows[:, 0:1], rows[:, 1:2]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotated x, same dtype (math in x's dtype like transformers)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
