"""The completion routes' raw-ASGI fast path: what it serves itself and what it hands to FastAPI.

Whether FastAPI answered is seen by counting its dependency solving (every FastAPI route solves
its dependencies; the fast path has none). The answers themselves are compared in
test_gateway_api.py, which runs every test both ways.
"""

from __future__ import annotations

import fastapi.routing
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import FakeEngine, FakeTenancy

from gateway.app import create_app
from gateway.deps import get_engine
from gateway.settings import GatewaySettings

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def served(monkeypatch):
    solves = []
    real = fastapi.routing.solve_dependencies

    async def counted(*args, **kwargs):
        solves.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counted)
    engine, tenancy = FakeEngine(), FakeTenancy()
    key = tenancy.add("acme")
    app = create_app(GatewaySettings(), engine=engine, tenancy=tenancy)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        yield app, client, solves, tenancy


def test_valid_bodies_are_served_without_fastapi(served):
    _, client, solves, tenancy = served
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "tiny", "prompt": "a b"}),
                       ("/v1/chat/completions", {**CHAT, "stream": True})):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
    assert not solves
    assert [row.status for row in tenancy.rows] == ["ok", "ok", "ok"]
    # a refusal after validation (n over the limit) is answered here too, in the OpenAI shape
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and not solves
    r = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and not solves


@pytest.mark.parametrize("content, content_type, code, says", [
    # not JSON: FastAPI parses the replayed body before it solves anything, and names the error
    (b'{"model": "tiny",', "application/json", "invalid_json", "could not parse the JSON body"),
    # refused by the schema: authenticated first, so the refusal gets its ledger row
    (b'{"model": "tiny", "messages": "hi"}', "application/json", "invalid_value", "messages"),
    # not sent as JSON (text/json included: FastAPI parses application/json and application/*+json only)
    (b"model=tiny", "application/x-www-form-urlencoded", "invalid_json", "Content-Type: application/json"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}', "text/json", "invalid_json",
     "Content-Type: application/json"),
])
def test_bodies_it_does_not_take_reach_fastapi_with_the_body_intact(served, content, content_type, code, says):
    _, client, solves, tenancy = served
    r = client.post("/v1/chat/completions", content=content, headers={"content-type": content_type})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and says in (error["message"] + str(error["param"]))
    if code == "invalid_value":
        assert solves and [row.status for row in tenancy.rows] == ["error"]


def test_dependency_overrides_send_the_routes_to_fastapi(served):
    app, client, solves, _ = served
    other = FakeEngine()
    app.dependency_overrides[get_engine] = lambda: other
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert solves and other.requests


def test_json_that_only_json_loads_takes_is_answered_as_before(served):
    """The fast path parses with pydantic's JSON parser; a body only ``json.loads`` takes goes to
    FastAPI and gets the answer it always had: served (a UTF-8 BOM), or the scan's 400 naming the
    lone surrogate."""
    _, client, solves, tenancy = served
    bom = b"\xef\xbb\xbf" + b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = client.post("/v1/chat/completions", content=bom, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert solves and [row.status for row in tenancy.rows] == ["ok"]
    lone = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}'
    r = client.post("/v1/chat/completions", content=lone, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    # the surrogate in a key: refused as such; and where a nesting refusal's path holds that key, the
    # message shows it escaped, so the 400 itself can be encoded
    head = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "\\ud800": '
    r = client.post("/v1/chat/completions", content=head + b"1}", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    deep = head + b"[" * 70 + b"]" * 70 + b"}"
    r = client.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested" in r.json()["error"]["message"] and "\\ud800" in r.json()["error"]["message"], r.text
    # a refused body with a bad key: the key is refused first, as on FastAPI's own routes
    r = client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": "hi"}',
                    headers={"content-type": "application/json", "Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
