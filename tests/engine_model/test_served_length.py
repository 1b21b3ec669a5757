"""/v1/models advertises only a context the KV pool can hold (issue: 8192 advertised, 5,824 held)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.launch import build_engine


def test_advertised_max_model_len_fits_the_pool(tiny_model_dir):
    engine = build_engine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=8, block_size=16))
    try:
        (card,) = engine.models()
        assert card.max_model_len == 8 * 16  # not the checkpoint's 8192 positions
    finally:
        engine.shutdown()
