"""Random-weight Llama-family models built straight on the device (benchmarks and GPU tests).

Writing a 16 GB safetensors file to benchmark an 8B-shaped model wastes minutes and disk; this
builds the same module tree (transformers parameter names, see engine/models/llama.py) on the
meta device and fills it on the target device from a seeded generator. ``llama_config_dict``
writes the matching config.json dict, readable both by ``parse_checkpoint_config`` and by
transformers' ``LlamaConfig``, so our model and the transformers oracle share one spec (and, with
``load_state_dict(assign=True)``, the very same weight tensors).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import ArchConfig

# Llama-3.1-8B's shape (config.json of meta-llama/Llama-3.1-8B, the numbers only).
LLAMA31_8B_SHAPE: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def llama_config_dict(**shape: Any) -> dict[str, Any]:
    """A LlamaForCausalLM config.json dict for the given shape fields (untied embeddings, no bias).

    Both the 4.x (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``) rope spellings
    are written, so either transformers reads the same rope."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "rope_scaling": None,
        "torch_dtype": "bfloat16",
    }
    cfg.update(shape)
    rope = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
    rope["rope_theta"] = cfg["rope_theta"]
    cfg["rope_parameters"] = rope
    return cfg


@torch.no_grad()
def build_random_model(
    arch: ArchConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0, std: float = 0.02
) -> LlamaForCausalLM:
    """Our model with N(0, std) linear/embedding weights and unit norms, built on ``device``.

    Drawn on the device from one seeded generator in parameter order: the same (arch, seed,
    device type) gives the same weights."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    # cast on the meta device, then allocate: allocated first, an 8B model took its fp32 size (32 GB) on the
    # device before the cast (48 GB at the peak), and two engine processes sharing an 80 GB card ran out of
    # memory building (benchmarks/gpu_pd.sh, session 38)
    model.to(dtype)
    model.to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
    model.init_rotary(device)
    model.eval().requires_grad_(False)
    return model
