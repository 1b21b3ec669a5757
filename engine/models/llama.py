"""A Llama-family decoder (Llama, Qwen2, Mistral) over a packed ragged batch and a paged KV cache.

Parameter names mirror transformers' ``LlamaForCausalLM`` (``model.layers.N.self_attn.q_proj``,
...), so a checkpoint loads by name with no mapping table. Differences between the families are
config flags: Qwen2's q/k/v bias, tied or untied embeddings, the rope variant.

One forward covers every sequence of a step: prefill chunks and decode tokens are packed along
dim 0 (``input_ids [T]``, ``positions [T]``); the attention metadata says where each sequence's
tokens and blocks are.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import AttentionMetadata, LayerCache, paged_attention
from engine.models.rope import RotaryEmbedding
from engine.models.spec import ArchConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, as transformers does (bf16 parity).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        hidden = arch.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=arch.o_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, cache: LayerCache, meta: AttentionMetadata, ops: ModuleType) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = paged_attention(ops, q, k, v, cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        h, i, b = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i, bias=b), nn.Linear(h, i, bias=b), nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, cos, sin, cache, meta, ops) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, ops)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Construct on the meta device and fill with ``engine.models.loader.load_weights``."""

    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.arch = arch
        self.model = LlamaBackbone(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rotary(self, device: torch.device | str) -> None:
        self.rotary = RotaryEmbedding(self.arch.rope, self.arch.head_dim, self.arch.max_model_len, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        caches: list[LayerCache],  # one per layer
        meta: AttentionMetadata,
        ops: ModuleType,
    ) -> torch.Tensor:
        """-> final hidden states [T, hidden] (normed; feed the rows you need to ``compute_logits``)."""
        assert self.rotary is not None, "call init_rotary(device) after loading"
        cos, sin = self.rotary.cos_sin(positions)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, meta, ops)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()
