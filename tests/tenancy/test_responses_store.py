"""Stored Responses-API responses on both stores (SQLite and PostgreSQL): keyed on (id, tenant),
sealed with the tenant's data key, gone with the tenant; and the tenant's cache_retention_s."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tenancy import responses
from tenancy.service import AuthenticationError, TenancyService
from tests.fleetutil import read_rows


def test_a_response_is_its_tenants_only_sealed_and_deleted_with_it(svc: TenancyService) -> None:
    a = svc.authenticate(svc.create_tenant("a").api_key)
    b = svc.authenticate(svc.create_tenant("b").api_key)
    body = {"response": {"id": "resp_1", "output_text": "the secret answer"}, "messages": []}
    svc.save_response(a, "resp_1", body)
    assert svc.load_response(a, "resp_1") == body
    assert svc.load_response(b, "resp_1") is None  # another tenant that learns the id finds nothing
    assert svc.delete_response(b, "resp_1") is False
    svc.save_response(b, "resp_1", {"response": {"id": "resp_1"}})  # a colliding id never overwrites a's row
    assert svc.load_response(a, "resp_1") == body
    rows = read_rows(svc, "SELECT tenant_id, body FROM responses")
    assert len(rows) == 1 and b"secret" not in bytes(rows[0]["body"])
    body2 = {**body, "messages": [{"role": "user", "content": "again"}]}
    svc.save_response(a, "resp_1", body2)  # the same tenant re-saving replaces its own row
    assert svc.load_response(a, "resp_1") == body2
    assert svc.delete_response(a, "resp_1") is True and svc.load_response(a, "resp_1") is None
    svc.save_response(a, "resp_2", body)
    svc.delete_tenant("a")
    assert read_rows(svc, "SELECT id FROM responses") == []


def test_cache_retention_setting_round_trips(svc: TenancyService) -> None:
    key = svc.create_tenant("acme", cache_retention_s=3600).api_key
    assert svc.authenticate(key).cache_retention_s == 3600.0
    svc.update_tenant("acme", cache_retention_s=None)
    assert svc.get_tenant_by_name("acme").cache_retention_s is None


def test_saving_for_a_tenant_deleted_by_another_process_is_an_unknown_key(
        home: Path, open_service: Callable[..., TenancyService]) -> None:
    """The gateway still holds the key in its auth cache when the CLI deletes the tenant: saving a
    response is then an AuthenticationError (a 401), never a foreign-key failure, and no data key
    is made again for the deleted tenant."""
    gateway, cli = open_service(home, auth_cache_ttl_s=60), open_service(home)
    try:
        ctx = gateway.authenticate(cli.create_tenant("gone").api_key)
        gateway.save_response(ctx, "resp_1", {"response": {"id": "resp_1"}})
        cli.delete_tenant("gone")
        with pytest.raises(AuthenticationError, match="tenant has been deleted"):
            gateway.save_response(ctx, "resp_2", {"response": {"id": "resp_2"}})
        assert read_rows(gateway, "SELECT id FROM responses") == []
        assert read_rows(gateway, "SELECT owner FROM data_keys WHERE owner = ?", [f"tenant:{ctx.tenant_id}"]) == []
    finally:
        gateway.close()
        cli.close()


@pytest.mark.parametrize("share_scope", ["tenant", "group:team"])
def test_reading_or_deleting_for_a_deleted_tenant_makes_no_data_key_again(
        home: Path, open_service: Callable[..., TenancyService], share_scope: str) -> None:
    """Audit finding 2: the CLI deletes the tenant while the gateway still caches its key. The
    gateway's in-memory data key is then gone (a sweep dropped it, or, in a share group, the tenant's
    own key was never loaded): GET / DELETE of a stored response and ``previous_response_id`` must be
    a 401 like any unknown key, and must not create a new data key row for the deleted tenant."""
    gateway, cli = open_service(home, auth_cache_ttl_s=60), open_service(home)
    try:
        ctx = gateway.authenticate(cli.create_tenant("gone", share_scope=share_scope).api_key)
        cli.delete_tenant("gone")
        with pytest.raises(AuthenticationError):
            gateway.authenticate("pg-00000000_" + "x" * 43)  # a miss sweeps the in-memory keys of deleted owners
        own_key = [f"tenant:{ctx.tenant_id}"]
        for call in (gateway.load_response, gateway.delete_response):
            with pytest.raises(AuthenticationError, match="tenant has been deleted"):
                call(ctx, "resp_1")
            assert read_rows(gateway, "SELECT owner FROM data_keys WHERE owner = ?", own_key) == []
        assert own_key[0] not in gateway._ciphers  # and no key material is kept in memory for it
    finally:
        gateway.close()
        cli.close()


@pytest.mark.parametrize("step", ["seal", "open_body"])
def test_sealing_and_opening_run_outside_the_service_lock(svc: TenancyService, monkeypatch, step: str) -> None:
    """A stored conversation can be megabytes of JSON to seal or open. The service's lock is the one
    an authentication miss and a budget check take on the event loop, so while one tenant's body is
    being sealed (or opened) another tenant's first request authenticates without waiting for it."""
    a = svc.authenticate(svc.create_tenant("a").api_key)
    key_b = svc.create_tenant("b").api_key
    svc.save_response(a, "resp_1", {"response": {"id": "resp_1"}})
    inside, release = threading.Event(), threading.Event()
    real = getattr(responses, step)

    def held(*args: object) -> object:
        inside.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(responses, step, held)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        if step == "seal":
            pending = pool.submit(svc.save_response, a, "resp_2", {"response": {"id": "resp_2"}})
        else:
            pending = pool.submit(svc.load_response, a, "resp_1")
        assert inside.wait(30)
        try:
            other = pool.submit(svc.authenticate, key_b)  # an auth cache miss: takes the lock
            assert other.result(timeout=10).name == "b"
        finally:
            release.set()
        pending.result(timeout=30)
    assert svc.load_response(a, "resp_2" if step == "seal" else "resp_1") is not None
