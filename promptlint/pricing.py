"""Money: what the cacheable prefix saves per month, and what the rest leaves on the table.

For each file, at ``volume`` requests per day over 30 days, with litellm's bundled prices:

    cached(n)  = tokens a provider actually serves from cache for an n-token stable prefix
                 (0 below its minimum; OpenAI counts in 128-token steps past 1,024)
    saved      = volume * 30 * cached(prefix_tokens) * (input price - cache-read price)
    left       = volume * 30 * (cached(static_tokens) - cached(prefix_tokens)) * (same difference)

``left`` is what hoisting every static token ahead of the first dynamic value would add. Cache
*write* premiums (Anthropic 1.25x) are not counted: a stable prefix is written once per TTL.
Prices come from litellm's bundled cost map (what ``litellm.model_cost`` holds under
``LITELLM_LOCAL_MODEL_COST_MAP=True``), read straight from the installed package's JSON file: importing
litellm takes 5-15 s, too slow for a linter in CI. If that file is missing (a litellm that moved it),
we fall back to importing litellm.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from promptlint.errors import UsageError
from promptlint.linter import Report
from promptlint.tokens import cache_minimum

DAYS_PER_MONTH = 30


@dataclass(frozen=True)
class Savings:
    model: str
    volume_per_day: float
    input_price: float  # USD per token
    cache_read_price: float
    saved_per_month: float
    left_per_month: float
    per_file: dict[str, tuple[float, float]]  # path -> (saved, left)


def cached_tokens(prefix: int, model: str) -> int:
    provider, minimum = cache_minimum(model)
    if prefix < minimum:
        return 0
    if provider == "openai":
        return minimum + (prefix - minimum) // 128 * 128
    return prefix


COST_MAP_FILE = "model_prices_and_context_window_backup.json"


@lru_cache(maxsize=1)
def cost_map() -> dict:
    """litellm's bundled model cost map, without importing litellm (no network either way)."""
    spec = importlib.util.find_spec("litellm")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / COST_MAP_FILE
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError:
        raise UsageError("--volume needs litellm's price map: pip install 'prefixgate[gateway]' (or litellm)") from None
    return litellm.model_cost


def prices(model: str) -> tuple[float, float]:
    """(input, cache-read) USD per token from litellm's bundled cost map (no network)."""
    info = cost_map().get(model)
    if info is None:
        raise UsageError(f"no price for model {model!r} in litellm's cost map; pass --model with a known name")
    p_in = info.get("input_cost_per_token")
    if not p_in:
        raise UsageError(f"litellm has no input price for model {model!r}")
    p_read = info.get("cache_read_input_token_cost")
    return float(p_in), float(p_read if p_read is not None else p_in)


def estimate(report: Report, volume: float) -> Savings:
    p_in, p_read = prices(report.model)
    per_token_month = volume * DAYS_PER_MONTH * (p_in - p_read)
    per_file = {}
    for r in report.files:
        if r.doc is None:
            continue
        now = cached_tokens(r.doc.prefix_tokens, report.model)
        ideal = cached_tokens(r.doc.static_tokens, report.model)
        per_file[r.path] = (now * per_token_month, max(0, ideal - now) * per_token_month)
    saved, left = sum(s for s, _ in per_file.values()), sum(x for _, x in per_file.values())
    if not (math.isfinite(saved) and math.isfinite(left)):  # a finite --volume near 1e308 still overflows
        raise UsageError(f"--volume {volume:g} is too large: the monthly estimate overflows")
    return Savings(report.model, volume, p_in, p_read, saved, left, per_file)
