"""Shared fixtures: HF checkpoints of the supported architectures, oracles and runners built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny matmuls gain nothing from a second thread, and on a shared 2-core CI box its spin-waits
    cost more than they save (measured: a 256x256 linear took 12 us on 1 thread, 1.4 ms on 2)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _randomise(model, seed: int) -> None:
    """transformers initialises biases to zero and projections small: draw every weight visibly
    (biases too, or a qkv-bias bug would go unseen) so the oracle comparison has teeth."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(p.shape[1] ** -0.5 * torch.randn(p.shape, generator=gen))
            else:  # biases
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def _save_hf_model(config, out: Path, tiny_model_dir: Path, seed: int, **save_kwargs) -> Path:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    _randomise(model, seed)
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100352, eos_token_id=100265, bos_token_id=None,
             pad_token_id=100257)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A Qwen2-style checkpoint (qkv bias, tied embeddings), saved in shards with an index."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(**SMALL, tie_word_embeddings=True, max_position_embeddings=512, rope_theta=1000000.0)
    return _save_hf_model(cfg, tmp_path_factory.mktemp("qwen2") / "qwen2", tiny_model_dir, seed=1, max_shard_size="8MB")


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A Llama checkpoint with llama3 rope scaling and untied embeddings."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        **SMALL, tie_word_embeddings=False, max_position_embeddings=512, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )
    return _save_hf_model(cfg, tmp_path_factory.mktemp("llama3") / "llama3", tiny_model_dir, seed=2)


@pytest.fixture(scope="session")
def oracle_cache():
    """transformers models loaded once per checkpoint directory (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    cache: dict[Path, object] = {}

    def get(model_dir: Path):
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return cache[model_dir]

    return get


@pytest.fixture(scope="session")
def runner_cache():
    """ModelRunners built once per (checkpoint, options)."""
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    cache: dict[tuple, object] = {}

    def get(model_dir: Path, **options):
        key = (model_dir, tuple(sorted(options.items())))
        if key not in cache:
            options.setdefault("num_kv_blocks", 96)
            options.setdefault("block_size", 8)
            cache[key] = ModelRunner(EngineConfig(model_dir=model_dir, **options))
        return cache[key]

    return get
