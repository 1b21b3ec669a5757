"""The tiny default model: loads offline in transformers, tokenizer round-trips, deterministic, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import tiktoken
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.models.tiny import TINY_DIMS, is_tiny_checkpoint, tiny_state_dict
from engine.models.tokenizer_build import CHAT_SPECIAL_IDS, onig_compatible_pattern

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文字符，한국어 문장 😀🚀 émigré naïve café Straße",
    "    leading spaces\n\n\n\ttabs\t\tand   runs     of spaces   \r\n\r\nwindows newlines \n",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "I'm sure you're right, they've said we'll go; it'd be SHE'S or He'LL.",
    "Numbers: 1234567890123 3.14159 -42 0x1F 1e-10 2024-11-29T20:25:14Z",
    '{"key": [1, 2, {"nested": null}], "emoji": "\\u00e9"}  <tag attr="v">&amp;</tag>',
    "Math: ∑_{i=1}^{n} x_i² ≤ ∫ f(x) dx; arrows → ⇒ ↔",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "trailing whitespace   ",
    "   ",
    "",
]


@pytest.fixture(scope="module")
def reference_encoding():
    base = tiktoken.get_encoding("cl100k_base")
    return tiktoken.Encoding(
        name="cl100k_chat",
        pat_str=base._pat_str,
        mergeable_ranks=base._mergeable_ranks,
        special_tokens={**base._special_tokens, **CHAT_SPECIAL_IDS},
    )


def test_saved_tokenizer_round_trips_to_tiktoken_ids(tiny_model_dir, reference_encoding):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in CORPUS:
        expected = reference_encoding.encode(text, allowed_special="all")
        got = tok.encode(text, add_special_tokens=False)
        assert got == expected, f"tokenization differs for {text!r}"
        assert tok.decode(got) == text
    # A long mixed document (the reported re-save bug showed on longer prompts).
    doc = "\n".join(CORPUS * 20)
    assert tok.encode(doc, add_special_tokens=False) == reference_encoding.encode(doc, allowed_special="all")


def test_tokenizer_ids_and_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == TINY_DIMS["vocab_size"]
    assert tok.convert_tokens_to_ids("<|im_start|>") == 100264
    assert tok.eos_token_id == 100265 and tok.pad_token_id == 100257 and tok.bos_token_id is None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" \
        "<|im_start|>assistant\n"
    with_tools = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in with_tools and with_tools.startswith("<|im_start|>system\nBe brief.")
    assert with_tools.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    # assistant tool calls, tool results and content parts render too
    convo = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42"},
    ]
    text = tok.apply_chat_template(convo, add_generation_prompt=False, tokenize=False)
    assert "<|im_start|>user\nab<|im_end|>" in text
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>tool\n42<|im_end|>\n")


def test_checkpoint_loads_offline_in_transformers(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (256, 4, 2)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out = model(torch.tensor([[100264, 882, 198]])).logits
    assert out.shape == (1, 3, TINY_DIMS["vocab_size"]) and torch.isfinite(out).all()


def test_weights_deterministic_per_seed():
    a, b, c = tiny_state_dict(3), tiny_state_dict(3), tiny_state_dict(4)
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_onig_pattern_rewrite():
    assert onig_compatible_pattern(r"\p{N}{1,3}+|\s++$") == r"\p{N}{1,3}|\s++$"


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cli(*args, env):
    env = {**env, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_init_tiny_builds_deterministically_and_reuses(tiny_model_dir, tmp_path):
    env = {**os.environ, "PREFIXGATE_HOME": str(tmp_path / "home")}
    first = _cli("model", "init-tiny", "--json", env=env)
    assert first.returncode == 0, first.stderr
    info = json.loads(first.stdout)
    out = tmp_path / "home" / "models" / "tiny"
    assert info == {"path": str(out.resolve()), "built": True, "seed": 0}
    assert is_tiny_checkpoint(out, seed=0)
    # Same seed -> byte-identical files to the fixture's independent build.
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha(out / name) == _sha(tiny_model_dir / name), name
    assert not list(out.parent.glob(".tiny.tmp-*")), "temp dir left behind"
    again = _cli("model", "init-tiny", "--json", env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["built"] is False
    # --home before or after the subcommand beats $PREFIXGATE_HOME
    env_elsewhere = {**os.environ, "PREFIXGATE_HOME": str(tmp_path / "elsewhere")}
    plain = _cli("--home", str(tmp_path / "home"), "model", "init-tiny", env=env_elsewhere)
    assert plain.returncode == 0 and plain.stdout.strip() == str(out.resolve())


def test_cli_init_tiny_refuses_foreign_directory(tmp_path):
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    res = _cli("model", "init-tiny", "--out", str(foreign), env={**os.environ, "PREFIXGATE_HOME": str(tmp_path)})
    assert res.returncode == 2
    assert res.stderr.startswith("prefixgate: error:") and "not a tiny checkpoint" in res.stderr
    assert (foreign / "precious.txt").read_text() == "keep me"
    shutil.rmtree(foreign)


def test_cli_init_tiny_without_the_tiktoken_file_says_what_to_do(tmp_path):
    env = {**os.environ, "PREFIXGATE_HOME": str(tmp_path), "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty")}
    res = _cli("model", "init-tiny", env=env)
    assert res.returncode == 2
    assert "cl100k_base file is not in" in res.stderr and "TIKTOKEN_CACHE_DIR" in res.stderr
    assert not (tmp_path / "models" / "tiny").exists()
