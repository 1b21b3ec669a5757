"""SIGTERM drains a real ``prefixgate serve``: streams within the grace period finish, the rest end
cleanly, and every request has its ledger row before the process exits (audit: operator finding 1).

One server (tiny model, ``--shutdown-grace-s 6``) answers two streams when it gets SIGTERM: a short
one, sized from the measured token rate to finish well inside the grace period, completes with its
usage and ``[DONE]``; a long one (``ignore_eos``, thousands of tokens) is stopped when the grace
period is over and ends with an in-band ``server_shutting_down`` error event and ``[DONE]``. The
SQLite ledger then has an ``ok`` row for the first and an ``aborted`` row, tokens billed, for the
second. Before the fix the long stream was cut without an end after 5 s and had no row at all.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tenancy.service import TenancyService
from tests.gateway.gateway_fakes import FakeEngine, FakeTenancy
from tests.serverutil import serve_tiny, wait_for

GRACE_S = 6.0


@dataclass
class LongStream:
    """A stream far longer than the grace period, read frame by frame over plain HTTP."""

    frames: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    ended_at: float | None = None
    failure: BaseException | None = None

    def run(self, url: str, key: str) -> None:
        body = {"model": "tiny", "max_tokens": 6000, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "Tell a very long story."}]}
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60, trust_env=False,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.frames.append(line.removeprefix("data: "))
                        self.arrivals.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - the main thread asserts on it
            self.failure = exc
        self.ended_at = time.monotonic()

    def tokens_per_s(self) -> float:
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])


@dataclass
class ShortStream:
    """A stream that fits in the grace period, through the openai SDK."""

    max_tokens: int
    chunks: list[openai.types.chat.ChatCompletionChunk] = field(default_factory=list)
    ended_at: float | None = None
    failure: BaseException | None = None

    def run(self, client: openai.OpenAI) -> None:
        try:
            stream = client.chat.completions.create(
                model="tiny", max_tokens=self.max_tokens, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": "A short answer."}])
            for chunk in stream:
                self.chunks.append(chunk)
        except BaseException as exc:  # noqa: BLE001 - the main thread asserts on it
            self.failure = exc
        self.ended_at = time.monotonic()


def _refuses_connections(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1.0, trust_env=False)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def _ledger(home) -> dict[str, tuple[str, int, int]]:
    with sqlite3.connect(home / "prefixgate.db") as conn:
        rows = conn.execute("SELECT request_id, status, prompt_tokens, completion_tokens FROM usage").fetchall()
    return {rid: (status, prompt, completion) for rid, status, prompt, completion in rows}


def test_sigterm_drains_streams_and_writes_every_ledger_row(tmp_path):
    with TenancyService.open(tmp_path) as svc:
        key = svc.create_tenant("acme").api_key
        svc.flush()
    url, server = serve_tiny(tmp_path, "--shutdown-grace-s", str(GRACE_S))
    try:
        long = LongStream()
        threading.Thread(target=long.run, args=(url, key), daemon=True).start()
        assert wait_for(lambda: len(long.frames) >= 30, timeout=60), (long.frames, long.failure)
        # about 1.5 s of tokens at the measured rate: it is still running at SIGTERM and ends in the grace
        short = ShortStream(max_tokens=max(20, min(2000, int(1.5 * long.tokens_per_s()))))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        threading.Thread(target=short.run, args=(client,), daemon=True).start()
        assert wait_for(lambda: len(short.chunks) >= 2, timeout=30), short.failure
        server.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        assert wait_for(lambda: _refuses_connections(url), timeout=5)  # it stopped listening at once
        closed_at = time.monotonic()
        # uvicorn re-raises the signal it caught once its shutdown is done: "killed by SIGTERM", on time
        assert server.wait(timeout=GRACE_S + 20) in (0, -signal.SIGTERM)
        exited_at = time.monotonic()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()

    # The short stream was in flight while the server drained, and it is complete.
    assert short.failure is None, short.failure
    assert short.ended_at is not None and short.ended_at > closed_at
    assert short.chunks[-1].usage is not None and short.chunks[-1].usage.completion_tokens == short.max_tokens
    assert [c.choices[0].finish_reason for c in short.chunks if c.choices][-1] == "length"

    # The long one ran until the grace period was over, then ended with an error event and [DONE].
    assert long.failure is None, long.failure
    assert long.ended_at is not None and long.ended_at - sigterm_at > GRACE_S - 1.0
    assert long.frames[-1] == "[DONE]"
    error = json.loads(long.frames[-2])["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    assert exited_at - long.ended_at < 10.0

    rows = _ledger(tmp_path)
    short_id, long_id = short.chunks[0].id, json.loads(long.frames[0])["id"]
    assert rows[short_id] == ("ok", rows[short_id][1], short.max_tokens)
    status, prompt, completion = rows[long_id]
    assert status == "aborted" and prompt > 0
    assert completion >= len(long.frames) - 3  # the tokens it was sent are billed (role, error, [DONE])


@pytest.fixture
def app_with_fakes(tmp_path):
    tenancy = FakeTenancy()
    key = tenancy.add("acme")
    settings = GatewaySettings(model="tiny", home=tmp_path)
    return create_app(settings, engine=FakeEngine(delay_s=0.0), tenancy=tenancy), key


def test_draining_server_says_so_on_health_and_refuses_new_requests(app_with_fakes):
    app, key = app_with_fakes
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        app.state.inflight.begin_draining()
        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "draining", "inflight": 0}
        refused = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}


def test_an_app_started_again_after_a_shutdown_serves(app_with_fakes):
    """A shutdown leaves the app draining; the next lifespan (an embedding host restarting it, a test
    client per test) must serve again, not refuse every request as shutting down."""
    app, key = app_with_fakes
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        with TestClient(app) as client:
            assert client.get("/health").status_code == 200
            answer = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=chat)
            assert answer.status_code == 200, answer.text
        assert app.state.inflight.draining  # the lifespan's end drained it
