"""What the model, its CUDA graphs and the runner call on a kernel ops module, as Protocols.

``engine.models.attention.select_ops`` picks one module per device: ``prefixgate_kernels.triton_ops``
(CUDA), ``prefixgate_kernels.reference`` (CUDA without the Triton launchers) or
``prefixgate_kernels.cpu_attention`` (CPU). A module satisfies a Protocol through its functions'
signatures, which mypy checks where ``select_ops`` returns it; an object with such methods does too
(``engine.kv_calibration.AmaxRecorder`` is an ``AttentionOps``). mypy matches a Protocol member's
positional parameters by position, kind and default, not by name; keyword-only ones by name. So every
argument the engine passes by keyword (``pdl``, ``out``, the launch hints) is keyword-only here,
and a backend that renamed one would fail the check.

Three layers, each what its callers need::

    AttentionOps  the plain forward path: the K/V write and paged attention (engine.models.attention)
    FusedOps      the fused forward path (engine.models.llama, taken on CUDA): + norms, projections, RoPE
    KernelOps     a whole ops module: + the runner's block moves and the prefill graphs' split count

Annotations only: torch is imported for the type checker alone, the Protocols are not
``runtime_checkable`` and nothing checks an ops object against them at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from prefixgate_kernels.launch_layout import CacheLayout


class AttentionOps(Protocol):
    """The plain forward path's KV ops (``engine.models.attention.paged_attention``): write a step's
    K/V into the paged cache, then attend. Shapes and the cache layout: prefixgate_kernels/reference.py.

    Implemented by ``prefixgate_kernels.triton_ops``, ``prefixgate_kernels.reference`` and
    ``prefixgate_kernels.cpu_attention`` (every ``KernelOps``), and by the fp8 calibration's
    recording stand-in ``engine.kv_calibration.AmaxRecorder``, which ``LlamaForCausalLM.forward_plain``
    takes in their place."""

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None: ...

    def paged_prefill_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32
        seq_lens: torch.Tensor,  # [B] int32, context after this chunk
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        *,
        context_lens: Sequence[int] | None = None,  # seq_lens on the host: a launch hint (the fused path's)
    ) -> torch.Tensor: ...

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [B, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        seq_lens: torch.Tensor,  # [B] int32, including the current token
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class FusedOps(AttentionOps, Protocol):
    """The fused forward path's ops (``LlamaForCausalLM`` after ``fuse_projections``, module
    docstring of engine/models/llama.py): RMSNorm with the residual add, the merged projections and
    their split-K partials, RoPE with the K/V write (and, for decode, the attention in the same call).

    Implemented by ``prefixgate_kernels.triton_ops`` (the Triton / Gluon launchers) and
    ``prefixgate_kernels.reference`` (their torch references), and by
    ``prefixgate_kernels.cpu_attention``, whose fused ops are the reference ones (the runner fuses
    on CUDA only)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def qkv_projection(self, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def linear_partials(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        pdl: bool = False) -> torch.Tensor: ...

    def mlp_partials(self, x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
                     down_weight: torch.Tensor, down_bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
        cos: torch.Tensor,  # [T, D] float32
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_q_heads: int,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        k_bias: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def rotary_decode_attention(
        self,
        qkv: torch.Tensor,  # [B, (Hq + 2 Hkv) * D], or qkv_projection's fp32 partials [S, B, N]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_q_heads: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        k_bias: torch.Tensor | None = None,
        *,
        context_lens: Sequence[int] | None = None,
        merge_counters: torch.Tensor | None = None,
        qkv_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...


class KernelOps(FusedOps, Protocol):
    """A whole kernel ops module, what ``select_ops`` returns and the model runner holds: the fused
    path's ops, the whole-block moves of the runner's block copies, exports and imports, and the
    split count a prefill launch takes (``PrefillGraphs`` captures one graph per count).

    Implemented by ``prefixgate_kernels.triton_ops``, ``prefixgate_kernels.reference`` and
    ``prefixgate_kernels.cpu_attention``."""

    def prefill_splits(self, num_tokens: int, num_seqs: int, q_heads: int, max_context: int,
                       device: torch.device, layout: CacheLayout | None = None) -> int: ...

    def copy_blocks(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None: ...

    def gather_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, *,
                      out: torch.Tensor | None = None) -> torch.Tensor: ...

    def scatter_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None: ...
