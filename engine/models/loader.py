"""Load a Hugging Face safetensors checkpoint (single file or sharded with an index) into our model.

Names are the transformers names (our modules mirror them). Tied checkpoints omit
``lm_head.weight``; rotary buffers some exporters keep (``rotary_emb.inv_freq``) are skipped.
Every parameter must be filled exactly once; anything missing is an error that names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import ArchConfig, CheckpointError

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or every *.safetensors file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{model_dir}: shards listed in the index are missing: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def build_model(arch: ArchConfig, model_dir: Path, device: torch.device | str, dtype: torch.dtype) -> LlamaForCausalLM:
    """Construct without initialising (meta device), then load every weight straight to ``device``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model.to_empty(device=device)
    model.to(dtype)
    model.tie_weights()
    load_weights(model, model_dir)
    model.init_rotary(device)
    model.eval().requires_grad_(False)
    return model


def load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.arch.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    filled: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.arch.tie_word_embeddings:
                    continue  # some tied checkpoints still store a copy
                if name not in params:
                    raise CheckpointError(f"{path.name}: unexpected tensor {name!r} for {model.arch.model_type}")
                tensor = f.get_tensor(name)
                target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise CheckpointError(
                        f"{path.name}: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor)
                filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir}: checkpoint lacks {shown}")
