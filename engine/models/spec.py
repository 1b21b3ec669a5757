"""What the engine needs to know about a checkpoint, parsed once from its config.json.

``ModelSpec`` is the small public summary (the runner exposes it; the engine sizes prompts and
stops on EOS with it). ``ArchConfig`` carries the architecture details only the model code needs.
Both are frozen; ``parse_checkpoint_config`` is the one place that reads HF config dialects
(transformers 4.x ``rope_theta`` + ``rope_scaling``, 5.x ``rope_parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str


@dataclass(frozen=True)
class RopeConfig:
    """RoPE variant and its parameters (``params`` holds factor, low/high_freq_factor, ...)."""

    rope_type: str
    theta: float
    max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_model_len: int


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served (missing files, unsupported architecture)."""


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported")
    needed = {"linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in params]
    if missing:
        raise CheckpointError(f"rope type {rope_type!r} needs {', '.join(missing)} in config.json")
    return RopeConfig(rope_type, float(theta), int(cfg["max_position_embeddings"]), params)


def parse_checkpoint_config(model_dir: Path, max_model_len: int | None = None) -> ArchConfig:
    """Read ``model_dir/config.json`` into an ``ArchConfig``. Raises CheckpointError with the reason."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir} is not a checkpoint directory: no config.json") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r} in {path}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rope = _rope_config(cfg)
        limit = rope.max_position_embeddings
        # Sliding-window attention is not implemented: serve only the window, where it equals full
        # attention (Mistral v0.1 has a 4096 window; later Mistral and Qwen2 configs disable it).
        window = cfg.get("sliding_window")
        if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
            limit = min(limit, int(window))
        arch = ArchConfig(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_model_len=limit,
        )
    except KeyError as exc:
        raise CheckpointError(f"{path} lacks required field {exc.args[0]!r}") from None
    if heads % kv_heads:
        raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    if max_model_len is not None:
        if max_model_len < 1:
            raise CheckpointError(f"max_model_len must be >= 1, got {max_model_len}")
        # Beyond the trained window only dynamic NTK rope is defined to extrapolate.
        if max_model_len > arch.max_model_len and arch.rope.rope_type != "dynamic":
            raise CheckpointError(
                f"max_model_len {max_model_len} exceeds the model's {arch.max_model_len} positions"
            )
        arch = replace(arch, max_model_len=max_model_len)
    return arch


def read_special_ids(model_dir: Path) -> tuple[tuple[int, ...], int | None]:
    """EOS ids (generation_config.json and config.json, merged, in order) and the BOS id."""
    eos: list[int] = []
    bos = None
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        cfg = json.loads(path.read_text(encoding="utf-8"))
        value = cfg.get("eos_token_id")
        for idx in value if isinstance(value, list) else [value]:
            if isinstance(idx, int) and idx not in eos:
                eos.append(idx)
        if bos is None and isinstance(cfg.get("bos_token_id"), int):
            bos = cfg["bos_token_id"]
    return tuple(eos), bos
