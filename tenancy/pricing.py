"""Request prices from litellm's bundled cost map (offline).

The map is the JSON file that ships inside the litellm package
(``model_prices_and_context_window_backup.json``). It is read directly rather than through
``import litellm``: importing litellm takes ~6 s and pulls in network-capable clients, while the file
is the same data litellm itself falls back to with ``LITELLM_LOCAL_MODEL_COST_MAP=True``.

A model missing from the map (a local checkpoint, ``tiny``) is priced as a reference model
(default ``gpt-4o-mini``), so "saved" still answers: what would these cached tokens have cost at a
typical hosted price? A route priced ``UNPRICED`` (a self-hosted engine that costs nothing per
token) gets cost and saving 0 and ``priced_as = "unpriced"``: reports show its tokens, no money.

::

    cost  = (prompt - cached) * input + cached * cache_read + completion * output
    saved = cached * (input - cache_read)        # what caching saved against no caching
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenancy.types import Price

DEFAULT_REFERENCE_MODEL = "gpt-4o-mini"
UNPRICED = "unpriced"
REFERENCE_MODEL_ENV = "PREFIXGATE_REFERENCE_MODEL"
_COST_MAP_FILE = "model_prices_and_context_window_backup.json"


@dataclass(frozen=True)
class ModelRates:
    """USD per token."""

    input: float
    cache_read: float
    output: float


@functools.cache
def bundled_cost_map() -> dict[str, Any]:
    spec = importlib.util.find_spec("litellm")  # locates the package without executing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / _COST_MAP_FILE
        if path.is_file():
            with path.open(encoding="utf-8") as fh:
                return json.load(fh)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the map over the network
    import litellm  # the slow path, only if the file moved in a future litellm

    return dict(litellm.model_cost)


def _rates(entry: dict[str, Any]) -> ModelRates | None:
    inp = entry.get("input_cost_per_token")
    out = entry.get("output_cost_per_token")
    if not isinstance(inp, int | float) or not isinstance(out, int | float):
        return None
    cache = entry.get("cache_read_input_token_cost")
    # No published cache-read price: cached tokens are billed as input, and caching saves nothing.
    cache_read = float(cache) if isinstance(cache, int | float) else float(inp)
    return ModelRates(float(inp), cache_read, float(out))


class PriceBook:
    """Looks up rates by model name; unknown models fall back to the reference model."""

    def __init__(self, reference_model: str | None = None, cost_map: dict[str, Any] | None = None) -> None:
        self._map = cost_map if cost_map is not None else bundled_cost_map()
        self.reference_model = reference_model or os.environ.get(REFERENCE_MODEL_ENV) or DEFAULT_REFERENCE_MODEL
        ref = self._lookup(self.reference_model)
        if ref is None:
            raise ValueError(
                f"reference model {self.reference_model!r} has no per-token prices in litellm's cost map"
            )
        self._reference = ref

    def _lookup(self, model: str) -> tuple[str, ModelRates] | None:
        candidates = [model]
        if "/" in model:  # "openai/gpt-4o" -> also try "gpt-4o"
            candidates.append(model.split("/", 1)[1])
        for name in candidates:
            entry = self._map.get(name)
            if isinstance(entry, dict) and (rates := _rates(entry)) is not None:
                return name, rates
        return None

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - one PriceBook per service; bounded
    def rates_for(self, model: str) -> tuple[str, ModelRates]:
        """(priced_as, rates)."""
        return self._lookup(model) or self._reference

    def price(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Price:
        if min(prompt_tokens, cached_tokens, completion_tokens) < 0:
            raise ValueError("token counts must be >= 0")
        if cached_tokens > prompt_tokens:
            raise ValueError(f"cached_tokens ({cached_tokens}) > prompt_tokens ({prompt_tokens})")
        if model == UNPRICED:
            return Price(cost_usd=0.0, saved_usd=0.0, priced_as=UNPRICED)
        priced_as, r = self.rates_for(model)
        uncached = prompt_tokens - cached_tokens
        cost = uncached * r.input + cached_tokens * r.cache_read + completion_tokens * r.output
        saved = cached_tokens * (r.input - r.cache_read)
        return Price(cost_usd=cost, saved_usd=saved, priced_as=priced_as)
