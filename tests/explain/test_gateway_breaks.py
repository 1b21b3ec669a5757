"""End to end over HTTP: `prefixgate serve` (tiny model on CPU, real tenancy), the openai SDK as client.

A client that stamps the time into its system prompt, then shuffles its tools, then edits its history:
each request's break is in the `x-prefixgate-cache` header with the right rule, counted in
`prefixgate_cache_breaks_total{tenant,rule}`, stored in the ledger, and exported by `prefixgate report`;
another tenant sees none of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("torch", reason="pip install 'prefixgate[engine]' (torch)")  # `serve --model tiny` runs the real engine

from gateway.cli.serve_cmd import ensure_tiny_model  # noqa: E402
from tenancy.service import TenancyService  # noqa: E402
from tests.serverutil import scrape, serve_tiny, stop  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **OFFLINE}


POLICY = " ".join(f"Rule {i}: answer from the handbook and cite the section." for i in range(12))
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} for the customer",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
         for n in ("get_invoice", "open_ticket", "search_orders")]
# Two turns after the one the test edits: the cache is a grid of 16-token blocks, and an edit in
# the last partial block before the question would cost no cached block at all.
HISTORY = [{"role": "user", "content": "My parcel is late."},
           {"role": "assistant", "content": "Sorry, it ships tomorrow."},
           {"role": "user", "content": "Which carrier takes it, and will I get a tracking number by e-mail?"},
           {"role": "assistant", "content": "The carrier is DHL; the tracking number follows by e-mail tonight."}]


def _request(ts="2026-11-29T10:00:00Z", tools=TOOLS, history=HISTORY, question="Can you expedite it?"):
    return {"model": "tiny", "max_tokens": 1, "temperature": 0, "tools": tools,
            "messages": [{"role": "system", "content": f"You are ExampleCo's assistant.\nCurrent time: {ts}\n{POLICY}"},
                         *history, {"role": "user", "content": question}]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("explain-home")
    ensure_tiny_model(home)
    svc = TenancyService.open(home)
    try:  # canon off: the gateway must not repair what we want it to explain; acme keeps miss text
        # (store_miss_context, off by default: tests/tenancy/test_tenancy_ledger_hardening.py)
        keys = {n: svc.create_tenant(n, canon_mode="off", store_miss_context=n == "acme").api_key
                for n in ("acme", "beta")}
        svc.flush()
    finally:
        svc.close()
    url, proc = serve_tiny(home, "--kv-blocks", "512", env=OFFLINE)
    try:
        yield url, keys, home
    finally:
        stop(proc)


def _send(url, key, body):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(**body)
    header = dict(part.split("=", 1) for part in raw.headers["x-prefixgate-cache"].split("; "))
    return header, raw.parse().usage


def test_each_break_is_explained_counted_recorded_and_kept_per_tenant(served):
    url, keys, home = served
    header, usage = _send(url, keys["acme"], _request())
    assert header == {"cached": str(usage.prompt_tokens_details.cached_tokens)}  # first request: no near-hit

    header, usage = _send(url, keys["acme"], _request(ts="2026-11-29T10:05:00Z"))
    assert (header["break"], header["detail"]) == ("PC002", "timestamp")
    assert int(header["cached"]) == usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens // 2
    assert 0 < int(header["pos"]) < usage.prompt_tokens

    header, _ = _send(url, keys["acme"], _request(ts="2026-11-29T10:05:00Z", tools=[TOOLS[2], TOOLS[0], TOOLS[1]]))
    assert (header["break"], header["detail"]) == ("PC004", "tools-reordered")

    edited = [HISTORY[0], {"role": "assistant", "content": "Sorry, it shipped today."}, *HISTORY[2:]]
    header, _ = _send(url, keys["acme"], _request(ts="2026-11-29T10:05:00Z", tools=[TOOLS[2], TOOLS[0], TOOLS[1]],
                                                  history=edited))
    assert (header["break"], header["detail"]) == ("PC012", "edited")

    # Streaming headers leave before the engine reports cached tokens: the predicted break, by character.
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {keys['acme']}"},
                      json={**_request(ts="2026-11-29T10:06:00Z", tools=[TOOLS[2], TOOLS[0], TOOLS[1]],
                                       history=edited), "stream": True}) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
        streamed = dict(part.split("=", 1) for part in r.headers["x-prefixgate-cache"].split("; "))
    assert (streamed["break"], streamed["detail"]) == ("PC002", "timestamp") and "cached" not in streamed
    assert int(streamed["char"]) > 0

    # beta sends acme's first prompt: acme's history is not beta's, so nothing to explain
    header, _ = _send(url, keys["beta"], _request(ts="2026-11-29T10:09:00Z"))
    assert "break" not in header

    metrics = scrape(url)
    for rule in ("PC002", "PC004", "PC012"):
        # PC002 twice: the timestamp break, then the streamed one (settled after the stream ended)
        count = 2.0 if rule == "PC002" else 1.0
        assert f'prefixgate_cache_breaks_total{{rule="{rule}",tenant="acme"}} {count}' in metrics
    assert 'tenant="beta"' not in "".join(x for x in metrics.splitlines() if x.startswith("prefixgate_cache_breaks"))

    time.sleep(1.0)  # the ledger writer batches rows
    own = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {keys['beta']}"}, timeout=30).json()
    assert own["misses"] == [] and own["breaks"] == []
    out = subprocess.run([sys.executable, "-m", "gateway.cli.main", "report", "--home", str(home), "--format", "json"],
                         cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert sorted(m["rule"] for m in rep["misses"]) == ["PC002", "PC002", "PC004", "PC012"]
    assert {m["tenant"] for m in rep["misses"]} == {"acme"}
    assert all(b["tokens_lost"] > 0 for b in rep["breaks"])
    # template text before a break is kept for --from-usage; conversation text (PC012) is not stored
    contexts = {m["rule"]: m["context"] for m in rep["misses"]}  # both PC002 breaks end at the same text
    assert contexts["PC002"].endswith("Current time: 2026-11-29T10:0") and contexts["PC012"] is None
    table = subprocess.run([sys.executable, "-m", "gateway.cli.main", "report", "--home", str(home)],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=120).stdout
    assert "Top cache-break reasons" in table and "PC012" in table
