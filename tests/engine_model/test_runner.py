"""ModelRunner surface: spec, cache sizing, prompts, quantized KV, rope variants, bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.batch import ScheduledBatch, SequenceChunk
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.rope import inverse_frequencies
from engine.models.spec import CheckpointError, parse_checkpoint_config
from tests.engine_model.conftest import SMALL, _save_hf_model
from tests.engine_model.driver import GREEDY, BlockAllocator, blocks_needed


def test_spec_and_cache_sizing(tiny_model_dir, runner_cache):
    runner = runner_cache(tiny_model_dir)
    s = runner.spec
    assert (s.model_type, s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (
        "llama", 4, 256, 8, 2, 32)
    assert s.vocab_size == 100352 and s.max_model_len == 8192 and s.dtype == "float32"
    assert s.eos_token_ids == (100265, 100257) and s.bos_token_id is None
    # 4 layers x (k, v) x 8 slots x 2 kv heads x 32 dims x 4 bytes
    assert runner.kv_bytes_per_block == 4 * 2 * 8 * 2 * 32 * 4
    assert runner.kv_cache.shape == (96, 4, 2, 8, 2, 32) and runner.num_kv_blocks == 96
    sized = ModelRunner(EngineConfig(model_dir=tiny_model_dir, cpu_kv_bytes=1 << 20, block_size=16))
    assert sized.num_kv_blocks == (1 << 20) // sized.kv_bytes_per_block == 32


def test_render_prompt_uses_chat_template(tiny_model_dir, runner_cache):
    runner = runner_cache(tiny_model_dir)
    msgs = [{"role": "user", "content": "Hi!"}]
    ids = runner.render_prompt(msgs, None)
    assert runner.tokenizer.decode(ids) == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with_tools = runner.render_prompt(msgs, tools)
    assert len(with_tools) > len(ids) and "lookup" in runner.tokenizer.decode(with_tools)
    with pytest.raises(ValueError, match='chat template.*needs a "text" string'):
        runner.render_prompt([{"role": "user", "content": [{"type": "text"}]}], None)
    with pytest.raises(ValueError, match='needs a "role"'):
        runner.render_prompt([{"content": "no role"}], None)
    parts = runner.render_prompt([{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}], None)
    assert parts == ids


@pytest.mark.parametrize(("kv_dtype", "atol"), [("int8", 0.05), ("fp8", 0.15)])
def test_quantized_kv_cache_tracks_full_precision(kv_dtype, atol, tiny_model_dir, runner_cache):
    full, quant = runner_cache(tiny_model_dir), runner_cache(tiny_model_dir, kv_dtype=kv_dtype)
    prompt = list(range(3000, 3030))
    alloc = BlockAllocator(full.num_kv_blocks, seed=9)
    table = alloc.take(blocks_needed(30, 8))
    batch = ScheduledBatch([SequenceChunk("q", prompt, 0, table, True, GREEDY)])
    ref, got = full.forward(batch, all_logits=True), quant.forward(batch, all_logits=True)
    err = (ref - got).abs().max().item()
    assert 0 < err < atol, err  # quantized (not bit-identical) yet close
    if kv_dtype == "int8":  # scales travel with the block bytes
        elems = 4 * 2 * 8 * 2 * 32
        assert quant.kv_bytes_per_block == elems + elems // 32 * 4
    data = quant.export_blocks(table[:2])
    dst = alloc.take(2)
    quant.import_blocks(dst, data)
    assert torch.equal(quant.export_blocks(dst), data)
    # the device-spill copy lays the scales out the same way: one block (the slice copy) and a run
    assert torch.equal(quant.gather_blocks_async([dst[1]]).cpu(), data[1:])
    assert torch.equal(quant.gather_blocks_async(dst).cpu(), data)
    with pytest.raises(ValueError, match="expected uint8"):
        quant.import_blocks(dst, data[:, :-1])


@pytest.mark.parametrize(
    ("rope_scaling", "seq_len"),
    [
        ({"rope_type": "linear", "factor": 4.0}, None),
        ({"rope_type": "dynamic", "factor": 2.0}, None),  # inside the window: plain rope
        ({"rope_type": "dynamic", "factor": 2.0}, 256),  # served past the window: NTK base
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}, None),
    ],
)
def test_rope_frequencies_match_transformers(rope_scaling, seq_len, tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=128, rope_theta=10000.0,
                      rope_scaling=rope_scaling)
    cfg.save_pretrained(tmp_path)
    arch = parse_checkpoint_config(tmp_path, max_model_len=seq_len)
    ours = inverse_frequencies(arch.rope, arch.head_dim, arch.max_model_len)
    theirs, scaling = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](cfg, "cpu", seq_len=seq_len)
    assert scaling == 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_mistral_and_linear_rope_logits_match(tmp_path, tiny_model_dir, oracle_cache):
    from transformers import LlamaConfig, MistralConfig

    configs = {
        "mistral": MistralConfig(**SMALL, sliding_window=None, max_position_embeddings=256),
        "linear": LlamaConfig(**SMALL, max_position_embeddings=256, attention_bias=True, mlp_bias=True,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    }
    prompt = list(range(500, 541))
    for i, (name, cfg) in enumerate(configs.items()):
        model_dir = _save_hf_model(cfg, tmp_path / name, tiny_model_dir, seed=10 + i)
        runner = ModelRunner(EngineConfig(model_dir=model_dir, num_kv_blocks=8, block_size=8))
        assert runner.spec.model_type == cfg.model_type
        ours = runner.forward(
            ScheduledBatch([SequenceChunk("m", prompt, 0, list(range(6)), True, GREEDY)]), all_logits=True
        )
        with torch.no_grad():
            ref = oracle_cache(model_dir)(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_bad_checkpoints_fail_with_the_reason(tiny_model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        parse_checkpoint_config(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt2'"):
        parse_checkpoint_config(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(CheckpointError, match="unsupported rope type 'yarn'"):
        parse_checkpoint_config(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="exceeds the model's 8192 positions"):
        parse_checkpoint_config(bad, max_model_len=10000)
    # weights missing a layer
    from safetensors.torch import load_file, save_file

    sd = load_file(bad / "model.safetensors")
    del sd["model.layers.3.mlp.up_proj.weight"]
    save_file(sd, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks model\.layers\.3\.mlp\.up_proj\.weight"):
        ModelRunner(EngineConfig(model_dir=bad, num_kv_blocks=4))


def test_execute_rejects_inconsistent_chunks(tiny_model_dir, runner_cache):
    runner = runner_cache(tiny_model_dir)
    with pytest.raises(ValueError, match="block_table has 1 blocks, needs 2"):
        runner.execute(ScheduledBatch([SequenceChunk("x", list(range(9)), 0, [0], True, GREEDY)]))
    with pytest.raises(IndexError, match="block ids must be in"):
        runner.export_blocks([runner.num_kv_blocks])
    assert runner.execute(ScheduledBatch([])).sampled_token_ids == []
