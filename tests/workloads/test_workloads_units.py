"""Fast checks of the workload benchmark's parts: traces, metric parsing, break-even arithmetic, CLI errors."""

from __future__ import annotations

import json

import pytest

from gateway.bench.replay import add_break_even, format_table, msum, parse_metrics
from gateway.bench.traces import WORKLOADS, TraceSizes, build_trace
from gateway.cli.main import main as cli_main

SMALL = TraceSizes(tenants=2, requests=6, system_words=20, chat_sessions=2, chat_turns=3, agent_sessions=2,
                   agent_steps=2, tools=5, rag_docs=4, rag_top_k=2, doc_words=10, user_words=5)


def _text(session) -> str:
    return json.dumps([t.messages for t in session.turns]) + json.dumps([t.tools for t in session.turns])


def test_traces_are_deterministic_and_seed_dependent():
    for w in WORKLOADS:
        assert _text(build_trace(w, SMALL, seed=1)[0]) == _text(build_trace(w, SMALL, seed=1)[0])
    assert _text(build_trace("rag", SMALL, seed=1)[0]) != _text(build_trace("rag", SMALL, seed=2)[0])


def test_trace_shapes():
    sp = build_trace("system_prompts", SMALL)
    assert len(sp) == 6 and {s.tenant for s in sp} == {0, 1}
    # the planted defect that canon reorder repairs: a timestamp on the system prompt's second line
    assert all("Current time: 2026-11-" in s.turns[0].messages[0]["content"] for s in sp)
    chat = build_trace("chat", SMALL)
    assert len(chat) == 2 and all(s.carry_history and len(s.turns) == 3 for s in chat)
    agents = build_trace("agents", SMALL)
    assert all(len(s.turns) == 3 and len(s.turns[0].tools) == 5 for s in agents)
    one_tenant = build_trace("agents", TraceSizes(agent_tenants=1, agent_sessions=4, tools=6))
    names = [[t["function"]["name"] for t in s.turns[0].tools] for s in one_tenant]
    # the planted defect that canon safe repairs: one tenant's tool set, sent in varying order
    assert all(sorted(n) == sorted(names[0]) for n in names) and len({tuple(n) for n in names}) > 1
    follow = agents[0].turns[1].messages
    assert follow[0]["tool_calls"][0]["id"] == follow[1]["tool_call_id"]
    rag = build_trace("rag", SMALL)
    assert all(len(s.meta["docs"]) == 2 and len(set(s.meta["docs"])) == 2 for s in rag)
    rnd = build_trace("random", SMALL)
    firsts = {s.turns[0].messages[0]["content"][:40] for s in rnd}
    assert len(firsts) == len(rnd)  # nothing shared, not even the first words


def test_bad_sizes_and_workload():
    with pytest.raises(ValueError, match="requests"):
        TraceSizes(requests=0)
    with pytest.raises(ValueError, match="rag_top_k"):
        TraceSizes(rag_docs=2, rag_top_k=3)
    with pytest.raises(ValueError, match="unknown workload"):
        build_trace("nope", SMALL)


METRICS = """\
# TYPE prefixgate_kv_evictions_total counter
prefixgate_kv_evictions_total{tier="hbm"} 7.0
# TYPE prefixgate_cache_manage_seconds_total counter
prefixgate_cache_manage_seconds_total{phase="hash"} 0.25
prefixgate_cache_manage_seconds_total{phase="match"} 0.5
# TYPE prefixgate_waiting_requests gauge
prefixgate_waiting_requests{reason="no_kv_blocks"} 2.0
prefixgate_waiting_requests{reason="batch_full"} 1.0
"""


def test_parse_metrics_and_label_sums():
    snap = parse_metrics(METRICS)
    assert msum(snap, "prefixgate_kv_evictions_total", tier="hbm") == 7.0
    assert msum(snap, "prefixgate_cache_manage_seconds_total") == 0.75
    assert msum(snap, "prefixgate_waiting_requests", reason="batch_full") == 1.0
    assert msum(snap, "prefixgate_missing_total") == 0.0


def _cell(config, workload, reused, cost, prefill_tokens, prefill_s):
    dist = {"p50": 0.1, "p95": 0.2, "p99": 0.3, "mean": 0.1, "n": 1}
    return {"config": config, "workload": workload, "summary": {
        "requests": 1, "errors": 0, "ttft_s": dist, "tpot_s": dist, "itl_s": dist, "prompt_tokens_per_s": 1.0,
        "output_tokens_per_s": 1.0, "hit_rate": 0.5, "reused_tokens": reused, "evictions": {"hbm": 0.0},
        "fragmentation": {"max": 0.1}, "cache_time_s": {"hash": cost},
        "prefill_tokens_per_s": prefill_tokens / prefill_s}}


def test_break_even_uses_the_cold_run_of_the_same_workload():
    cells = [_cell("cache", "rag", reused=1000, cost=0.5, prefill_tokens=4000, prefill_s=1.0),
             _cell("nocache", "rag", reused=0, cost=0.1, prefill_tokens=1000, prefill_s=1.0),
             _cell("cache", "chat", reused=300, cost=0.2, prefill_tokens=600, prefill_s=2.0)]
    add_break_even(cells)
    rag = cells[0]["break_even"]
    assert rag["cold_prefill_from"] == "nocache" and rag["cold_prefill_tokens_per_s"] == 1000
    assert rag["prefill_saved_s"] == pytest.approx(1.0) and rag["net_s"] == pytest.approx(0.5)
    assert rag["saved_per_cost"] == pytest.approx(2.0)
    chat = cells[2]["break_even"]  # no nocache run of chat: its own prefill throughput
    assert chat["cold_prefill_from"] == "own run" and chat["prefill_saved_s"] == pytest.approx(1.0)
    assert chat["net_s"] == pytest.approx(0.8)
    table = format_table(cells)
    assert "rag" in table and "500.0" in table  # net of the rag cell, in ms


@pytest.mark.parametrize("argv, message", [
    (["bench", "--workloads", "nope", "--url", "http://127.0.0.1:9", "--api-key", "k"], "unknown workload"),
    (["bench", "--configs", "fast", "--model", "/nonexistent"], "--model /nonexistent"),
    (["bench", "--url", "http://example.com:8000", "--api-key", "k", "--no-progress"], "loopback"),
    (["bench", "--url", "http://127.0.0.1:9", "--no-progress"], "--api-key"),
    (["bench", "--requests", "0", "--url", "http://127.0.0.1:9", "--api-key", "k"], "requests must be >= 1"),
    (["bench", "--dram-bytes", "lots", "--url", "http://127.0.0.1:9", "--api-key", "k"], "--dram-bytes"),
])
def test_cli_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert cli_main(["--home", str(tmp_path), *argv, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("prefixgate: error:") and err.count("\n") == 1


def test_external_keys_are_shared_round_robin():
    from gateway.bench.replay import GatewayConfig, Target

    target = Target(GatewayConfig("external", True, "as configured"), "http://127.0.0.1:1", "m",
                    {("*", 0): "k0", ("*", 1): "k1"})
    assert [target.key("rag", t) for t in range(4)] == ["k0", "k1", "k0", "k1"]
    local = Target(GatewayConfig("cache", True, "off"), "http://127.0.0.1:1", "m", {("rag", 0): "r0", ("chat", 0): "c0"})
    assert local.key("rag", 0) == "r0" and local.key("chat", 0) == "c0"
