"""200 concurrent streams for 60 s against a real server (benchmarks/load.py): no errors but the
deliberate 429s of the throttled tenant, bounded memory, every KV block free afterwards."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _load_module():
    spec = importlib.util.spec_from_file_location("pg_load_bench", REPO / "benchmarks" / "load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loopback_load(tmp_path: Path) -> None:
    load = _load_module()
    res = load.main(["--concurrency", "200", "--duration", "60", "--max-tokens", "8",
                     "--home", str(tmp_path / "home"), "--out", str(tmp_path / "load.json")])
    assert res["num_errors"] == 0, res["errors"]
    assert set(res["statuses"]) <= {"200", "429"}, res["statuses"]
    assert res["statuses"].get("200", 0) > 100
    assert res["statuses"].get("429", 0) > 0, "the throttled tenant was never throttled: the quota path went untested"
    # memory: after the first samples (model, allocator warm-up) RSS may not keep growing
    series = [s["rss_mib"] for s in res["rss_series"]]
    warm = series[len(series) // 4]
    assert max(series) < warm * 1.25 + 64, series
    assert res["final_stats"] is not None and res["final_stats"]["kv_blocks_used"] == 0
