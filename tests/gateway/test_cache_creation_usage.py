"""Cache-creation tokens reach the ledger, /v1/usage and the cost (#24): through a provider route
to Anthropic (a stand-in Anthropic server on loopback, reached by litellm) from both doors, and
from the local engine's cache_control breakpoints (a real ``prefixgate serve``).

The real anthropic and openai SDKs, the real gateway, the real tenancy service and SQLite ledger.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from gateway_fakes import LoopbackServer

from gateway.app import create_app
from gateway.settings import GatewaySettings, RouteConfig
from tenancy.pricing import PriceBook
from tenancy.service import TenancyService
from tests.fleetutil import read_rows
from tests.serverutil import serve_tiny, stop, tenant_key

SYSTEM = [{"type": "text", "text": "You are the claims assistant of ExampleCo. " * 8,
           "cache_control": {"type": "ephemeral"}}]


def anthropic_upstream() -> FastAPI:
    app = FastAPI()

    @app.post("/{path:path}")
    async def messages(path: str, request: Request) -> Any:
        return {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
                "content": [{"type": "text", "text": "Hello there"}], "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": 5, "output_tokens": 3, "cache_read_input_tokens": 100,
                          "cache_creation_input_tokens": 40}}

    return app


def _usage(url: str, key: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_providers_cache_writes_reach_the_ledger_usage_and_cost(tmp_path, monkeypatch):
    monkeypatch.setenv("PG_TEST_ANTHROPIC_KEY", "sk-up")
    svc = TenancyService.open(tmp_path)
    try:
        key = svc.create_tenant("acme").api_key
        with LoopbackServer(anthropic_upstream()) as up:
            route = RouteConfig(model="claude", provider="anthropic/claude-sonnet-4-5", api_base=up.url,
                                api_key_env="PG_TEST_ANTHROPIC_KEY")
            with LoopbackServer(create_app(GatewaySettings(routes=(route,)), tenancy=svc)) as gw:
                msg = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=60).messages.create(
                    model="claude", max_tokens=8, system=SYSTEM, messages=[{"role": "user", "content": "Hi"}])
                assert msg.usage.cache_creation_input_tokens == 40
                chat = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=60)
                chat.chat.completions.create(model="claude", max_tokens=8,
                                             messages=[{"role": "user", "content": "Hi"}])
                svc.flush()
                usage = _usage(gw.url, key)
        rows = read_rows(svc, "SELECT prompt_tokens, cached_tokens, cache_creation_tokens, cost_usd FROM usage")
        assert len(rows) == 2
        want = PriceBook().price("claude-sonnet-4-5", 145, 100, 3, cache_creation_tokens=40).cost_usd
        for row in rows:  # both doors: the provider's writes, at its cache-write price
            assert (row["prompt_tokens"], row["cached_tokens"], row["cache_creation_tokens"]) == (145, 100, 40)
            assert row["cost_usd"] == pytest.approx(want, rel=1e-9)
        assert usage["totals"]["cache_creation_tokens"] == 80
        assert usage["totals"]["cost_usd"] == pytest.approx(2 * want, rel=1e-9)
        assert want > PriceBook().price("claude-sonnet-4-5", 145, 100, 3).cost_usd  # writes cost more than input
    finally:
        svc.close()


def test_the_local_engines_cache_writes_reach_the_ledger_and_usage(tmp_path):
    key = tenant_key(tmp_path, "acme")
    url, proc = serve_tiny(tmp_path, "--kv-blocks", "128", timeout=300)
    try:
        client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)
        question = [{"role": "user", "content": "Do you ship to Norway?"}]
        first = client.messages.create(model="tiny", max_tokens=2, system=SYSTEM, messages=question)
        second = client.messages.create(model="tiny", max_tokens=2, system=SYSTEM, messages=question)
        written = first.usage.cache_creation_input_tokens
        assert written > 0 and second.usage.cache_creation_input_tokens == 0
        assert second.usage.cache_read_input_tokens >= written
        totals = _usage(url, key)["totals"]  # /v1/usage flushes the ledger before it reads
        assert totals["requests"] == 2 and totals["cache_creation_tokens"] == written
        assert totals["cached_tokens"] == second.usage.cache_read_input_tokens
    finally:
        stop(proc)
