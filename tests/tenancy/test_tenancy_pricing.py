"""Prices come from litellm's bundled cost map; unknown models are priced as the reference model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tenancy.pricing import PriceBook


def _entry(model: str) -> dict:
    spec = importlib.util.find_spec("litellm")
    path = Path(next(iter(spec.submodule_search_locations))) / "model_prices_and_context_window_backup.json"
    return json.loads(path.read_text())[model]


def test_known_model_uses_its_input_cache_read_and_output_prices() -> None:
    e = _entry("gpt-4o")
    p = PriceBook().price("gpt-4o", prompt_tokens=1000, cached_tokens=400, completion_tokens=200)
    assert p.priced_as == "gpt-4o"
    want = 600 * e["input_cost_per_token"] + 400 * e["cache_read_input_token_cost"] + 200 * e["output_cost_per_token"]
    assert p.cost_usd == pytest.approx(want, rel=1e-12)
    assert p.saved_usd == pytest.approx(400 * (e["input_cost_per_token"] - e["cache_read_input_token_cost"]))
    assert p.saved_usd > 0


def test_provider_prefix_is_stripped() -> None:
    assert PriceBook().price("openai/gpt-4o", 10, 0, 0).priced_as == "gpt-4o"


def test_unknown_and_local_models_are_priced_as_the_reference_model(monkeypatch) -> None:
    ref = PriceBook().price("gpt-4o-mini", 1000, 500, 10)
    local = PriceBook().price("/models/my-llama", 1000, 500, 10)
    assert local == ref.__class__(ref.cost_usd, ref.saved_usd, "gpt-4o-mini")
    monkeypatch.setenv("PREFIXGATE_REFERENCE_MODEL", "gpt-4o")
    assert PriceBook().price("tiny", 1, 0, 0).priced_as == "gpt-4o"
    assert PriceBook("gpt-4o-mini").price("tiny", 1, 0, 0).priced_as == "gpt-4o-mini"


def test_a_reference_model_without_prices_is_refused() -> None:
    with pytest.raises(ValueError, match="no per-token prices"):
        PriceBook("no-such-model-anywhere")


def test_no_cache_price_means_no_savings() -> None:
    book = PriceBook(cost_map={"m": {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6},
                               "gpt-4o-mini": _entry("gpt-4o-mini")})
    p = book.price("m", 100, 60, 10)
    assert p.cost_usd == pytest.approx(100 * 1e-6 + 10 * 2e-6) and p.saved_usd == 0.0


@pytest.mark.parametrize("args", [(10, 11, 0), (-1, 0, 0), (10, 0, -1)])
def test_impossible_counts_are_refused(args) -> None:
    with pytest.raises(ValueError):
        PriceBook().price("gpt-4o", *args)
