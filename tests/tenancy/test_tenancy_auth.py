"""API keys: only a hash is stored, wrong/malformed/revoked keys fail, revocation within the TTL."""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path

import pytest

from engine.protocol import BlockCipher, TenantScope
from tenancy.errors import AuthenticationError
from tenancy.keys import ServerSecret, parse_key_id
from tenancy.service import TenancyService
from tests.fleetutil import read_rows


def test_created_key_authenticates_and_context_is_a_tenant_scope(svc: TenancyService) -> None:
    created = svc.create_tenant("acme", canon_mode="reorder", per_user_vars=["user_name"], priority=3)
    ctx = svc.authenticate(created.api_key)
    assert (ctx.tenant_id, ctx.name, ctx.key_id) == (created.tenant_id, "acme", created.key_id)
    assert ctx.canon_mode == "reorder" and ctx.per_user_vars == ("user_name",) and ctx.priority == 3
    assert isinstance(ctx, TenantScope)
    assert isinstance(ctx.cipher, BlockCipher)
    assert created.api_key.startswith(f"pg-{created.key_id}_")
    assert len(ctx.namespace) == 32


def _store_files_bytes(svc: TenancyService, home: Path, request: pytest.FixtureRequest) -> bytes:
    """Every byte the store has written for this test: the SQLite file (and its WAL), or, on PostgreSQL,
    the database's own directory and the cluster's write-ahead log after a checkpoint (the server's files,
    as a stolen disk would show them)."""
    if svc.database.kind == "sqlite":
        return b"".join(p.read_bytes() for p in home.iterdir() if p.name.startswith("prefixgate.db"))
    server = request.getfixturevalue("postgres_server")
    (row,) = read_rows(svc, "SELECT oid FROM pg_database WHERE datname = current_database()")
    import psycopg

    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute("CHECKPOINT")  # the rows reach the table's files, not only the WAL and shared buffers
    data = server.dir / "data"
    files = [p for d in (data / "base" / str(row["oid"]), data / "pg_wal") for p in d.rglob("*") if p.is_file()]
    assert files, f"no PostgreSQL files under {data}"
    return b"".join(p.read_bytes() for p in files)


def test_only_a_peppered_hash_of_the_key_is_stored(svc: TenancyService, home: Path,
                                                   request: pytest.FixtureRequest) -> None:
    created = svc.create_tenant("acme")
    (row,) = read_rows(svc, "SELECT key_hash FROM api_keys WHERE key_id = ?", [created.key_id])
    stored = bytes(row["key_hash"])
    raw = _store_files_bytes(svc, home, request)
    svc.close()
    # the hash is in the files (so the search below reads the right bytes), the key is not
    assert stored in raw
    assert created.api_key.encode() not in raw
    secret_part = created.api_key.split("_", 1)[1].encode()
    assert secret_part not in raw
    pepper = ServerSecret.load(home).pepper
    assert stored == hmac.new(pepper, created.api_key.encode(), hashlib.sha256).digest()
    # a plain unpeppered SHA-256 is not what is stored (a stolen db alone cannot test guesses)
    assert stored != hashlib.sha256(created.api_key.encode()).digest()


@pytest.mark.parametrize("bad", [None, "", "sk-abc", "pg-zzzzzzzz_" + "a" * 43, "pg-1234"])
def test_missing_or_malformed_keys_are_rejected(svc: TenancyService, bad: str | None) -> None:
    with pytest.raises(AuthenticationError) as err:
        svc.authenticate(bad)
    assert err.value.status == 401 and err.value.code == "invalid_api_key"


def test_a_wrong_secret_with_a_real_key_id_is_rejected_without_echoing_it(svc: TenancyService) -> None:
    created = svc.create_tenant("acme")
    forged = created.api_key[:-4] + ("AAAA" if not created.api_key.endswith("AAAA") else "BBBB")
    with pytest.raises(AuthenticationError) as err:
        svc.authenticate(forged)
    assert forged not in str(err.value) and f"pg-{created.key_id}" in str(err.value)
    assert parse_key_id(forged) == created.key_id


@pytest.mark.parametrize("bad, shown, hidden", [
    ("hunter2", "****.", "hunter"),  # short: nothing of it
    ("sk-proj-SUPERSECRET0123456789abcd", "****abcd.", "sk-proj-SUP"),  # foreign: its last 4 at most
    ("pg-1a2b3c4d_short", "****hort.", "pg-1a2b"),  # our prefix but not our shape: a foreign key
    ("hunter2hunte", "****unte.", "hunter2"),  # 12 characters: the last 4 are a third
    ("hunter2hunt", "****.", "hunt"),  # 11: a third is less than 4
])
def test_a_bad_key_is_echoed_at_most_by_a_third_of_it(svc: TenancyService, bad: str, shown: str, hidden: str) -> None:
    """Audit finding 6: the first 11 characters of any key were echoed, so a short secret came back whole."""
    with pytest.raises(AuthenticationError) as err:
        svc.authenticate(bad)
    message = str(err.value)
    assert message.endswith(shown) and hidden not in message, message


def test_revocation_through_the_service_is_immediate(svc: TenancyService) -> None:
    created = svc.create_tenant("acme")
    svc.authenticate(created.api_key)  # now cached
    svc.revoke_key(created.key_id)
    with pytest.raises(AuthenticationError, match="revoked"):
        svc.authenticate(created.api_key)


def test_revocation_by_another_process_takes_effect_within_the_ttl(home: Path, open_service) -> None:
    gateway = open_service(home, auth_cache_ttl_s=1.0)  # generous: CI machines are loaded
    admin_cli = open_service(home)
    try:
        created = admin_cli.create_tenant("acme")
        second = admin_cli.create_key("acme")
        gateway.authenticate(created.api_key)
        admin_cli.revoke_key(f"pg-{created.key_id}")  # the visible prefix works as an id too
        gateway.authenticate(created.api_key)  # still cached: within the TTL this is allowed
        time.sleep(1.05)
        with pytest.raises(AuthenticationError, match="revoked"):
            gateway.authenticate(created.api_key)
        assert gateway.authenticate(second.api_key).tenant_id == created.tenant_id  # other keys unaffected
        keys = {k.key_id: k for k in admin_cli.list_keys("acme")}
        assert not keys[created.key_id].active and keys[second.key_id].active
    finally:
        gateway.close()
        admin_cli.close()


def test_deleted_tenant_keys_stop_working(svc: TenancyService) -> None:
    created = svc.create_tenant("acme")
    svc.authenticate(created.api_key)
    svc.delete_tenant("acme")
    with pytest.raises(AuthenticationError):
        svc.authenticate(created.api_key)
    assert svc.get_tenant_by_name("acme") is None


def test_state_files_are_owner_only(svc: TenancyService, home: Path) -> None:
    svc.create_tenant("acme")
    files = ("kek.key", "server.secret") + (("prefixgate.db",) if svc.database.kind == "sqlite" else ())
    for name in files:
        assert (home / name).stat().st_mode & 0o777 == 0o600, name
