"""/v1/messages through a provider route to Anthropic (litellm, over loopback to a stand-in Anthropic
server): cache_control reaches the provider, its cache fields come back, and the ledger row is normalised."""

from __future__ import annotations

from typing import Any

import anthropic
from fastapi import FastAPI, Request
from gateway_fakes import FakeTenancy, LoopbackServer

from gateway.app import create_app
from gateway.settings import GatewaySettings, RouteConfig

SYSTEM = [{"type": "text", "text": "You are the claims assistant of ExampleCo. " * 8,
           "cache_control": {"type": "ephemeral"}}]


def anthropic_upstream(seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.post("/{path:path}")
    async def messages(path: str, request: Request) -> Any:
        seen.append({"path": path, "body": await request.json()})
        return {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
                "content": [{"type": "text", "text": "Hello there"}], "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": 5, "output_tokens": 3, "cache_read_input_tokens": 100,
                          "cache_creation_input_tokens": 40}}

    return app


def test_provider_route_passes_cache_control_and_reports_provider_cache_fields(monkeypatch):
    monkeypatch.setenv("PG_TEST_ANTHROPIC_KEY", "sk-up")
    seen: list[dict[str, Any]] = []
    tenancy = FakeTenancy()
    key = tenancy.add("acme")
    with LoopbackServer(anthropic_upstream(seen)) as up:
        route = RouteConfig(model="claude", provider="anthropic/claude-sonnet-4-5", api_base=up.url,
                            api_key_env="PG_TEST_ANTHROPIC_KEY")
        with LoopbackServer(create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)) as gw:
            client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=60)
            msg = client.messages.create(model="claude", max_tokens=8, system=SYSTEM,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert msg.content[0].text == "Hello there"
    assert msg.usage.cache_read_input_tokens == 100 and msg.usage.cache_creation_input_tokens == 40
    assert msg.usage.input_tokens == 5
    sent = seen[0]["body"]
    system = sent["system"] if isinstance(sent.get("system"), list) else sent["messages"][0]["content"]
    assert any(isinstance(b, dict) and b.get("cache_control", {}).get("type") == "ephemeral" for b in system)
    row = tenancy.rows[-1]
    assert row.prompt_tokens == 145 and row.cached_tokens == 100 and row.completion_tokens == 3
