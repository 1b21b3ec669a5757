"""Workload benchmark tests: offline environment, set before anything imports litellm or tiktoken."""

import os
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
try:
    import importlib.util

    _spec = importlib.util.find_spec("litellm")
    if _spec and _spec.origin:
        os.environ.setdefault(
            "TIKTOKEN_CACHE_DIR", str(Path(_spec.origin).parent / "litellm_core_utils" / "tokenizers")
        )
except ImportError:  # pragma: no cover
    pass
