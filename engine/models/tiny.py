"""The tiny default model: a seeded random-weight Llama with a real cl100k_base tokenizer.

It lets everything (gateway, engine, benchmarks, tests) run offline with no model hub. The weights
are random, so the *text it generates is random*; the tokenizer and chat template are real, so
prompt lengths, prefix-cache hits and costs behave as with a real model.

Layout written to ``out_dir`` (a standard Hugging Face checkpoint directory)::

    config.json              LlamaForCausalLM, hidden 256, 4 layers, 8 heads / 2 kv heads
    generation_config.json   eos = <|im_end|>, <|endoftext|>
    model.safetensors        bf16 weights from torch.Generator(seed): embedding N(0, 0.02),
                             projections N(0, 1/fan_in), norms = 1
    tokenizer.json, tokenizer_config.json, chat_template.jinja
    prefixgate_tiny.json     what built it (seed, encoding, builder version)

Sized for a 2-core CPU: ~2.4M transformer parameters plus a 100352 x 256 tied embedding; one
decode step is dominated by the embedding-sized LM head matmul.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from engine.models.atomic_dir import atomic_directory
from engine.models.tokenizer_build import IM_END, build_tokenizer

BUILDER_VERSION = 1
ENCODING = "cl100k_base"
MARKER = "prefixgate_tiny.json"


class TinyDims(TypedDict):
    """config.json's shape fields: sizes are ints (they size tensors), the two constants floats."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float


TINY_DIMS: TinyDims = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 100352,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
INIT_STD = 0.02


def tiny_config_dict(eos_token_ids: list[int], pad_token_id: int) -> dict:
    """config.json of the tiny model, readable by transformers' LlamaConfig (4.x and 5.x)."""
    d = TINY_DIMS
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **d,
        # transformers 5 reads rope_parameters, 4.x reads rope_theta; both are given.
        "rope_parameters": {"rope_type": "default", "rope_theta": d["rope_theta"]},
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": eos_token_ids,
        "pad_token_id": pad_token_id,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
        # transformers 5.x warns about a "Mistral regex" on >100k-vocab local tokenizers whose
        # config.json predates 5.0 or lacks a version; our pattern is tiktoken's and is verified
        # by the round-trip tests, so we declare the format version we write.
        "transformers_version": "5.0.0",
    }


def tiny_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """HF-named bf16 weights drawn from one seeded generator, in a fixed order (deterministic)."""
    d = TINY_DIMS
    hidden, inter, head_dim = d["hidden_size"], d["intermediate_size"], d["head_dim"]
    q_out, kv_out = d["num_attention_heads"] * head_dim, d["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float | None = None) -> torch.Tensor:
        # Projections get std 1/sqrt(fan_in): each layer then moves the residual stream as much as
        # the embedding does, so greedy text varies instead of echoing the input token (which is
        # what a tied-embedding model with tiny layer weights does).
        std = shape[-1] ** -0.5 if std is None else std
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": normal(d["vocab_size"], hidden, std=INIT_STD)}
    for i in range(d["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(q_out, hidden)
        sd[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden)
        sd[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden)
        sd[p + "self_attn.o_proj.weight"] = normal(hidden, q_out)
        sd[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return sd


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    # convert_tokens_to_ids is annotated int | list[int] (a list in, a list out); one token gives one id
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int):
        raise ValueError(f"tokenizer has no single id for {token!r}: {tid!r}")
    return tid


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def is_tiny_checkpoint(path: Path, seed: int | None = None) -> bool:
    """True when ``path`` holds a complete checkpoint written by this builder version
    (and, when ``seed`` is given, built with that seed)."""
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if marker.get("builder_version") != BUILDER_VERSION or not (path / "model.safetensors").is_file():
        return False
    return seed is None or marker.get("seed") == seed


def build_tiny_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny model to ``out_dir`` (replacing what is there) and return its path.

    Deterministic for a seed. Atomic: everything is written into a sibling temp directory that is
    then renamed into place, so a reader never sees a half-written checkpoint. Needs tiktoken's
    cl100k_base file locally (``TIKTOKEN_CACHE_DIR``); touches no network otherwise.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    with atomic_directory(out_dir) as tmp:
        tokenizer = build_tokenizer(ENCODING, TINY_DIMS["vocab_size"])
        eos_ids = [_token_id(tokenizer, IM_END), _token_id(tokenizer, "<|endoftext|>")]
        pad_id = tokenizer.pad_token_id
        tokenizer.save_pretrained(tmp)
        # save_pretrained records its own backend class name (e.g. "TokenizersBackend" in
        # transformers 5), which older releases cannot resolve; the portable name loads
        # tokenizer.json verbatim everywhere.
        tok_cfg_path = tmp / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        _write_json(tok_cfg_path, tok_cfg)

        _write_json(tmp / "config.json", tiny_config_dict(eos_ids, pad_id))
        _write_json(
            tmp / "generation_config.json",
            {"eos_token_id": eos_ids, "pad_token_id": pad_id, "bos_token_id": None, "do_sample": False},
        )
        save_file(tiny_state_dict(seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / MARKER, {"builder_version": BUILDER_VERSION, "seed": seed, "encoding": ENCODING})

    return out_dir


def ensure_tiny_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Return ``out_dir``, building the tiny model there first if it is not already complete."""
    out_dir = Path(out_dir).expanduser().resolve()
    if is_tiny_checkpoint(out_dir, seed=seed):
        return out_dir
    return build_tiny_checkpoint(out_dir, seed=seed)
