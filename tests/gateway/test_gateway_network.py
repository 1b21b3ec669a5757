"""The gateway over real loopback HTTP: client disconnects, remote engine nodes, litellm upstreams."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import FakeEngine, FakeTenancy, LoopbackServer

from gateway.app import create_app
from gateway.settings import GatewaySettings, RouteConfig
from tests.serverutil import wait_for

CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "be brief and exact " * 4},
                                      {"role": "user", "content": "hi"}], "max_tokens": 2}


def test_client_disconnect_aborts_engine_request_and_records_aborted():
    engine, tenancy = FakeEngine(delay_s=0.05), FakeTenancy()
    key = tenancy.add("acme")
    app = create_app(GatewaySettings(), engine=engine, tenancy=tenancy)
    with LoopbackServer(app) as srv:
        h = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=srv.url, headers=h) as http, \
                http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(g.startswith("data: ") for g in got)
        assert wait_for(lambda: tenancy.rows), "no ledger row after disconnect"
        assert tenancy.rows[0].status == "aborted" and 0 < tenancy.rows[0].completion_tokens < 200
        assert engine.aborted and engine.aborted[0].startswith(tenancy.rows[0].request_id)
        assert not engine.active
        # non-streamed: the client gives up (timeout) -> the server notices and aborts too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/v1/chat/completions", json={**CHAT, "max_tokens": 200}, headers=h, timeout=0.3)
        assert wait_for(lambda: len(tenancy.rows) == 2)
        assert tenancy.rows[1].status == "aborted" and len(engine.aborted) == 2 and not engine.active


@pytest.fixture
def node_pool(monkeypatch):
    monkeypatch.setenv("PG_TEST_NODE_TOKEN", "node-secret")
    engines = [FakeEngine(), FakeEngine()]
    servers = [LoopbackServer(create_app(GatewaySettings(node_token="node-secret"), engine=e)) for e in engines]
    for s in servers:
        s.__enter__()
    yield engines, servers
    for s in servers:
        s.__exit__(None, None, None)


def test_remote_nodes_cache_aware_routing(node_pool):
    engines, servers = node_pool
    tenancy = FakeTenancy()
    keys = [tenancy.add("acme"), tenancy.add("beta")]
    route = RouteConfig(model="tiny", nodes=tuple(s.url for s in servers), node_token_env="PG_TEST_NODE_TOKEN")
    app = create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)
    with TestClient(app) as client:
        h = {"Authorization": f"Bearer {keys[0]}"}
        assert [m["id"] for m in client.get("/v1/models", headers=h).json()["data"]] == ["tiny"]
        first = client.post("/v1/chat/completions", json=CHAT, headers=h)
        assert first.status_code == 200, first.text
        second = client.post("/v1/chat/completions", json=CHAT, headers=h).json()
        # same namespace + prefix -> same node -> the second request hits that node's cache
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        used = [i for i, e in enumerate(engines) if e.requests]
        assert len(used) == 1 and len(engines[used[0]].requests) == 2
        assert first.headers["x-prefixgate-backend"] == f"node:tiny-{used[0] + 1}"  # its name, not its URL
        # the node got the server-derived namespace, never a key or tenant id
        sent = engines[used[0]].requests[0]
        assert sent.tenant.namespace == tenancy.keys[keys[0]].namespace and sent.tenant.cipher is None
        # streaming through a node
        stream = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=h)
        assert stream.text.rstrip().endswith("data: [DONE]")
        # many namespaces spread over both nodes
        for i in range(12):
            client.post("/v1/chat/completions", headers=h,
                        json={**CHAT, "messages": [{"role": "user", "content": f"topic {i} " * 80}]})
        assert all(e.requests for e in engines)


def test_node_api_requires_token_and_maps_engine_errors(node_pool):
    engines, servers = node_pool
    url = servers[0].url
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "cache_salt": "ab"}
    # without the node token the public API answers (this node has no tenancy: 503, never the engine)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code in (401, 503) and r.json()["error"]["code"] != "invalid_node_request"
    assert not engines[0].requests
    h = {"Authorization": "Bearer node-secret"}
    ok = httpx.post(f"{url}/v1/completions", json=body, headers=h)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2 and "cached_tokens" in ok.json()["usage"]["prompt_tokens_details"]
    assert engines[0].requests[-1].tenant.namespace == b"\xab" and engines[0].requests[-1].prompt_token_ids == [5, 6, 7]
    too_long = httpx.post(f"{url}/v1/completions", headers=h, json={**body, "max_tokens": 255})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    malformed = httpx.post(f"{url}/v1/completions", headers=h, json={"prompt": []})
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_node_request"
    # a process without a node token has no node API: the same call is a tenant call there
    plain = create_app(GatewaySettings(), engine=FakeEngine())
    with TestClient(plain) as c:
        assert c.post("/internal/v1/drain", headers=h).status_code == 404


class BodyRecorder:
    """ASGI middleware that keeps every request body the upstream receives (to check cache_salt)."""

    def __init__(self, app):
        self.app = app
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks = []

        async def recv():
            msg = await receive()
            if msg["type"] == "http.request":
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body") and chunks and b"".join(chunks):
                    self.bodies.append(json.loads(b"".join(chunks)))
            return msg

        return await self.app(scope, recv, send)


@pytest.mark.parametrize("transport", ["litellm", "direct"])
def test_provider_route_to_openai_compatible_upstream(monkeypatch, transport):
    """Through litellm, and with transport = "direct" (keep-alive httpx): the same wire results."""
    monkeypatch.setenv("PG_TEST_UPSTREAM_KEY", "sk-upstream")
    up_engine, up_tenancy = FakeEngine(), FakeTenancy()
    up_tenancy.keys["sk-upstream"] = up_tenancy.keys.pop(up_tenancy.add("gatewayco"))
    upstream = BodyRecorder(create_app(GatewaySettings(), engine=up_engine, tenancy=up_tenancy))
    with LoopbackServer(upstream) as up:
        tenancy = FakeTenancy()
        key = tenancy.add("acme")
        route = RouteConfig(model="up-tiny", provider="openai/tiny", api_base=f"{up.url}/v1",
                            api_key_env="PG_TEST_UPSTREAM_KEY", cache_salt=True, max_model_len=256,
                            transport=transport)
        app = create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)
        with TestClient(app) as client:
            h = {"Authorization": f"Bearer {key}"}
            body = {**CHAT, "model": "up-tiny"}
            first = client.post("/v1/chat/completions", json=body, headers=h)
            assert first.status_code == 200, first.text
            assert first.json()["choices"][0]["message"]["content"] == " w0 w1"
            assert first.headers["x-prefixgate-backend"] == f"{transport}:openai/tiny"
            second = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}, headers=h)
            events = [json.loads(e[6:]) for e in second.text.split("\n\n") if e.startswith("data: {")]
            assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == " w0 w1"
            usage = events[-1]["usage"]
            # the upstream's cached_tokens come back into our usage and ledger
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0
            assert tenancy.rows[-1].cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]
            assert tenancy.rows[-1].backend == f"{transport}:openai/tiny"
            assert tenancy.rows[-1].model == "openai/tiny"  # priced as the provider's model, not the alias
            # the tenant namespace travels as cache_salt; the upstream saw our model name and the key
            assert up.url and upstream.bodies[0]["cache_salt"] == tenancy.keys[key].namespace.hex()
            assert upstream.bodies[0]["model"] == "tiny"
            comp = client.post("/v1/completions", json={"model": "up-tiny", "prompt": "a b c", "max_tokens": 2},
                               headers=h)
            assert comp.status_code == 200, comp.text
            assert comp.json()["choices"][0]["text"] == " w0 w1"
            # vLLM's sampling extras reach the upstream in the body, as the client sent them
            extras = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1, "stop_token_ids": [3]}
            sent = client.post("/v1/chat/completions", json={**body, **extras}, headers=h)
            assert sent.status_code == 200, sent.text
            assert {k: upstream.bodies[-1].get(k) for k in extras} == extras
            assert "min_p" not in upstream.bodies[0]  # and only when sent
            # echo: the gateway prepends the prompt; its scores no provider returns, so with logprobs a 400
            echoed = client.post("/v1/completions", json={"model": "up-tiny", "prompt": "a b c", "max_tokens": 2,
                                                          "echo": True}, headers=h)
            assert echoed.status_code == 200 and echoed.json()["choices"][0]["text"] == "a b c w0 w1", echoed.text
            scored = client.post("/v1/completions", json={"model": "up-tiny", "prompt": "a b c", "max_tokens": 2,
                                                          "echo": True, "logprobs": 1}, headers=h)
            assert scored.status_code == 400 and scored.json()["error"]["param"] == "echo"
            assert scored.json()["error"]["code"] == "unsupported_value"
            # an upstream 400 (context too long there) stays a 400 here
            too_long = client.post("/v1/chat/completions", json={**body, "max_tokens": 255}, headers=h)
            assert too_long.status_code == 400 and too_long.json()["error"]["message"]


def test_unreachable_node_fails_over_to_another(node_pool):
    engines, servers = node_pool
    tenancy = FakeTenancy()
    key = tenancy.add("acme")
    import socket

    with socket.socket() as s:  # a port with nobody listening: connection refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    route = RouteConfig(model="tiny", nodes=(dead, servers[0].url), node_token_env="PG_TEST_NODE_TOKEN")
    app = create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)
    with TestClient(app) as client:
        h = {"Authorization": f"Bearer {key}"}
        for i in range(6):  # different prompts: some would hash to the dead node
            body = {**CHAT, "messages": [{"role": "user", "content": f"question {i} " * 40}]}
            r = client.post("/v1/chat/completions", json=body, headers=h)
            assert r.status_code == 200, r.text
        assert len(engines[0].requests) == 6
        dead_backend = app.state.router.routes["tiny"].backends[0]
        assert not dead_backend.up  # skipped for a while after it refused
    # a pool whose only node is down answers 503 in the OpenAI shape
    only_dead = create_app(GatewaySettings(routes=(RouteConfig(model="tiny", nodes=(dead,)),)), tenancy=tenancy)
    with TestClient(only_dead) as client:
        r = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "node_unavailable"


def test_direct_transport_needs_an_openai_compatible_base():
    with pytest.raises(ValueError, match="direct"):
        RouteConfig(model="m", provider="anthropic/claude-x", transport="direct")
    with pytest.raises(ValueError, match="direct"):
        RouteConfig(model="m", provider="openai/x", transport="direct")


class FixedUpstream:
    """A raw-ASGI OpenAI-compatible upstream: keeps each request body, answers one fixed completion."""

    ANSWER = json.dumps({"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "m",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "{}"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}).encode()

    def __init__(self):
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if body:
            self.bodies.append(json.loads(body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": self.ANSWER if body else b"{}"})


@pytest.mark.parametrize("transport", ["direct", "litellm"])
def test_a_provider_gets_the_canonical_response_format(monkeypatch, transport):
    """The pass-through fields come from the canonicalized body: canon's key-sorted response_format
    schema is what the provider sees (it used to get the body as the client sent it), its
    ``properties`` in the client's order."""
    monkeypatch.setenv("PG_TEST_UPSTREAM_KEY", "sk-upstream")
    upstream = FixedUpstream()
    with LoopbackServer(upstream) as up:
        tenancy = FakeTenancy()
        key = tenancy.add("acme", canon_mode="safe")
        route = RouteConfig(model="up", provider="openai/m", api_base=f"{up.url}/v1",
                            api_key_env="PG_TEST_UPSTREAM_KEY", transport=transport)
        schema = {"schema": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}},
                  "name": "out"}
        body = {**CHAT, "model": "up", "tool_choice": "none",
                "response_format": {"type": "json_schema", "json_schema": schema}}
        with TestClient(create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)) as client:
            r = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        assert "response-schema-canonical" in r.headers["x-prefixgate-canonical"]
        sent = upstream.bodies[-1]
        if transport == "direct":  # litellm drops a tool_choice that comes without tools
            assert sent["tool_choice"] == "none"
        got = sent["response_format"]["json_schema"]
        assert list(got) == ["name", "schema"] and list(got["schema"]) == ["properties", "type"]
        # The field order under properties is the order the model writes them in: never sorted.
        assert list(got["schema"]["properties"]) == ["b", "a"]
