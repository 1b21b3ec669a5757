"""A client that leaves mid-request: the work runs in the request's own task, watched by one task
(``gateway.responder.ClientWatch``), and the disconnect still aborts the upstream request, writes
an aborted ledger row, and leaves nothing cancelled behind; an upstream error before the first
token still gives its real HTTP status."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from gateway_fakes import FakeTenancy, LoopbackServer
from starlette.applications import Starlette
from starlette.routing import Mount

from gateway.app import create_app
from gateway.responder import ClientWatch
from gateway.settings import GatewaySettings, RouteConfig
from tests.serverutil import wait_for

DISCONNECT = {"type": "http.disconnect"}


def _receive_after(gone: asyncio.Event):
    async def receive() -> dict:
        await gone.wait()
        return DISCONNECT
    return receive


def test_watch_cancels_the_block_when_the_client_leaves_and_takes_the_cancel_back() -> None:
    async def main() -> None:
        gone = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, gone.set)
        with ClientWatch(_receive_after(gone)) as watch:
            await asyncio.sleep(10)
        assert watch.gone and watch.left
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0.01)  # no cancellation left pending: the response can still be sent

    asyncio.run(asyncio.wait_for(main(), 5))


def test_watch_lets_work_that_finishes_go_on_and_is_not_cancelled_later() -> None:
    async def main() -> None:
        gone = asyncio.Event()
        with ClientWatch(_receive_after(gone)) as watch:
            await asyncio.sleep(0)
        gone.set()  # the client leaves after the work is done (a keep-alive close after the answer)
        await asyncio.sleep(0.02)
        assert not watch.gone and not watch.left
        # a disconnect that completes while the block is ending is not delivered after it either
        async def at_once() -> dict:
            return DISCONNECT
        with ClientWatch(at_once) as late:
            await asyncio.sleep(0)
        await asyncio.sleep(0.02)  # would raise CancelledError if the watch cancelled after its block
        assert late.left == late.gone

    asyncio.run(asyncio.wait_for(main(), 5))


def test_watch_does_not_swallow_a_cancel_from_elsewhere() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        async def receive() -> dict:
            # Server shutdown cancels the request right after the watch has cancelled it for the
            # disconnect: two hops put that cancel behind the watch's own done-callback.
            loop.call_soon(loop.call_soon, task.cancel)
            return DISCONNECT

        async def request() -> None:
            await started.wait()
            with ClientWatch(receive):
                await asyncio.sleep(10)

        task = asyncio.create_task(request())
        started.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    asyncio.run(asyncio.wait_for(main(), 5))


class SlowUpstream:
    """A raw-ASGI OpenAI upstream: answers slowly (or with an error) and notes the requests whose
    client (the gateway) went away before the answer."""

    def __init__(self) -> None:
        self.disconnected: list[bool] = []
        self.status = 200
        self.delay_s = 5.0
        self.seen = threading.Event()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - raw ASGI
        while (await receive()).get("more_body"):
            pass
        self.seen.set()
        if self.status != 200:
            body = json.dumps({"error": {"message": "slow down", "type": "rate_limit", "code": None}}).encode()
            await send({"type": "http.response.start", "status": self.status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            message = await asyncio.wait_for(receive(), self.delay_s)
            self.disconnected.append(message["type"] == "http.disconnect")
        except TimeoutError:
            self.disconnected.append(False)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture
def gateway(monkeypatch):
    monkeypatch.setenv("PG_TEST_UPSTREAM_KEY", "sk-up")
    upstream = SlowUpstream()
    tenancy = FakeTenancy()
    key = tenancy.add("acme")
    with LoopbackServer(Starlette(routes=[Mount("/", app=upstream)])) as up:  # Starlette: the lifespan
        route = RouteConfig(model="up", provider="openai/x", api_base=f"{up.url}/v1",
                            api_key_env="PG_TEST_UPSTREAM_KEY", transport="direct")
        with LoopbackServer(create_app(GatewaySettings(routes=(route,)), tenancy=tenancy)) as gw:
            yield gw.url, {"Authorization": f"Bearer {key}"}, upstream, tenancy


BODY = {"model": "up", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_the_upstream_request_and_is_accounted(gateway, stream: bool) -> None:
    url, headers, upstream, tenancy = gateway
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json={**BODY, "stream": stream}, headers=headers, timeout=0.5)
    assert wait_for(lambda: upstream.disconnected), "the upstream request was not closed"
    assert upstream.disconnected == [True]
    assert wait_for(lambda: tenancy.rows), "no ledger row after the disconnect"
    assert [r.status for r in tenancy.rows] == ["aborted"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_error_before_the_first_token_keeps_its_status(gateway, stream: bool) -> None:
    url, headers, upstream, tenancy = gateway
    upstream.status = 429
    r = httpx.post(f"{url}/v1/chat/completions", json={**BODY, "stream": stream}, headers=headers, timeout=10)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert [row.status for row in tenancy.rows] == ["error"]
