"""Token counting with the target model's tiktoken encoding, offline.

tiktoken downloads its encodings on first use unless ``TIKTOKEN_CACHE_DIR`` holds them; litellm ships
them. We locate litellm's copy with ``importlib.util.find_spec`` (which does not run litellm's slow
``__init__``) and set the variable only if the user has not.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from promptlint.errors import UsageError

if TYPE_CHECKING:  # tiktoken loads on the first count
    from tiktoken import Encoding

DEFAULT_MODEL = "gpt-4o"

# Prefixes of OpenAI models on o200k_base; older OpenAI models use cl100k_base. For other vendors
# (Claude, Llama, ...) tiktoken has no exact encoding: cl100k_base is a close-enough proxy for counts.
_O200K_PREFIXES = ("gpt-4o", "gpt-4.1", "gpt-4.5", "gpt-5", "o1", "o3", "o4", "chatgpt-4o", "gpt-oss")


def ensure_tiktoken_cache() -> None:
    """Point ``TIKTOKEN_CACHE_DIR`` at litellm's bundled encodings if the user has not set it."""
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return
    bundled = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
    if bundled.is_dir():
        os.environ["TIKTOKEN_CACHE_DIR"] = str(bundled)


def encoding_name(model: str) -> str:
    """The tiktoken encoding used to count tokens for ``model`` (provider prefixes are ignored)."""
    name = model.lower().rsplit("/", 1)[-1]
    if name.startswith(_O200K_PREFIXES):
        return "o200k_base"
    return "cl100k_base"


@lru_cache(maxsize=4)
def _encoding(name: str) -> Encoding:
    ensure_tiktoken_cache()
    import tiktoken  # deferred: `promptlint rule` and `rules` never need it

    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # tiktoken raises bare network/IO errors when the cache misses
        raise UsageError(
            f"cannot load tiktoken encoding {name!r} offline ({exc.__class__.__name__}); "
            "set TIKTOKEN_CACHE_DIR to a directory holding it (litellm bundles one)"
        ) from None


class TokenCounter:
    """Counts tokens of text for one model. Special-token text counts as ordinary text."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.encoding = encoding_name(model)
        self._enc = _encoding(self.encoding)

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(self._enc.encode_ordinary(text))


def cache_minimum(model: str) -> tuple[str, int]:
    """(provider, minimum cacheable prefix in tokens) for ``model``.

    OpenAI caches prompts of 1,024 tokens or more. Anthropic's minimum depends on the model: 2,048
    for the Haiku 3 / 3.5 models, 4,096 for Claude Opus 4.5 and Haiku 4.5, 1,024 for the others.
    Anything else is assumed to follow OpenAI's rule (vLLM/SGLang cache any full block, so they do
    better; the OpenAI figure is the conservative one).
    """
    name = model.lower()
    if "claude" in name:
        if "haiku-4-5" in name or "haiku-4.5" in name or "opus-4-5" in name or "opus-4.5" in name:
            return "anthropic", 4096
        if "haiku" in name and ("3-5" in name or "3.5" in name or "claude-3-haiku" in name):
            return "anthropic", 2048
        return "anthropic", 1024
    return "openai", 1024
