"""RotaryEmbedding's cos/sin table (engine/models/rope.py): a gathered row is exactly the row computed
for that position alone, for every rope variant, and the table covers a graph's block-rounded capacity."""

from __future__ import annotations

import pytest
import torch

from engine.models.rope import RotaryEmbedding
from engine.models.spec import RopeConfig

VARIANTS = [
    RopeConfig("default", 10000.0, 2048),
    RopeConfig("linear", 10000.0, 2048, {"factor": 4.0}),
    RopeConfig("dynamic", 10000.0, 512, {"factor": 2.0}),
    RopeConfig("llama3", 500000.0, 8192, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
]


@pytest.mark.parametrize("rope", VARIANTS, ids=lambda r: r.rope_type)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gathered_rows_equal_computed_ones(rope, head_dim):
    emb = RotaryEmbedding(rope, head_dim, 1000, "cpu")
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.cat([torch.tensor([0, 1, 999]), torch.randint(0, 1000, (37,), generator=gen)])
    cos, sin = emb.cos_sin(positions)
    want_cos, want_sin = emb.compute(positions)
    assert cos.shape == sin.shape == (len(positions), 1, head_dim)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    one_cos, _ = emb.compute(positions[5:6])  # a position computed on its own, as a decode step of one
    assert torch.equal(cos[5:6], one_cos)


def test_table_covers_whole_blocks_past_max_model_len():
    emb = RotaryEmbedding(VARIANTS[0], 64, 1000, "cpu")
    assert emb.table.shape == (1024, 2, 64)  # 1000 rounded up to whole blocks of the largest size (128)
    cos, _ = emb.cos_sin(torch.tensor([1023]))
    assert torch.equal(cos, emb.compute(torch.tensor([1023]))[0])
