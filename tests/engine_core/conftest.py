"""Offline environment for the engine-core tests (nothing may touch the network)."""

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "TIKTOKEN_CACHE_DIR" not in os.environ:
    # litellm bundles the tiktoken files; find them without importing litellm (slow, and it
    # reaches for the network at import time)
    spec = importlib.util.find_spec("litellm")
    if spec is not None and spec.origin:
        os.environ["TIKTOKEN_CACHE_DIR"] = str(Path(spec.origin).parent / "litellm_core_utils" / "tokenizers")
