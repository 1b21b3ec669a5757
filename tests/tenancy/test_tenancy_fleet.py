"""Several gateways on one PostgreSQL and one Redis, at the service level (real servers on loopback)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from tenancy.db import SCHEMA_VERSION
from tenancy.errors import AuthenticationError, KeyMaterialError, QuotaExceededError
from tenancy.service import DatabaseUnavailableError, TenancyService
from tenancy.types import UsageRecord
from tests.fleetutil import PostgresServer, RedisServer, read_rows, started


def _fleet_home(tmp_path: Path, name: str, first: Path | None) -> Path:
    """A gateway's own --home; later gateways get the first one's KEK and server secret (as operators copy them)."""
    home = tmp_path / name
    home.mkdir()
    if first is not None:
        for secret in ("kek.key", "server.secret"):
            shutil.copy2(first / secret, home / secret)
    return home


def _usage(ctx, rid: str, model: str = "gpt-4o", prompt: int = 1000) -> UsageRecord:
    return UsageRecord(rid, ctx.tenant_id, ctx.key_id, model, "openai", prompt, 0, 10, 0.01, 0.1, "ok", time.time())


# -- PostgreSQL -------------------------------------------------------------------------------------


def test_two_gateways_with_their_own_homes_share_tenants_keys_and_the_ledger(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    url = postgres_server.new_database()
    a = TenancyService.open(_fleet_home(tmp_path, "a", None), database_url=url)
    b = TenancyService.open(_fleet_home(tmp_path, "b", a.home), database_url=url)
    try:
        created = a.create_tenant("acme", rpm=100)
        ctx_b = b.authenticate(created.api_key)  # made on a, accepted by b
        assert ctx_b.tenant_id == created.tenant_id
        assert ctx_b.namespace == a.authenticate(created.api_key).namespace  # one cache namespace fleet-wide
        assert ctx_b.cipher.owner == a.authenticate(created.api_key).cipher.owner
        a.record_usage(_usage(ctx_b, "from-a"))
        b.record_usage(_usage(ctx_b, "from-b"))
        b.record_usage(_usage(ctx_b, "from-a"))  # a retried record on the other gateway: stored once
        a.flush()
        b.flush()
        for gateway in (a, b):  # reports read the shared ledger from either gateway
            assert gateway.report()["totals"]["requests"] == 2
        assert [v["version"] for v in read_rows(a, "SELECT version FROM schema_version ORDER BY version")] == list(range(1, SCHEMA_VERSION + 1))
    finally:
        a.close()
        b.close()


def test_a_gateway_with_another_server_secret_fails_start_up_with_one_line(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    url = postgres_server.new_database()
    first = TenancyService.open(_fleet_home(tmp_path, "a", None), database_url=url)
    first.close()
    stranger = _fleet_home(tmp_path, "b", None)
    shutil.copy2(first.home / "kek.key", stranger / "kek.key")  # the KEK is right, the server secret is not
    with pytest.raises(KeyMaterialError, match="server secret") as err:
        TenancyService.open(stranger, database_url=url)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("url, words", [
    ("postgresql://prefixgate@127.0.0.1:1/nothing", "cannot connect to PostgreSQL at postgresql://prefixgate@127.0.0.1:1"),
    ("mysql://x@127.0.0.1/db", "use postgresql://"),
    ("sqlite://relative.db", "sqlite:///ABSOLUTE"),
])
def test_an_unreachable_or_wrong_database_url_is_one_clear_error(tmp_path: Path, url: str, words: str) -> None:
    with pytest.raises(DatabaseUnavailableError) as err:
        TenancyService.open(tmp_path / "h", database_url=url)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_password_never_appears_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(DatabaseUnavailableError) as err:
        TenancyService.open(tmp_path / "h", database_url="postgresql://u:hunter2@127.0.0.1:1/db")
    assert "hunter2" not in str(err.value) and "u:***@" in str(err.value)


def test_concurrent_ledger_writers_on_postgresql_store_each_request_once(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    """Four gateways write overlapping request ids at once: every id once, no error, nothing quarantined."""
    url = postgres_server.new_database()
    first = TenancyService.open(_fleet_home(tmp_path, "g0", None), database_url=url, ledger_max_delay_s=0.001)
    gateways = [first] + [TenancyService.open(_fleet_home(tmp_path, f"g{i}", first.home), database_url=url,
                                              ledger_max_delay_s=0.001) for i in (1, 2, 3)]
    try:
        ctx = first.authenticate(first.create_tenant("acme").api_key)

        def write(g: TenancyService, offset: int) -> None:
            for i in range(300):
                g.record_usage(_usage(ctx, f"r{(i + offset) % 500}"))

        threads = [threading.Thread(target=write, args=(g, 100 * n)) for n, g in enumerate(gateways)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for g in gateways:
            g.flush()
        ids = [r["request_id"] for r in read_rows(first, "SELECT request_id FROM usage")]
        assert len(ids) == len(set(ids)) == 500
        for g in gateways:
            stats = g.ledger_stats()
            assert stats.quarantined == stats.spilled == stats.lost == 0
    finally:
        for g in gateways:
            g.close()


def test_migrations_apply_once_when_gateways_start_together(tmp_path: Path, postgres_server: PostgresServer) -> None:
    url = postgres_server.new_database()
    first = TenancyService.open(_fleet_home(tmp_path, "g0", None), database_url=url)
    first.close()
    url2 = postgres_server.new_database()  # a fresh database: every starter races to migrate it
    errors: list[BaseException] = []
    opened: list[TenancyService] = []

    def start(i: int) -> None:
        try:
            opened.append(TenancyService.open(_fleet_home(tmp_path, f"s{i}", first.home), database_url=url2))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert [v["version"] for v in read_rows(opened[0], "SELECT version FROM schema_version")] == list(range(1, SCHEMA_VERSION + 1))
    finally:
        for s in opened:
            s.close()


def test_the_ledger_rides_out_a_postgresql_restart_and_the_request_path_reconnects(tmp_path: Path) -> None:
    """Rows recorded while the server is down are spilled to the home's quarantine file and replayed
    once it is back; authentication works again without a restart of the gateway."""
    try:
        own = PostgresServer().start()  # this test stops its server: not the shared one
    except Exception as exc:  # noqa: BLE001 - the shared fixture already skips when PostgreSQL is absent
        pytest.skip(f"PostgreSQL unavailable: {exc}")
    try:
        # TTL 0: every authentication reads the database, on the connection that saw the restart
        svc = TenancyService.open(tmp_path / "a", database_url=own.new_database(), ledger_max_delay_s=0.01,
                                  auth_cache_ttl_s=0.0)
        try:
            created = svc.create_tenant("acme")
            ctx = svc.authenticate(created.api_key)
            svc.record_usage(_usage(ctx, "before"))
            svc.flush()
            own.halt()
            svc.record_usage(_usage(ctx, "during"))
            svc.flush()  # bounded retries, then the quarantine file
            assert svc.ledger_stats().spilled == 1 and (tmp_path / "a" / "ledger-quarantine.jsonl").exists()
            own.resume()
            svc.record_usage(_usage(ctx, "after"))
            svc.flush()  # the next batch that commits brings back what was spilled
            ids = {r["request_id"] for r in read_rows(svc, "SELECT request_id FROM usage")}
            assert ids == {"before", "during", "after"} and svc.ledger_stats().replayed == 1
            assert svc.authenticate(created.api_key).tenant_id == created.tenant_id
        finally:
            svc.close()
    finally:
        own.stop()


# -- Redis ------------------------------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path, postgres_server: PostgresServer, redis_server: RedisServer):
    """Two gateways on one PostgreSQL and one Redis, with an auth-cache TTL long enough to tell pub/sub from expiry."""
    url = postgres_server.new_database()
    a = TenancyService.open(_fleet_home(tmp_path, "a", None), database_url=url, redis_url=redis_server.url,
                            auth_cache_ttl_s=60.0)
    b = TenancyService.open(_fleet_home(tmp_path, "b", a.home), database_url=url, redis_url=redis_server.url,
                            auth_cache_ttl_s=60.0)
    yield a, b
    a.close()
    b.close()


def test_rpm_is_enforced_once_across_gateways_under_a_concurrent_burst(pair) -> None:
    a, b = pair
    created = a.create_tenant("acme", rpm=10)
    ctxs = [a.authenticate(created.api_key), b.authenticate(created.api_key)]
    admitted: list[int] = []
    refused: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def burst(n: int) -> None:
        g, ctx = (a, ctxs[0]) if n % 2 == 0 else (b, ctxs[1])
        start.wait()
        for _ in range(5):
            try:
                g.admit(ctx, estimated_tokens=1)
                with lock:
                    admitted.append(n)
            except QuotaExceededError as exc:
                with lock:
                    refused.append(exc.kind)

    threads = [threading.Thread(target=burst, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 10 and len(refused) == 30 and set(refused) == {"rate"}
    assert {n % 2 for n in admitted} <= {0, 1}
    assert a.fleet_status().shared_limits.fallbacks == b.fleet_status().shared_limits.fallbacks == 0


def test_tpm_is_shared_and_a_request_larger_than_the_limit_never_fits(pair) -> None:
    a, b = pair
    created = a.create_tenant("acme", tpm=1000)
    ca, cb = a.authenticate(created.api_key), b.authenticate(created.api_key)
    a.admit(ca, estimated_tokens=600)
    with pytest.raises(QuotaExceededError) as err:
        b.admit(cb, estimated_tokens=600)  # 400 left fleet-wide
    assert err.value.kind == "tokens" and err.value.retry_after_s > 0
    b.admit(cb, estimated_tokens=400)
    with pytest.raises(QuotaExceededError) as err:
        b.admit(cb, estimated_tokens=1001)
    assert err.value.retry_after_s is None


def test_a_budget_spent_on_one_gateway_stops_the_other_at_once(pair) -> None:
    """The ledger refresh waits for the 60 s TTL; the Redis counter does not."""
    a, b = pair
    created = a.create_tenant("acme", budget_usd=0.001, budget_period="month")
    ca, cb = a.authenticate(created.api_key), b.authenticate(created.api_key)
    b.admit(cb, estimated_tokens=1)  # b has read the (empty) ledger and caches it for the TTL
    a.record_usage(_usage(ca, "spend-1"))  # gpt-4o, 1000 prompt tokens: more than $0.001
    with pytest.raises(QuotaExceededError) as err:
        b.admit(cb, estimated_tokens=1)
    assert err.value.kind == "budget"


def test_revocation_and_deletion_reach_the_other_gateway_well_within_the_ttl(pair) -> None:
    a, b = pair
    created = a.create_tenant("acme")
    other = a.create_tenant("other")
    b.authenticate(created.api_key)
    b.authenticate(other.api_key)  # both cached on b for 60 s
    a.revoke_key(created.key_id)
    _eventually(lambda: _refused(b, created.api_key), "revoked key still accepted by the other gateway")
    a.delete_tenant("other")
    _eventually(lambda: _refused(b, other.api_key), "deleted tenant's key still accepted by the other gateway")


def test_redis_away_means_local_limits_and_a_degraded_status_then_recovery(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    own = started(RedisServer)  # this test stops it: not the shared one
    url = postgres_server.new_database()
    svc = TenancyService.open(_fleet_home(tmp_path, "a", None), database_url=url, redis_url=own.url)
    try:
        ctx = svc.authenticate(svc.create_tenant("acme", rpm=1000).api_key)
        svc.admit(ctx, estimated_tokens=1)
        assert svc.fleet_status().degraded is False
        own.stop()
        svc.admit(ctx, estimated_tokens=1)  # still admitted, by the local bucket
        status = svc.fleet_status()
        assert status.degraded and status.shared_limits.fallbacks >= 1
        assert "Connection" in (status.shared_limits.last_error or "")
        own.start()
        _eventually(lambda: (svc.admit(ctx, estimated_tokens=1), not svc.fleet_status().degraded)[1],
                    "did not go back to Redis after it returned")
    finally:
        svc.close()
        own.close()


def test_an_unreachable_redis_at_start_is_not_fatal(tmp_path: Path) -> None:
    svc = TenancyService.open(tmp_path / "h", redis_url="redis://127.0.0.1:1/0")
    try:
        ctx = svc.authenticate(svc.create_tenant("acme", rpm=2).api_key)
        svc.admit(ctx, estimated_tokens=1)
        svc.admit(ctx, estimated_tokens=1)
        with pytest.raises(QuotaExceededError):  # the local bucket still limits
            svc.admit(ctx, estimated_tokens=1)
        assert svc.fleet_status().degraded
    finally:
        svc.close()


def _refused(svc: TenancyService, key: str) -> bool:
    try:
        svc.authenticate(key)
    except AuthenticationError:
        return True
    return False


def _eventually(check, message: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(message)
