"""KV-cache sizing arithmetic (no torch: unit-tested on CPU, used by the model runner on CUDA).

The HBM block pool is sized once, after the weights are on the device::

    budget = free_bytes * kv_memory_fraction - headroom   (headroom: activations, logits, graphs)
    blocks = budget // bytes_per_block
"""

from __future__ import annotations


def kv_budget_from_free(free_bytes: int, fraction: float, headroom_bytes: int) -> int:
    """Bytes for the KV cache out of ``free_bytes`` of device memory (may be <= 0 when it does not fit)."""
    if free_bytes < 0 or headroom_bytes < 0:
        raise ValueError("free_bytes and headroom_bytes must be >= 0")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return int(free_bytes * fraction) - headroom_bytes


def kv_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit ``budget_bytes``; ValueError (saying what to change) below 2 blocks."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    blocks = max(0, budget_bytes) // bytes_per_block
    if blocks < 2:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds {blocks} blocks of {bytes_per_block} bytes; "
            "raise cpu_kv_bytes / kv_memory_fraction or set num_kv_blocks"
        )
    return int(blocks)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int,
                       scale_bytes_per_head: int = 0) -> int:
    """KV bytes one token occupies across all layers (K and V; int8 adds a float32 scale per head)."""
    return num_layers * 2 * num_kv_heads * (head_dim * itemsize + scale_bytes_per_head)


def max_resident_sequences(num_blocks: int, block_size: int, seq_tokens: int) -> int:
    """How many sequences of ``seq_tokens`` tokens (no shared prefix) fit in ``num_blocks`` blocks."""
    if seq_tokens < 1 or block_size < 1:
        raise ValueError("seq_tokens and block_size must be >= 1")
    return num_blocks // -(-seq_tokens // block_size)
