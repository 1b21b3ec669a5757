"""What the gateway's lifespan stops when it ends: the engine it built (its thread ends), the tenancy it
opened (queued ledger rows written, then closed), an injected tenancy's queue (flushed, not closed: the
caller owns it) and each node client's HTTP pool; an injected engine is left running."""

from __future__ import annotations

import asyncio
import sqlite3

from fastapi.testclient import TestClient
from gateway_fakes import FakeEngine, FakeTenancy

from gateway.app import create_app
from gateway.remote import RemoteEngineClient
from gateway.settings import GatewaySettings, RouteConfig
from tests.serverutil import tenant_key


def test_the_engine_and_tenancy_it_built_are_stopped_with_the_ledger_written(tmp_path, tiny_model_dir):
    key = tenant_key(tmp_path, "acme")
    app = create_app(GatewaySettings(home=tmp_path, model="tiny", model_dir=tiny_model_dir, kv_blocks=64))
    with TestClient(app) as client:
        engine = app.state.engine
        assert asyncio.run(engine.health())
        r = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    assert not asyncio.run(engine.health())  # its thread ended
    with sqlite3.connect(tmp_path / "prefixgate.db") as db:  # the row queued by the request, written at stop
        assert db.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == 1


class CountingTenancy(FakeTenancy):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0
        self.closes = 0

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closes += 1


class StoppableEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.stops: list[str] = []

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stops.append("shutdown")

    async def aclose(self) -> None:
        self.stops.append("aclose")


def test_an_injected_engine_is_left_running_and_an_injected_tenancy_is_flushed_not_closed():
    engine, tenancy = StoppableEngine(), CountingTenancy()
    with TestClient(create_app(GatewaySettings(), engine=engine, tenancy=tenancy)) as client:
        assert client.get("/health").status_code == 200
    assert (tenancy.flushes, tenancy.closes) == (1, 0)
    assert engine.stops == []  # the caller that built it stops it


def test_each_node_clients_http_pool_is_closed(tmp_path):
    route = RouteConfig(model="tiny", nodes=("http://127.0.0.1:9", "http://127.0.0.1:10"))
    app = create_app(GatewaySettings(home=tmp_path, routes=(route,), node_probe_interval_s=60))
    with TestClient(app):
        clients = app.state.router.all_clients()
        assert len(clients) == 2 and all(isinstance(c, RemoteEngineClient) for c in clients)
        assert not any(c.closed for c in clients)
    assert all(c.closed for c in clients)
