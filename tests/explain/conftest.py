"""Offline environment for the explain tests (litellm prices, tiktoken encodings from the venv)."""

import os

from promptlint.tokens import ensure_tiktoken_cache

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ensure_tiktoken_cache()
