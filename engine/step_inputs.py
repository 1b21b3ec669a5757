"""A packed step's per-token inputs built on the host: each new token's position and cache slot."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from engine.batch import SequenceChunk

# A chunk at least this long gets its slots block by block (one range per block) instead of token
# by token (~0.2 us per token on a 2-core Xeon). Plain Python, no tensor ops: right after a forward
# a dozen small torch ops cost ~150 us on that CPU (cold caches), more than the loop they replace.
BLOCKWISE_SLOTS_FROM_TOKENS = 32


def positions_and_slots(chunks: Sequence[SequenceChunk], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed batch's positions [T] and cache slots [T] (int64, on the host): a chunk's token at
    position ``p`` goes to slot ``block_table[p // block_size] * block_size + p % block_size``."""
    positions, slots = position_and_slot_arrays(chunks, block_size)
    return torch.frombuffer(positions, dtype=torch.int64), torch.frombuffer(slots, dtype=torch.int64)


def position_and_slot_arrays(chunks: Sequence[SequenceChunk], block_size: int) -> tuple[array, array]:
    """``positions_and_slots`` as two ``array("q")`` (no tensors: for a writer into a memoryview)."""
    positions = array("q")
    slots = array("q")
    for c in chunks:
        start, end, table = c.start_pos, c.context_len, c.block_table
        positions.extend(range(start, end))
        if c.num_tokens >= BLOCKWISE_SLOTS_FROM_TOKENS:
            slots.extend(_blockwise_slots(table, start, end, block_size))
            continue
        for p in range(start, end):
            slots.append(table[p // block_size] * block_size + p % block_size)
    return positions, slots


def _blockwise_slots(table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions ``start .. end-1`` (end > start): every slot of the blocks they span, in
    order, cut to the first position's offset and the count."""
    first = start // block_size
    every: list[int] = []
    for block in table[first : (end - 1) // block_size + 1]:
        base = block * block_size
        every.extend(range(base, base + block_size))
    offset = start - first * block_size
    return every[offset : offset + end - start]
