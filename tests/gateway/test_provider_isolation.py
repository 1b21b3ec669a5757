"""Issue 16.3: a provider route must not let one tenant hit another's prompt in the upstream's cache.

The upstream is a real PrefixGate app over HTTP (loopback uvicorn) whose one tenant is the gateway's
upstream account: exactly the situation of a hosted provider that keeps one prompt cache per
account, or of a vLLM that ignores a salt nobody sent. Its FakeEngine caches whole 4-token blocks
per namespace, so a shared prefix shows up as ``cached_tokens``.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import FakeEngine, FakeTenancy, LoopbackServer

from gateway.app import create_app
from gateway.settings import GatewaySettings, RouteConfig
from gateway.upstream import scope_marker, scoped_messages

PROMPT = "Answer as the support assistant of a small bookshop. " * 8


def _cached(client: TestClient, key: str, content: str) -> int:
    r = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                    json={"model": "up", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def upstream(monkeypatch):
    monkeypatch.setenv("PG_TEST_UPSTREAM_KEY", "sk-upstream")
    up_tenancy = FakeTenancy()
    up_tenancy.keys["sk-upstream"] = up_tenancy.keys.pop(up_tenancy.add("gatewayco"))  # one upstream account
    with LoopbackServer(create_app(GatewaySettings(), engine=FakeEngine(), tenancy=up_tenancy)) as up:
        yield up


def _gateway(up, transport: str, **isolation) -> tuple[TestClient, str, str]:
    tenancy = FakeTenancy()
    a, b = tenancy.add("acme"), tenancy.add("beta")
    route = RouteConfig(model="up", provider="openai/tiny", api_base=f"{up.url}/v1",
                        api_key_env="PG_TEST_UPSTREAM_KEY", max_model_len=256, transport=transport, **isolation)
    return TestClient(create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)), a, b


@pytest.mark.parametrize("transport", ["direct", "litellm"])
def test_default_route_gives_no_cross_tenant_hit(upstream, transport: str) -> None:
    client, a, b = _gateway(upstream, transport)
    with client:
        assert _cached(client, a, PROMPT) == 0
        assert _cached(client, a, PROMPT) > 0  # the tenant's own cache still works through the marker
        assert _cached(client, b, PROMPT) == 0  # the other tenant gets nothing of it


def test_opting_out_of_every_isolation_shows_the_leak(upstream) -> None:
    """The test's power: without the marker (and an upstream that ignores salts) B hits A's prompt."""
    client, a, b = _gateway(upstream, "direct", tenant_prefix=False, cache_salt=False)
    with client:
        _cached(client, a, PROMPT + " opt-out")
        assert _cached(client, b, PROMPT + " opt-out") > 0


def test_isolation_defaults_by_kind_of_upstream() -> None:
    vllm = RouteConfig(model="m", provider="openai/llama", api_base="http://10.0.0.5:8000/v1")
    openai = RouteConfig(model="m", provider="openai/gpt-4o-mini")
    openai_base = RouteConfig(model="m", provider="openai/gpt-4o-mini", api_base="https://api.openai.com/v1")
    anthropic = RouteConfig(model="m", provider="anthropic/claude-sonnet-4")
    assert vllm.sends_cache_salt and not vllm.sends_prompt_cache_key
    for hosted in (openai, openai_base, anthropic):
        assert not hosted.sends_cache_salt  # hosted APIs refuse unknown fields
        assert hosted.tenant_prefix  # the marker is what isolates there
    assert openai.sends_prompt_cache_key and openai_base.sends_prompt_cache_key and not anthropic.sends_prompt_cache_key
    explicit = RouteConfig(model="m", provider="openai/llama", api_base="http://h/v1", cache_salt=False)
    assert not explicit.sends_cache_salt


def test_marker_leads_the_prompt_and_differs_per_namespace() -> None:
    ns_a, ns_b = b"a" * 32, b"b" * 32
    assert scope_marker(ns_a) != scope_marker(ns_b) and ns_a.hex() not in scope_marker(ns_a)
    plain = scoped_messages([{"role": "user", "content": "hi"}], ns_a)
    assert plain[0] == {"role": "system", "content": f"[cache-scope {scope_marker(ns_a)}]"}
    joined = scoped_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], ns_a)
    assert len(joined) == 2 and joined[0]["content"].startswith("[cache-scope ") and joined[0]["content"].endswith(
        "\nBe brief.")
    parts = scoped_messages([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}], ns_a)
    assert parts[0]["content"][0]["text"].startswith("[cache-scope ") and parts[0]["content"][1]["text"] == "Be brief."


def test_node_calls_with_a_malformed_body_are_400s() -> None:
    """16.11 (a malformed node body was a 500), on the OpenAI-compatible node API."""
    app = create_app(GatewaySettings(node_token="node-secret"), engine=FakeEngine())
    h = {"Authorization": "Bearer node-secret", "Content-Type": "application/json"}
    with TestClient(app) as client:
        for path in ("/v1/completions", "/v1/chat/completions", "/internal/v1/drain"):
            for raw in (b"[1]", b"{", b"null", b'{"prompt": {"a": 1}, "messages": 5, "draining": 3}', b"\xff"):
                r = client.post(path, content=raw, headers=h)
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_node_request", (path, raw, r.text)


def test_node_api_bounds_temperature_like_the_public_api() -> None:
    """A variant of 16.11 through the node API: a denormal temperature reaches the engine as greedy."""
    engine = FakeEngine()
    app = create_app(GatewaySettings(node_token="node-secret"), engine=engine)
    body = {"prompt": "a b c", "cache_salt": "00" * 32, "max_tokens": 1, "temperature": 1e-300}
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer node-secret"})
        assert r.status_code == 200, r.text
    assert engine.requests[-1].sampling.temperature == 0.0


def test_per_tenant_upstream_accounts(monkeypatch) -> None:
    """16.3's other option: each tenant on its own upstream account (own cache there); a route that
    allows no shared key refuses, with a real 403, a tenant that has none."""
    monkeypatch.setenv("PG_UP_ACME", "sk-up-acme")
    monkeypatch.setenv("PG_UP_BETA", "sk-up-beta")
    monkeypatch.setenv("PG_UP_SHARED", "sk-up-shared")
    up_tenancy = FakeTenancy()
    for name in ("acme", "beta", "shared"):
        up_tenancy.keys[f"sk-up-{name}"] = up_tenancy.keys.pop(up_tenancy.add(f"up-{name}"))
    with LoopbackServer(create_app(GatewaySettings(), engine=FakeEngine(), tenancy=up_tenancy)) as up:
        for transport in ("direct", "litellm"):
            tenancy = FakeTenancy()
            a, b, c = tenancy.add("acme"), tenancy.add("beta"), tenancy.add("gamma")
            route = RouteConfig(model="up", provider="openai/tiny", api_base=f"{up.url}/v1", transport=transport,
                                api_key_env="PG_UP_SHARED", max_model_len=256, tenant_prefix=False, cache_salt=False,
                                tenant_api_key_envs={"acme": "PG_UP_ACME", "beta": "PG_UP_BETA"},
                                shared_api_key=False)
            with TestClient(create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)) as client:
                prompt = f"{transport}-only words: {PROMPT}"  # shares no block with the other transport's
                _cached(client, a, prompt)
                assert _cached(client, a, prompt) > 0
                assert _cached(client, b, prompt) == 0  # no marker, no salt: the accounts alone isolate
                for stream in (False, True):
                    r = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {c}"},
                                    json={"model": "up", "max_tokens": 2, "stream": stream,
                                          "messages": [{"role": "user", "content": "hi"}]})
                    assert r.status_code == 403 and r.json()["error"]["code"] == "upstream_account_required", r.text
        upstream_rows = {row.tenant_id for row in up_tenancy.rows}
        assert upstream_rows == {"t-up-acme", "t-up-beta"}, upstream_rows
