"""Shared fixtures: offline environment and the tiny checkpoint built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not os.environ.get("TIKTOKEN_CACHE_DIR"):
        import importlib.util

        spec = importlib.util.find_spec("litellm")
        assert spec and spec.submodule_search_locations, "litellm (bundled tiktoken files) is required"
        root = Path(next(iter(spec.submodule_search_locations)))
        os.environ["TIKTOKEN_CACHE_DIR"] = str(root / "litellm_core_utils" / "tokenizers")


_offline_env()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny default model (seed 0), built once for the whole session."""
    from engine.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)
