"""``TenantThreads``: one tenant's heavy steps queue behind each other, never in front of another tenant."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from gateway_fakes import FakeEngine, FakeTenancy, LoopbackServer

from gateway.app import create_app
from gateway.errors import OpenAIError
from gateway.settings import GatewaySettings
from gateway.tenant_threads import TenantThreads


def test_one_tenant_cannot_hold_every_worker() -> None:
    async def main() -> None:
        threads = TenantThreads(workers=2, per_tenant=1)
        release = threading.Event()
        running: list[str] = []
        lock = threading.Lock()

        def blocked(name: str) -> str:
            with lock:
                running.append(name)
            release.wait(10)
            return name

        hog = [asyncio.create_task(threads.run("hog", blocked, f"hog-{i}")) for i in range(3)]
        while not running:  # the hog's first job holds one worker
            await asyncio.sleep(0.01)
        # the other tenant still gets the second worker, while the hog's next jobs wait for the first
        assert await asyncio.wait_for(threads.run("quiet", lambda: "quiet"), 10) == "quiet"
        assert running == ["hog-0"]
        release.set()
        assert sorted(await asyncio.gather(*hog)) == ["hog-0", "hog-1", "hog-2"]

    asyncio.run(main())


def test_exceptions_come_back_and_bad_bounds_are_refused() -> None:
    async def main() -> None:
        with pytest.raises(ZeroDivisionError):
            await TenantThreads().run("t", lambda: 1 / 0)

    asyncio.run(main())
    with pytest.raises(ValueError):
        TenantThreads(workers=1, per_tenant=2)


def test_a_tenants_waiting_steps_are_bounded() -> None:
    """Past ``per_tenant`` running and ``queued_per_tenant`` waiting, a tenant's next step is refused
    at once (429, nothing queued); another tenant is served; the place frees when a step ends or its
    caller leaves."""
    async def main() -> None:
        threads = TenantThreads(workers=2, per_tenant=1, queued_per_tenant=2)
        release = threading.Event()

        def blocked() -> str:
            release.wait(10)
            return "done"

        held = [asyncio.create_task(threads.run("hog", blocked)) for _ in range(3)]
        while threads.pending("hog") < 3:
            await asyncio.sleep(0.01)
        with pytest.raises(OpenAIError) as refused:
            await threads.run("hog", blocked)
        assert refused.value.status == 429 and refused.value.code == "too_many_pending_requests"
        assert refused.value.headers == {"retry-after": "1"}
        assert threads.pending("hog") == 3
        assert await asyncio.wait_for(threads.run("quiet", lambda: "quiet"), 10) == "quiet"
        held[2].cancel()  # a waiting caller leaves: its place is free again
        await asyncio.gather(held[2], return_exceptions=True)
        assert threads.pending("hog") == 2
        again = asyncio.create_task(threads.run("hog", blocked))
        await asyncio.sleep(0.05)
        release.set()
        assert await asyncio.gather(held[0], held[1], again) == ["done"] * 3
        assert threads.pending("hog") == 0

    asyncio.run(main())


class HeldTokenizer(FakeEngine):
    """Tokenizing (in the gateway's worker thread) waits for ``release`` once ``holding`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.holding = threading.Event(), threading.Event()

    def tokenize(self, request):
        self.holding.set()
        self.release.wait(10)
        return super().tokenize(request)


def test_a_full_tenant_queue_reaches_the_client_as_a_429():
    """The pool's refusal is a 429 with its code and Retry-After through the chat door, not wrapped
    into the 400 a template error gets; the refusal gets its ledger row."""
    engine, tenancy = HeldTokenizer(), FakeTenancy()
    key = tenancy.add("acme")
    settings = GatewaySettings(worker_threads=2, worker_queue_per_tenant=0)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    with LoopbackServer(create_app(settings, engine=engine, tenancy=tenancy)) as srv, ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, f"{srv.url}/v1/chat/completions", json=chat, headers=headers, timeout=30)
        assert engine.holding.wait(10)  # the tenant's one slot is taken
        refused = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, headers=headers, timeout=30)
        engine.release.set()
        assert first.result().status_code == 200
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_pending_requests"
    assert [row.status for row in tenancy.rows].count("error") == 1
