"""Namespaces and usage visibility: a tenant never sees another tenant's cache or usage."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tenancy.errors import InvalidSettingError, PermissionDeniedError
from tenancy.service import TenancyService
from tenancy.types import UsageRecord


def _rec(ctx, rid: str, prompt: int = 100, cached: int = 40) -> UsageRecord:
    return UsageRecord(rid, ctx.tenant_id, ctx.key_id, "gpt-4o-mini", "local", prompt, cached, 5, 0.1, 0.2,
                       "ok", time.time())


def test_namespaces_follow_the_share_scope(svc: TenancyService) -> None:
    a = svc.authenticate(svc.create_tenant("a").api_key)
    b = svc.authenticate(svc.create_tenant("b").api_key)
    u = svc.authenticate(svc.create_tenant("u", share_scope="user").api_key)
    g1 = svc.authenticate(svc.create_tenant("g1", share_scope="group:docs").api_key)
    g2 = svc.authenticate(svc.create_tenant("g2", share_scope="group:docs").api_key)
    assert a.namespace != b.namespace
    # tenant scope ignores the end user
    assert svc.scope_for(a, "alice").namespace == svc.scope_for(a, "bob").namespace == a.namespace
    # user scope: one namespace per end user, none equal to another tenant's
    alice, bob = svc.scope_for(u, "alice"), svc.scope_for(u, "bob")
    assert alice.namespace != bob.namespace and alice.user == "alice"
    assert svc.scope_for(u, "alice").namespace == alice.namespace
    assert alice.namespace not in {a.namespace, b.namespace}
    # a share group is shared across its tenants, with one group cipher
    assert g1.namespace == g2.namespace != a.namespace
    assert g1.cipher is g2.cipher
    blob = g1.cipher.encrypt(b"kv", b"aad")
    assert g2.cipher.decrypt(blob, b"aad") == b"kv"
    assert a.cipher.decrypt(blob, b"aad") is None


def test_the_tenant_key_is_one_per_tenant_whatever_the_share_scope(svc: TenancyService) -> None:
    """The engine counts quotas and fairness by ``tenant_key``: one per tenant, never a namespace."""
    u = svc.authenticate(svc.create_tenant("u", share_scope="user").api_key)
    second_key = svc.authenticate(svc.create_key("u").api_key)
    alice, bob = svc.scope_for(u, "alice"), svc.scope_for(u, "bob")
    assert alice.namespace != bob.namespace
    assert alice.tenant_key == bob.tenant_key == svc.scope_for(second_key).tenant_key == u.tenant_key
    g1 = svc.authenticate(svc.create_tenant("g1", share_scope="group:docs").api_key)
    g2 = svc.authenticate(svc.create_tenant("g2", share_scope="group:docs").api_key)
    assert g1.namespace == g2.namespace and g1.tenant_key != g2.tenant_key
    # an opaque key of its own: never a namespace (it is not a chain seed, and may reach a disk)
    t = svc.authenticate(svc.create_tenant("t").api_key)
    keys = {u.tenant_key, g1.tenant_key, g2.tenant_key, t.tenant_key}
    assert len(keys) == 4 and keys.isdisjoint({alice.namespace, bob.namespace, g1.namespace, t.namespace})
    assert t.tenant_key != t.tenant_id.encode()


def test_user_scope_without_a_user_is_isolated_per_key(svc: TenancyService) -> None:
    created = svc.create_tenant("u", share_scope="user")
    k2 = svc.create_key("u")
    c1, c2 = svc.authenticate(created.api_key), svc.authenticate(k2.api_key)
    assert svc.scope_for(c1).namespace != svc.scope_for(c2).namespace


def test_namespaces_depend_on_the_server_secret(tmp_path: Path) -> None:
    s1, s2 = TenancyService.open(tmp_path / "h1"), TenancyService.open(tmp_path / "h2")
    try:
        c1 = s1.authenticate(s1.create_tenant("same").api_key)
        c2 = s2.authenticate(s2.create_tenant("same").api_key)
        assert c1.namespace != c2.namespace
    finally:
        s1.close()
        s2.close()


def test_a_tenant_never_reads_another_tenants_usage(svc: TenancyService) -> None:
    a = svc.authenticate(svc.create_tenant("a").api_key)
    b = svc.authenticate(svc.create_tenant("b").api_key)
    admin = svc.authenticate(svc.create_tenant("ops", admin=True).api_key)
    for i in range(3):
        svc.record_usage(_rec(a, f"a{i}"))
    svc.record_usage(_rec(b, "b0", prompt=7, cached=0))
    ra = svc.usage(a)
    assert {r["tenant"] for r in ra["rows"]} == {"a"} and ra["totals"]["requests"] == 3
    rb = svc.usage(b)
    assert {r["tenant"] for r in rb["rows"]} == {"b"} and rb["totals"]["prompt_tokens"] == 7
    assert ra["timeline"] and all(p["tenant"] == "a" for p in ra["timeline"])
    with pytest.raises(PermissionDeniedError):
        svc.usage(a, tenant="b")
    assert svc.usage(a, tenant="a")["totals"]["requests"] == 3
    everything = svc.usage(admin)
    assert {r["tenant"] for r in everything["rows"]} == {"a", "b"} and everything["totals"]["requests"] == 4
    assert svc.usage(admin, tenant="b")["totals"]["requests"] == 1


def test_metrics_label_is_bounded_and_never_the_end_user(svc: TenancyService) -> None:
    ctx = svc.authenticate(svc.create_tenant("x" * 64, share_scope="user").api_key)
    scoped = svc.scope_for(ctx, "some-end-user@example.com")
    assert scoped.metrics_label == "x" * 32


@pytest.mark.parametrize("settings", [
    {"share_scope": "everyone"}, {"share_scope": "group:"}, {"canon_mode": "aggressive"},
    {"rpm": 0}, {"budget_usd": -1.0}, {"budget_period": "week"}, {"per_user_vars": ["1bad"]}, {"colour": "red"},
])
def test_invalid_settings_are_refused_with_the_field_named(svc: TenancyService, settings: dict) -> None:
    with pytest.raises(InvalidSettingError) as err:
        svc.create_tenant("t", **settings)
    field = next(iter(settings)).split("_")[0]
    assert field in str(err.value) or next(iter(settings)) in str(err.value)
    assert svc.get_tenant_by_name("t") is None


def test_bad_tenant_names_are_refused(svc: TenancyService) -> None:
    for name in ("", "a b", "-x", "x" * 65):
        with pytest.raises(InvalidSettingError):
            svc.create_tenant(name)
