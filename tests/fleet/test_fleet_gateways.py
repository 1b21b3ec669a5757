"""Two real gateways on one PostgreSQL and one Redis: limits, revocation, shared ledger, a Redis outage."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fleet.fleet_harness import AUTH_TTL_S, Fleet, ask, start_fleet
from tests.fleetutil import PostgresServer, RedisServer, started
from tests.serverutil import REPO, error_lines, scrape


@pytest.fixture(scope="module")
def own_redis():
    """This module's Redis: the outage test stops and restarts it."""
    server = started(RedisServer)
    yield server
    server.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, postgres_server: PostgresServer, own_redis: RedisServer):
    pytest.importorskip("redis", reason="redis (redis-py) is not installed (pip install 'prefixgate[fleet]')")
    f = start_fleet(tmp_path_factory.mktemp("fleet"), postgres_server.new_database(), own_redis.url)
    yield f
    f.stop()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10, trust_env=False).json()


def test_both_gateways_say_they_run_on_postgresql_and_redis(fleet: Fleet) -> None:
    for url in fleet.urls:
        assert _health(url) | {"engine": True} == {
            "status": "ok", "engine": True, "database": "postgresql", "limits": "redis",
            "redis": {"connected": True, "fallback_admissions": 0, "last_error": None}}


def test_rpm_10_gives_exactly_10_successes_across_both_gateways_under_a_burst(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        key = admin.create_tenant("burst", rpm=10).api_key
    targets = [fleet.urls[i % 2] for i in range(24)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        statuses = list(pool.map(lambda url: ask(url, key), targets))
    assert statuses.count(200) == 10 and statuses.count(429) == 14, statuses
    per_gateway = [sum(1 for u, s in zip(targets, statuses) if u == url and s == 200) for url in fleet.urls]
    assert sum(per_gateway) == 10  # either may have won them; together never more than one gateway's limit


def test_a_key_revoked_on_one_side_fails_on_the_other_well_within_the_ttl(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        created = admin.create_tenant("revoked")
    assert [ask(url, created.api_key) for url in fleet.urls] == [200, 200]  # cached on both for 30 s
    done = fleet.cli("key", "revoke", created.key_id)
    assert done.returncode == 0, done.stderr
    revoked_at = time.monotonic()
    while any(ask(url, created.api_key) != 401 for url in fleet.urls):
        assert time.monotonic() - revoked_at < AUTH_TTL_S / 3, "revocation did not reach both gateways"
        time.sleep(0.1)


def test_ledger_rows_of_both_gateways_are_in_one_report(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        key = admin.create_tenant("ledger").api_key
        ops = admin.create_tenant("ledger-ops", admin=True).api_key
    for i in range(6):
        assert ask(fleet.urls[i % 2], key, f"question {i}") == 200
    deadline = time.monotonic() + 10
    while True:  # each gateway commits its rows within its batching delay
        usage = httpx.get(f"{fleet.urls[1]}/v1/usage", params={"tenant": "ledger", "since": "1h"},
                          headers={"Authorization": f"Bearer {ops}"}, timeout=30, trust_env=False).json()
        if usage["totals"]["requests"] == 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert usage["totals"]["requests"] == 6  # read on gateway 1, half of them written by gateway 0
    report = fleet.cli("report", "--tenant", "ledger", "--since", "1h", "--format", "json")
    assert report.returncode == 0, report.stderr
    assert '"requests": 6' in report.stdout


def test_redis_stopped_then_restarted_during_load(fleet: Fleet, own_redis: RedisServer) -> None:
    with fleet.admin() as admin:
        key = admin.create_tenant("outage").api_key
    statuses: list[int] = []
    stop = threading.Event()

    def load(url: str) -> None:
        while not stop.is_set():
            statuses.append(ask(url, key))

    threads = [threading.Thread(target=load, args=(url,)) for url in fleet.urls]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        own_redis.stop()
        _until(lambda: all(_health(u)["status"] == "degraded" for u in fleet.urls), "never said degraded")
        down = _health(fleet.urls[0])
        assert down["limits"] == "local" and down["redis"]["connected"] is False and down["redis"]["last_error"]
        assert "prefixgate_redis_up 0.0" in scrape(fleet.urls[0])
        served_while_down = len(statuses)
        time.sleep(1.5)
        assert len(statuses) > served_while_down  # still serving without Redis
        own_redis.start()
        _until(lambda: all(_health(u)["status"] == "ok" and _health(u)["limits"] == "redis" for u in fleet.urls),
               "did not recover after Redis came back")
        assert "prefixgate_redis_up 1.0" in scrape(fleet.urls[1])
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert statuses and set(statuses) == {200}, sorted(set(statuses))


def test_an_unreachable_database_url_fails_serve_with_one_line_and_exit_2(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(tmp_path / "h"), "--model", "none",
         "--database-url", "postgresql://prefixgate@127.0.0.1:1/prefixgate"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("prefixgate: error: cannot connect to PostgreSQL at "), lines


def _until(check, message: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(message)
