"""A Llama-family decoder (Llama, Qwen2, Mistral) over a packed ragged batch and a paged KV cache.

Parameter names mirror transformers' ``LlamaForCausalLM`` (``model.layers.N.self_attn.q_proj``,
...), so a checkpoint loads by name with no mapping table. Differences between the families are
config flags: Qwen2's q/k/v bias, tied or untied embeddings, the rope variant.

One forward covers every sequence of a step: prefill chunks and decode tokens are packed along
dim 0 (``input_ids [T]``, ``positions [T]``); the attention metadata says where each sequence's
tokens and blocks are.

Two forward paths compute the same function. The plain one (CPU, the transformers-shaped reference)
runs each projection and elementwise op as its own torch call. The fused one (``fuse_projections``,
taken on CUDA by the model runner) runs one GEMM for q|k|v and one for gate|up, over weights
concatenated once at load, and three fused kernels from ``ops`` per layer step::

    h = add_rms_norm(delta, residual)        residual += delta; h = norm(residual)   (in place)
    qkv = linear(h, Wqkv);  q = rotary_write_kv(qkv)   RoPE on q and k, K/V into the cache
    linear(attention(q, cache), Wo) -> delta;  h = add_rms_norm(delta, residual)
    linear(silu_mul(linear(h, Wgate|up)), Wdown) -> delta

A decode-only step calls ``rotary_decode_attention(qkv)`` instead of the RoPE + write and the
attention: on the GPU one launch does both (prefixgate_kernels/decode_attention.py, ``RopeWrite``).

``ops.linear`` is cuBLAS. The o and down projections, whose only reader is the next
``add_rms_norm``, go through ``ops.linear_partials``: at decode-sized 16-bit batches on the GPU
their split-K partials, which that norm sums, instead of a split-K GEMM and its reduce kernel
(prefixgate_kernels/partial_gemm.py).

After fusion the original ``q_proj.weight`` etc. are views into the concatenated tensors, so the
state dict, its names and its memory are unchanged (transformers can still share the tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, overload

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import AttentionMetadata, LayerCache, paged_attention
from engine.models.kernel_ops import AttentionOps, FusedOps
from engine.models.rope import RotaryEmbedding
from engine.models.spec import ArchConfig
from prefixgate_kernels import cpu_native

# Most rows for which a CPU bf16 projection takes the native one-pass GEMV: oneDNN's bf16 GEMM
# wins from ~8 rows up (measured on one Zen 5 core: native 2.8x faster for the 100k-row LM head
# at 1 row, 2x at 4, 0.5x at 16).
_NATIVE_GEMV_ROWS = 4


def _project(layer: nn.Linear, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``layer(x)`` (x [M, in]), cast to ``out_dtype`` when given. Decode-sized bf16 batches on CPU
    go through the native GEMV (prefixgate_kernels.cpu_native), which reads the weights once at a multiple
    of oneDNN's bandwidth at M = 1: the decode step of a small model is mostly its LM head."""
    if x.dim() == 2 and x.shape[0] <= _NATIVE_GEMV_ROWS and x.dtype == torch.bfloat16 and x.device.type == "cpu" \
            and layer.weight.dtype == torch.bfloat16 and x.shape[1] % 32 == 0:
        kernel = cpu_native.load()
        if kernel is not None:
            return kernel.linear(x, layer.weight, layer.bias, out_dtype or torch.bfloat16)
    y = layer(x)
    return y if out_dtype is None else y.to(out_dtype)


def _concat_as_views(a: nn.Linear, b: nn.Linear, c: nn.Linear | None, name: str) -> torch.Tensor:
    """Concatenate the ``name`` tensors of a, b (, c) along dim 0 and re-point each Linear's
    parameter at its slice: one GEMM reads all of them, and no second copy stays in memory."""
    linears = [m for m in (a, b, c) if m is not None]
    merged = torch.cat([getattr(m, name).detach() for m in linears], dim=0)
    at = 0
    for m in linears:
        n = getattr(m, name).shape[0]
        setattr(m, name, nn.Parameter(merged[at : at + n], requires_grad=False))
        at += n
    return merged


class _Linear(nn.Linear):
    """``nn.Linear`` without its random initial draw. Every builder fills each weight itself
    (``engine.models.loader.build_model`` from the checkpoint, ``random_init.build_random_model``
    from a seeded generator), and the draw, made on the meta device they build on, is what first
    imports ``torch._dynamo`` (1.3-2.3 s of a CPU server's start)."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    """``nn.Embedding`` without its random initial draw (as ``_Linear``)."""

    def reset_parameters(self) -> None:
        pass


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
        self.q_proj = _Linear(hidden, self.num_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = _Linear(hidden, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = _Linear(hidden, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = _Linear(self.num_heads * self.head_dim, hidden, bias=arch.o_bias)
        self.scale = self.head_dim**-0.5
        self.qkv_weight: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D, hidden] after fuse_projections
        self.qkv_bias: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """Concatenate q/k/v into one weight; the three Linear weights become views of it."""
        self.qkv_weight = _concat_as_views(self.q_proj, self.k_proj, self.v_proj, "weight")
        if self.q_proj.bias is not None:
            self.qkv_bias = _concat_as_views(self.q_proj, self.k_proj, self.v_proj, "bias")

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
                      meta: AttentionMetadata, ops: FusedOps) -> torch.Tensor:
        """x [T, hidden] normed; cos, sin [T, D] fp32 -> attention output projected [T, hidden]."""
        assert self.qkv_weight is not None, "call fuse_projections() first"
        t = x.shape[0]
        if meta.decode_only:  # RoPE, the K/V write and the attention: one launch on the GPU
            # [T, (Hq + 2 Hkv) * D], or its K-slice partials (1 to gemv_pdl.MAX_ROWS rows under triton_ops.QKV_PDL),
            # which the launch sums
            qkv = ops.qkv_projection(x, self.qkv_weight, self.qkv_bias)
            out = ops.rotary_decode_attention(qkv, cos, sin, cache.k, cache.v, meta.slot_mapping, self.num_heads,
                                              meta.block_tables, meta.seq_lens, self.scale, cache.k_scale,
                                              cache.v_scale, cache.k_bias, context_lens=meta.context_lens,
                                              merge_counters=meta.merge_counters, qkv_dtype=x.dtype)
        else:
            qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)  # [T, (Hq + 2 Hkv) * D]
            q = ops.rotary_write_kv(qkv, cos, sin, cache.k, cache.v, meta.slot_mapping, self.num_heads,
                                    cache.k_scale, cache.v_scale, cache.k_bias)  # [T, Hq, D]; K/V now in the cache
            out = ops.paged_prefill_attention(q, cache.k, cache.v, meta.block_tables, meta.cu_seqlens_q,
                                              meta.seq_lens, self.scale, cache.k_scale, cache.v_scale,
                                              context_lens=meta.context_lens)
        # read only by the next add_rms_norm: at decode sizes split-K partials it sums (prefixgate_kernels/partial_gemm.py);
        # after the decode attention, which lets the next kernel launch early (triton_ops.DECODE_PDL), its weights
        # may stream under that launch
        return ops.linear_partials(out.reshape(t, self.num_heads * self.head_dim), self.o_proj.weight,
                                   self.o_proj.bias, pdl=meta.decode_only)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
                meta: AttentionMetadata, ops: AttentionOps) -> torch.Tensor:
        t = x.shape[0]
        q = _project(self.q_proj, x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = _project(self.k_proj, x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = _project(self.v_proj, x).view(t, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = paged_attention(ops, q, k, v, cache, meta, self.scale)  # [T, Hq, D]
        return _project(self.o_proj, out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        h, i, b = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = _Linear(h, i, bias=b), _Linear(h, i, bias=b), _Linear(i, h, bias=b)
        self.gate_up_weight: torch.Tensor | None = None  # [2I, hidden] after fuse_projections
        self.gate_up_bias: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        self.gate_up_weight = _concat_as_views(self.gate_proj, self.up_proj, None, "weight")
        if self.gate_proj.bias is not None:
            self.gate_up_bias = _concat_as_views(self.gate_proj, self.up_proj, None, "bias")

    def forward_fused(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        assert self.gate_up_weight is not None, "call fuse_projections() first"
        # down(silu(gate) * up): [T, hidden], or its split-K partials [S, T, hidden] for the next
        # add_rms_norm to sum (at decode sizes on the GPU the gate|up GEMM stores silu(gate) * up itself:
        # prefixgate_kernels/gate_up_silu.py)
        return ops.mlp_partials(x, self.gate_up_weight, self.gate_up_bias, self.down_proj.weight, self.down_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _project(self.down_proj, F.silu(_project(self.gate_proj, x)) * _project(self.up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
                meta: AttentionMetadata, ops: AttentionOps) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, ops)
        return x + self.mlp(self.post_attention_layernorm(x))


if TYPE_CHECKING:
    class DecoderLayers(nn.ModuleList):
        """Holds DecoderLayers, which torch types as Module (at run time a plain ModuleList)."""

        def __iter__(self) -> Iterator[DecoderLayer]: ...
        @overload
        def __getitem__(self, idx: slice) -> nn.ModuleList: ...
        @overload
        def __getitem__(self, idx: int) -> DecoderLayer: ...
        def __getitem__(self, idx: int | slice) -> DecoderLayer | nn.ModuleList: ...
else:
    DecoderLayers = nn.ModuleList


class LlamaBackbone(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.embed_tokens = _Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = DecoderLayers(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Construct on the meta device and fill with ``engine.models.loader.load_weights``."""

    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.arch = arch
        self.model = LlamaBackbone(arch)
        self.lm_head = _Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.fused = False  # set by fuse_projections: forward takes the fused-kernel path

    def fuse_projections(self) -> None:
        """Merge q|k|v and gate|up weights (views keep the state dict as it was) and switch
        ``forward`` to the fused path. Idempotent; call after loading, on the compute device."""
        if self.fused:
            return
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        self.fused = True

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rotary(self, device: torch.device | str) -> None:
        self.rotary = RotaryEmbedding(self.arch.rope, self.arch.head_dim, self.arch.max_model_len, device)

    if TYPE_CHECKING:  # nn.Module types __call__ as taking anything: calls are checked against forward's
        def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                     meta: AttentionMetadata, ops: FusedOps) -> torch.Tensor: ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        caches: list[LayerCache],  # one per layer
        meta: AttentionMetadata,
        ops: FusedOps,
    ) -> torch.Tensor:
        """-> final hidden states [T, hidden] (normed; feed the rows you need to ``compute_logits``),
        on the fused path once ``fuse_projections`` ran, else on the plain one."""
        if not self.fused:
            return self.forward_plain(input_ids, positions, caches, meta, ops)
        assert self.rotary is not None, "call init_rotary(device) after loading"
        cos, sin = self.rotary.cos_sin(positions)
        return self._forward_fused(input_ids, cos[:, 0], sin[:, 0], caches, meta, ops)

    def forward_plain(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                      meta: AttentionMetadata, ops: AttentionOps) -> torch.Tensor:
        """``forward`` on the plain path whether or not the projections are fused (the plain
        parameters are views of the fused weights), with ops that need only be ``AttentionOps``:
        what ``forward`` runs before ``fuse_projections``, and fp8 calibration's recording stand-in
        for the KV ops (engine/kv_calibration.py)."""
        assert self.rotary is not None, "call init_rotary(device) after loading"
        cos, sin = self.rotary.cos_sin(positions)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, meta, ops)
        return self.model.norm(x)

    def _forward_fused(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       caches: list[LayerCache], meta: AttentionMetadata, ops: FusedOps) -> torch.Tensor:
        """The fused path (module docstring); cos, sin [T, D] fp32 -> final normed hidden [T, hidden]."""
        eps = self.arch.rms_norm_eps
        residual = self.model.embed_tokens(input_ids)  # [T, hidden], the running sum (updated in place)
        delta: torch.Tensor | None = None  # the last sublayer's output, not yet added to residual
        for layer, cache in zip(self.model.layers, caches, strict=True):
            w_in = layer.input_layernorm.weight
            h = ops.rms_norm(residual, w_in, eps) if delta is None else ops.add_rms_norm(delta, residual, w_in, eps)
            delta = layer.self_attn.forward_fused(h, cos, sin, cache, meta, ops)
            h = ops.add_rms_norm(delta, residual, layer.post_attention_layernorm.weight, eps)
            delta = layer.mlp.forward_fused(h, ops)
        if delta is None:
            return ops.rms_norm(residual, self.model.norm.weight, eps)
        return ops.add_rms_norm(delta, residual, self.model.norm.weight, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return _project(self.lm_head, hidden, torch.float32)
