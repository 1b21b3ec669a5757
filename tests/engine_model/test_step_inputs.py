"""The runner's host-side step inputs: vectorised positions / slot mapping and int host tensors
must equal the per-token reference exactly (a wrong slot writes K/V into another sequence's block)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.batch import SequenceChunk
from engine.host_to_device import host_tensor, to_device
from engine.protocol import SamplingParams
from engine.step_inputs import BLOCKWISE_SLOTS_FROM_TOKENS, positions_and_slots


def reference(chunks: list[SequenceChunk], bs: int) -> tuple[list[int], list[int]]:
    """The loop _prepare ran for every token before it was vectorised."""
    positions, slots = [], []
    for c in chunks:
        for p in range(c.start_pos, c.start_pos + c.num_tokens):
            positions.append(p)
            slots.append(c.block_table[p // bs] * bs + p % bs)
    return positions, slots


def random_chunk(rng: random.Random, bs: int, i: int) -> SequenceChunk:
    n = rng.choice([1, 2, BLOCKWISE_SLOTS_FROM_TOKENS - 1, BLOCKWISE_SLOTS_FROM_TOKENS, rng.randrange(1, 700)])
    start = rng.choice([0, rng.randrange(0, 3000), rng.randrange(0, 200) * bs])
    blocks = -(-(start + n) // bs) + rng.randrange(0, 3)  # a table may hold more blocks than needed
    table = rng.sample(range(20_000), blocks)
    return SequenceChunk(f"r{i}", [7] * n, start, table, True, SamplingParams())


@pytest.mark.parametrize("bs", [8, 16, 128])
def test_positions_and_slots_equal_the_per_token_loop(bs):
    rng = random.Random(bs)
    for trial in range(60):
        chunks = [random_chunk(rng, bs, i) for i in range(rng.randrange(1, 6))]
        positions, slots = positions_and_slots(chunks, bs)
        want_pos, want_slots = reference(chunks, bs)
        assert positions.dtype == slots.dtype == torch.int64
        assert positions.tolist() == want_pos, trial
        assert slots.tolist() == want_slots, trial


def test_the_prefix_hits_chunk_one_long_chunk_after_7680_cached_tokens():
    rng = random.Random(1)
    table = rng.sample(range(6144), 513)
    chunk = SequenceChunk("hit", [1] * 512, 7680, table, True, SamplingParams())
    positions, slots = positions_and_slots([chunk], 16)
    assert (positions.tolist(), slots.tolist()) == reference([chunk], 16)


@pytest.mark.parametrize("values,dtype", [
    ([3, 1, 2], torch.int64), ((5, 6), torch.int32), ([], torch.int64), ([True, 0], torch.int64),
    ([0.5, -1.25], torch.float32), ([1, 2], torch.float32), ([2**63 - 1, -(2**63)], torch.int64),
])
def test_host_tensor_equals_torch_tensor(values, dtype):
    got = host_tensor(values, dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(to_device(values, dtype, torch.device("cpu")), want)


def test_host_tensor_refuses_what_torch_refuses():
    with pytest.raises(RuntimeError):
        torch.tensor([2**40], dtype=torch.int32)
    with pytest.raises(RuntimeError):
        host_tensor([2**40], torch.int32)
