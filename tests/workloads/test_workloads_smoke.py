"""Smoke test: `prefixgate bench` starts real gateways (cache on, cache off) on loopback with the tiny
model, replays a tiny trace of every workload over HTTP, and writes JSON, a table and PNGs."""

from __future__ import annotations

import json

from gateway.cli.main import main as cli_main

TINY = ["--tenants", "2", "--requests", "3", "--system-words", "40", "--chat-sessions", "1", "--chat-turns", "2",
        "--agent-sessions", "2", "--agent-steps", "1", "--tools", "3", "--rag-docs", "3", "--rag-top-k", "2",
        "--doc-words", "20", "--user-words", "5", "--max-tokens", "3"]


def test_bench_end_to_end_on_loopback(tmp_path, capsys):
    out = tmp_path / "results"
    rc = cli_main(["--home", str(tmp_path / "home"), "bench", "--configs", "cache+canon,nocache", "--no-progress",
                   "--out-dir", str(out), "--concurrency", "2", "--kv-blocks", "128", *TINY])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    [json_path] = out.glob("workloads_*.json")
    doc = json.loads(json_path.read_text())
    assert doc["command"].startswith("prefixgate ") and doc["machine"]["cpus"] >= 1 and "git_commit" in doc
    assert doc["table"] in printed and json_path.with_suffix(".txt").exists()
    cells = {(c["config"], c["workload"]): c for c in doc["cells"]}
    assert set(cells) == {(c, w) for c in ("cache+canon", "nocache")
                          for w in ("system_prompts", "chat", "agents", "rag", "random")}
    for (config, workload), cell in cells.items():
        s, b = cell["summary"], cell["break_even"]
        assert s["errors"] == 0, s["first_error"]
        assert s["requests"] == {"chat": 2, "agents": 4}.get(workload, 3)
        assert s["ttft_s"]["n"] == s["requests"] and 0 < s["ttft_s"]["p50"] <= s["ttft_s"]["p99"]
        assert s["prompt_tokens"] > 0 and s["completion_tokens"] > 0 and s["output_tokens_per_s"] > 0
        assert s["prefill_tokens"] > 0 and s["prefill_s"] > 0  # engine counters scraped from /metrics
        assert set(s["cache_time_s"]) == {"hash", "match", "evict", "register", "tier"}
        assert s["cache_time_s"]["hash"] > 0
        assert s["hbm"]["blocks_total"] == 128 and "hbm" in s["evictions"]
        assert {"no_kv_blocks", "batch_full"} <= set(s["queue_reasons_mean_waiting"])
        assert b["cold_prefill_from"] == "nocache" and b["cache_cost_s"] > 0
        if config == "nocache":
            assert s["reused_tokens"] == 0 and s["hit_rate"] == 0 and s["cache_time_s"]["match"] == 0
    cached = cells[("cache+canon", "system_prompts")]["summary"]
    # 3 requests over 2 tenants with one long system prompt each: the tenant's second request hits,
    # which needs canon reorder (a timestamp on line 2) -- the fixture that proves the cells differ
    assert cached["reused_tokens"] > 0 and cached["engine_hit_rate"] > 0
    assert cells[("cache+canon", "chat")]["summary"]["reused_tokens"] > 0  # turn 2 reuses turn 1
    assert cells[("cache+canon", "random")]["summary"]["reused_tokens"] < cached["reused_tokens"]
    assert len(doc["plots"]) == 2
    for p in doc["plots"]:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
