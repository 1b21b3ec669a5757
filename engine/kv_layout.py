"""How a KV block's bytes are laid out in device memory, and the one layout blocks travel in.

Every kernel and torch op sees a layer's keys and values as ``[num_blocks, block_size, kv_heads,
head_dim]`` strided views and takes their strides as given, so the order of a block's bytes is a
choice of the pool, made once here:

    TOKEN  [block, layer, k|v, slot, kv head, dim]  a token's heads adjacent (a whole token row is
                                                   one run of bytes)
    HEAD   [block, layer, k|v, kv head, slot, dim]  a page head by head: one (sequence, KV head)
                                                   program reads slots x dim contiguous bytes a page

Why HEAD on a GPU (docs/gpu.md, session 34): the decode launch runs one program a (sequence, KV
head). In TOKEN pages such a program reads ``head_dim``-byte pieces ``kv_heads x head_dim`` apart;
where those pieces are small (fp8 at head dim 64: 64 bytes, half an L2 line) the launch streamed at
75 % of copy past its fixed cost on an H100, against 94 % for the same launch on HEAD pages (the
9 / 3 class's fp8 decode 62.7 -> 55.0 us at 64 x 4K, 197.7 -> 161.9 us at 256 x 4K). The CPU keeps
TOKEN: its native attention kernel reads whole token rows.

A block is one contiguous run of bytes in either layout, so copies between blocks move raw bytes.
Blocks leave the pool (tiers, prefill/decode transfer, other nodes) in TOKEN order whatever the
pool's layout: the runner gathers and scatters them through ``token_view``, and the block copy ops
transpose a HEAD pool's tiles on the way in one pass. A block exported by a GPU node imports into a
CPU node's pool, and the reverse.
"""

from __future__ import annotations

import enum

import torch

# the dims of one block's [layer, k|v, a, b, dim] that the two layouts swap (slot and kv head)
_SLOT_DIM, _HEAD_DIM = 2, 3


class KVPageLayout(enum.StrEnum):
    TOKEN = "token"
    HEAD = "head"

    @classmethod
    def for_device(cls, device: torch.device) -> KVPageLayout:
        """The default: HEAD on a GPU (its decode launches read per KV head), TOKEN on the CPU."""
        return cls.HEAD if device.type == "cuda" else cls.TOKEN

    def block_shape(self, num_layers: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One block's shape in memory (the pool is ``[num_blocks, *block_shape]``, contiguous)."""
        if self is KVPageLayout.HEAD:
            return (num_layers, 2, kv_heads, block_size, head_dim)
        return (num_layers, 2, block_size, kv_heads, head_dim)

    def token_view(self, blocks: torch.Tensor) -> torch.Tensor:
        """``blocks`` [N, *block_shape] (this layout) as [N, layers, 2, block_size, kv_heads, head_dim]: a
        view, no copy. The pool's logical form, which the kernels and ops index."""
        if self is KVPageLayout.HEAD:
            return blocks.transpose(1 + _SLOT_DIM, 1 + _HEAD_DIM)
        return blocks
