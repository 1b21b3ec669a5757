"""The attack harness, long variant: a real ``prefixgate serve`` under the issue-16 attacks and a few
hundred generated hostile bodies, while a probe keeps asking ``/health``.

Asserts: no 5xx and every 4xx in the OpenAI shape, ``/health`` always answers within a second, the
ledger keeps committing rows, and the server's resident memory stays bounded.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from request_strategies import CHAT_BASE, CHAT_FIELDS, COMPLETION_BASE, COMPLETION_FIELDS, bodies
from security_helpers import assert_openai_error, auth, make_home

from tests.serverutil import serve_tiny, stop

pytestmark = pytest.mark.slow

LONG = settings(max_examples=250, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class HealthProbe:
    """GET /health every 50 ms in a thread; keeps the slowest answer (a failed call counts as 99 s)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.calls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30.0, trust_env=False) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = http.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                took = time.perf_counter() - start if ok else 99.0
                self.slowest = max(self.slowest, took)
                self.calls += 1
                self._stop.wait(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:400])
    assert all(v.isascii() for v in r.headers.values()), dict(r.headers)
    if r.status_code != 200:
        assert_openai_error(r.json(), r.status_code)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home, keys = make_home(tmp_path_factory.mktemp("props-e2e"))
    from tenancy.service import TenancyService

    svc = TenancyService.open(home)
    try:
        keys["throttled"] = svc.create_tenant("throttled", rpm=3).api_key
        svc.flush()
    finally:
        svc.close()
    url, proc = serve_tiny(home)
    try:
        yield url, proc, keys
    finally:
        stop(proc)


def _post(http: httpx.Client, key: str, path: str, body: dict | bytes) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=raw, headers={**auth(key), "Content-Type": "application/json"})


def _ledger_requests(http: httpx.Client, admin: str) -> int:
    return int(http.get("/v1/usage", headers=auth(admin)).json()["totals"]["requests"])


def test_issue_16_attacks_leave_health_and_the_ledger_working(server) -> None:
    url, proc, keys = server
    with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as http, HealthProbe(url) as probe:
        rss_before = _rss_mib(proc.pid)
        before = _ledger_requests(http, keys["admin"])
        attacks = [
            (keys["acme"], "/v1/completions", {"model": "tiny", "prompt": ["a"] * 300_000, "max_tokens": 1}),
            (keys["throttled"], "/v1/completions", {"model": "tiny", "prompt": ["a"] * 60_000, "max_tokens": 1}),
            (keys["acme"], "/v1/chat/completions", {**CHAT_BASE, "messages": [{"role": "user",
                                                                                 "content": "x" * 3_900_000}]}),
            # under the character limit: tokenized (off the event loop), then too long for the context
            (keys["beta"], "/v1/chat/completions", {**CHAT_BASE, "messages": [{"role": "user",
                                                                                "content": "word " * 190_000}]}),
        ]
        threads = [threading.Thread(target=lambda a=a: _check(_post(http, *a))) for a in attacks * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in range(4):  # the throttled tenant's refusals counted: it is now rate limited
            last = _post(http, keys["throttled"], "/v1/chat/completions", CHAT_BASE)
        assert last.status_code == 429, last.text
        ok = _post(http, keys["acme"], "/v1/chat/completions", CHAT_BASE)
        assert ok.status_code == 200, ok.text
        assert _ledger_requests(http, keys["admin"]) > before
        rss_after = _rss_mib(proc.pid)
    assert probe.calls > 5 and probe.slowest < 1.0, (probe.calls, probe.slowest)
    assert rss_after < rss_before + 512, (rss_before, rss_after)


@pytest.mark.parametrize("path, base, fields", [
    ("/v1/chat/completions", CHAT_BASE, CHAT_FIELDS),
    ("/v1/completions", COMPLETION_BASE, COMPLETION_FIELDS),
], ids=["chat", "completions"])
def test_generated_bodies_against_a_real_server(server, path: str, base: dict, fields: dict) -> None:
    url, _, keys = server
    with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as http, HealthProbe(url) as probe:
        before = _ledger_requests(http, keys["admin"])

        @LONG
        @given(raw=bodies(base, fields))
        def run(raw: bytes) -> None:
            _check(_post(http, keys["beta"], path, raw))

        run()
        assert _post(http, keys["beta"], path, base).status_code == 200
        assert _ledger_requests(http, keys["admin"]) > before
    assert probe.slowest < 1.0, probe.slowest
