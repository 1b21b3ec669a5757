"""A small random-weight model and runner, built in memory (no checkpoint, no tokenizer files)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.random_init import build_random_model, llama_config_dict
from engine.models.spec import parse_checkpoint_config
from engine.protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "max_position_embeddings": 256}


class IdTokenizer:
    """Space-separated ids in, ids out; any other word (the runner's fp8 calibration text) maps to a
    fixed id inside the test vocabulary, as a real tokenizer maps text to ids."""

    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        vocab = SHAPE["vocab_size"]
        return [int(t) % vocab if t.isdigit() else zlib.crc32(t.encode()) % vocab for t in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)

    def get_vocab(self):
        """Token text -> id, as the runner reads a vocabulary (its prompt bound: the longest entry)."""
        return {str(i): i for i in range(SHAPE["vocab_size"])}


def small_arch(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(llama_config_dict(**SHAPE)), encoding="utf-8")
    return parse_checkpoint_config(tmp_path)


def small_runner(tmp_path: Path, device: str, **config) -> ModelRunner:
    arch = small_arch(tmp_path)
    model = build_random_model(arch, device, torch.float32, seed=0, std=0.05)
    cfg = EngineConfig(model_dir=tmp_path, device=device, dtype="float32", num_kv_blocks=64, block_size=16,
                       max_num_seqs=8, **config)
    return ModelRunner(cfg, arch=arch, tokenizer=IdTokenizer(), model=model)


def prefill_then_decode_batch(runner: ModelRunner) -> ScheduledBatch:
    """Prefill three sequences (5, 20, 40 tokens) and return their next decode step's batch."""
    lens, tables = (5, 20, 40), ([3], [7, 8], [10, 11, 12, 13])
    prompts = [[(7 * i + 3 * s) % 500 for i in range(n)] for s, n in enumerate(lens)]
    runner.execute(ScheduledBatch([SequenceChunk(f"s{i}", p, 0, tables[i], True, GREEDY)
                                   for i, p in enumerate(prompts)]))
    return ScheduledBatch([SequenceChunk(f"s{i}", [11 + i], len(p), tables[i], True, GREEDY)
                           for i, p in enumerate(prompts)])
