"""Tenant, API-key and data-key rows: validation and the SQL that reads and writes them.

No caching and no crypto policy here (that is ``service``); each function takes the open
``tenancy.database.Database`` (SQLite or PostgreSQL: the SQL here is what both accept) and runs in
one transaction, so another process never sees half a change.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tenancy.database import Database
from tenancy.errors import ConflictError, InvalidSettingError, NotFoundError
from tenancy.namespace import parse_share_scope
from tenancy.types import BUDGET_PERIODS, CANON_MODES, KeyInfo, Quotas, TenantInfo

TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
VAR_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

# Setting name -> column; the quota columns accept None ("unlimited").
SETTINGS: tuple[str, ...] = (
    "share_scope", "canon_mode", "per_user_vars", "priority", "ttft_target_s",
    "rpm", "tpm", "budget_usd", "budget_period", "kv_blocks_hbm", "kv_blocks_dram", "kv_blocks_nvme",
    "cache_retention_s",
    "store_miss_context",
)
_POSITIVE_INT_OR_NONE = ("rpm", "tpm", "kv_blocks_hbm", "kv_blocks_dram", "kv_blocks_nvme")
_INT_MAX = 2**63 - 1  # what an SQLite INTEGER holds: a larger limit would fail the write, not the check
_MAX_PER_USER_VARS = 64


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME_RE.match(name):
        raise InvalidSettingError(
            f"tenant name {name!r} must be 1-64 chars of letters, digits, '.', '_', '-' (starting alnum)"
        )
    return name


def validate_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Check and normalise settings into column values. Raises InvalidSettingError naming the field."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if key == "kv_blocks":  # the CLI's --kv-blocks: the HBM tier, which the engine caps per tenant
            key = "kv_blocks_hbm"
        if key not in SETTINGS:
            raise InvalidSettingError(f"unknown tenant setting {key!r}; known: {', '.join(SETTINGS)}")
        if key == "share_scope":
            try:
                parse_share_scope(value)
            except (ValueError, TypeError) as exc:
                raise InvalidSettingError(str(exc)) from None
        elif key == "canon_mode":
            if value not in CANON_MODES:
                raise InvalidSettingError(f"canon mode must be one of {', '.join(CANON_MODES)}, got {value!r}")
        elif key == "budget_period":
            if value not in BUDGET_PERIODS:
                raise InvalidSettingError(f"budget period must be 'day' or 'month', got {value!r}")
        elif key == "per_user_vars":
            names = [value] if isinstance(value, str) else list(value or ())
            if len(set(names)) > _MAX_PER_USER_VARS:
                raise InvalidSettingError(f"at most {_MAX_PER_USER_VARS} per-user variables, got {len(set(names))}")
            for n in names:
                if not isinstance(n, str) or not VAR_NAME_RE.match(n):
                    raise InvalidSettingError(f"per-user variable name {n!r} is not an identifier")
            value = json.dumps(sorted(set(names)))
        elif key == "store_miss_context":
            if not isinstance(value, bool):
                raise InvalidSettingError(f"store_miss_context must be true or false, got {value!r}")
            value = int(value)
        elif key == "priority":
            if isinstance(value, bool) or not isinstance(value, int) or not -100 <= value <= 100:
                raise InvalidSettingError(f"priority must be an integer in [-100, 100], got {value!r}")
        elif key in _POSITIVE_INT_OR_NONE:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= _INT_MAX):
                raise InvalidSettingError(f"{key} must be a positive integer up to {_INT_MAX} (or unset), "
                                          f"got {value!r}")
        elif key in ("budget_usd", "ttft_target_s", "cache_retention_s") and value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise InvalidSettingError(f"{key} must be a positive number (or unset), got {value!r}")
            value = float(value)
        out[key] = value
    return out


def tenant_from_row(row: Mapping[str, Any]) -> TenantInfo:
    return TenantInfo(
        tenant_id=row["id"],
        name=row["name"],
        is_admin=bool(row["is_admin"]),
        share_scope=row["share_scope"],
        canon_mode=row["canon_mode"],
        per_user_vars=tuple(json.loads(row["per_user_vars"])),
        priority=row["priority"],
        ttft_target_s=row["ttft_target_s"],
        quotas=Quotas(
            rpm=row["rpm"], tpm=row["tpm"], budget_usd=row["budget_usd"], budget_period=row["budget_period"],
            kv_blocks_hbm=row["kv_blocks_hbm"], kv_blocks_dram=row["kv_blocks_dram"],
            kv_blocks_nvme=row["kv_blocks_nvme"],
        ),
        created_at=row["created_at"],
        cache_retention_s=row["cache_retention_s"],
        store_miss_context=bool(row["store_miss_context"]),
    )


def insert_tenant(db: Database, name: str, *, is_admin: bool, settings: Mapping[str, Any]) -> str:
    validate_name(name)
    values = validate_settings(settings)
    tenant_id = "t_" + secrets.token_hex(8)
    row = {"id": tenant_id, "name": name, "is_admin": int(is_admin), "created_at": time.time(), **values}
    try:
        db.execute(
            f"INSERT INTO tenants ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", list(row.values())
        )
    except Exception as exc:
        if db.is_conflict(exc):
            raise ConflictError(f"a tenant named {name!r} already exists") from None
        raise
    return tenant_id


def update_tenant(db: Database, tenant_id: str, settings: Mapping[str, Any]) -> None:
    values = validate_settings(settings)
    if not values:
        return
    sets = ", ".join(f"{k} = ?" for k in values)
    if db.execute(f"UPDATE tenants SET {sets} WHERE id = ?", [*values.values(), tenant_id]) == 0:
        raise NotFoundError(f"no tenant with id {tenant_id!r}")


def get_tenant(db: Database, *, tenant_id: str | None = None, name: str | None = None) -> TenantInfo | None:
    col, val = ("id", tenant_id) if tenant_id is not None else ("name", name)
    rows = (db.query(f"SELECT * FROM tenants WHERE {col} = ?", [val]))
    return tenant_from_row(rows[0]) if rows else None


def list_tenants(db: Database) -> list[TenantInfo]:
    return [tenant_from_row(r) for r in db.query("SELECT * FROM tenants ORDER BY name")]


def delete_tenant(db: Database, tenant_id: str, data_key_owner: str, keyed_family: Callable[[str], str]) -> None:
    """Delete the tenant, its keys (cascade) and its data key, and scrub the client data its usage
    rows kept (``scrub_miss_data``), in one transaction."""
    with db.transaction():
        db.execute("DELETE FROM data_keys WHERE owner = ?", [data_key_owner])
        if db.execute("DELETE FROM tenants WHERE id = ?", [tenant_id]) == 0:
            raise NotFoundError(f"no tenant with id {tenant_id!r}")
        scrub_miss_data(db, tenant_id, keyed_family)


def scrub_miss_data(db: Database, tenant_id: str, keyed_family: Callable[[str], str]) -> None:
    """The usage rows of a deleted tenant stay (billing history), without what a tenant with
    ``store_miss_context`` kept in clear: the prompt text before a cache break (``miss_context``,
    set to NULL) and the clear family (``miss_family``, replaced by its keyed form, which still
    groups but names no end user or prompt). Quarantined rows (their JSON) get the same."""
    db.execute("UPDATE usage SET miss_context = NULL WHERE tenant_id = ? AND miss_context IS NOT NULL", [tenant_id])
    families = db.query("SELECT DISTINCT miss_family FROM usage WHERE tenant_id = ? AND miss_family IS NOT NULL",
                        [tenant_id])
    for family in (r["miss_family"] for r in families):
        keyed = keyed_family(family)
        if keyed != family:
            db.execute("UPDATE usage SET miss_family = ? WHERE tenant_id = ? AND miss_family = ?",
                       [keyed, tenant_id, family])
    for r in db.query("SELECT id, row_json FROM usage_quarantine WHERE tenant_id = ?", [tenant_id]):
        row = json.loads(r["row_json"])
        if not isinstance(row, dict):
            continue
        row["miss_context"] = None
        if isinstance(row.get("miss_family"), str):
            row["miss_family"] = keyed_family(row["miss_family"])
        db.execute("UPDATE usage_quarantine SET row_json = ? WHERE id = ?", [json.dumps(row, ensure_ascii=True), r["id"]])


def insert_key(db: Database, tenant_id: str, key_id: str, key_hash: bytes) -> None:
    db.execute(
        "INSERT INTO api_keys (key_id, tenant_id, key_hash, created_at) VALUES (?, ?, ?, ?)",
        [key_id, tenant_id, key_hash, time.time()],
    )


def key_with_tenant(db: Database, key_id: str) -> tuple[dict[str, Any], TenantInfo] | None:
    """The key row and its tenant, or None."""
    rows = (db.query("SELECT * FROM api_keys WHERE key_id = ?", [key_id]))
    if not rows:
        return None
    tenant = get_tenant(db, tenant_id=rows[0]["tenant_id"])
    return (rows[0], tenant) if tenant is not None else None


def list_keys(db: Database, tenant_id: str | None = None) -> list[KeyInfo]:
    sql = (
        "SELECT k.key_id, k.tenant_id, t.name AS tenant_name, k.created_at, k.revoked_at "
        "FROM api_keys k JOIN tenants t ON t.id = k.tenant_id"
    )
    params: list[Any] = []
    if tenant_id is not None:
        sql += " WHERE k.tenant_id = ?"
        params.append(tenant_id)
    sql += " ORDER BY t.name, k.created_at"
    return [
        KeyInfo(r["key_id"], r["tenant_id"], r["tenant_name"], f"pg-{r['key_id']}", r["created_at"], r["revoked_at"])
        for r in db.query(sql, params)
    ]


def revoke_key(db: Database, key_id: str) -> str:
    """Mark the key revoked; returns its tenant id. Revoking twice keeps the first time."""
    rows = (db.query("SELECT tenant_id FROM api_keys WHERE key_id = ?", [key_id]))
    if not rows:
        raise NotFoundError(f"no API key with id {key_id!r} (see `prefixgate key list`)")
    db.execute("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?) WHERE key_id = ?", [time.time(), key_id])
    return rows[0]["tenant_id"]


def get_wrapped_key(db: Database, owner: str) -> bytes | None:
    rows = (db.query("SELECT wrapped FROM data_keys WHERE owner = ?", [owner]))
    return bytes(rows[0]["wrapped"]) if rows else None


def insert_wrapped_key_if_absent(db: Database, owner: str, wrapped: bytes) -> None:
    """Race-safe between processes: the first writer wins, later ones keep the stored key."""
    db.execute(
        "INSERT INTO data_keys (owner, wrapped, created_at) VALUES (?, ?, ?) ON CONFLICT (owner) DO NOTHING",
        [owner, wrapped, time.time()],
    )


def all_wrapped_keys(db: Database) -> list[tuple[str, bytes]]:
    return [(r["owner"], bytes(r["wrapped"])) for r in db.query("SELECT owner, wrapped FROM data_keys")]


def set_wrapped_keys(db: Database, items: Iterable[tuple[str, bytes]]) -> None:
    for owner, wrapped in items:
        db.execute("UPDATE data_keys SET wrapped = ? WHERE owner = ?", [wrapped, owner])


def get_meta(db: Database, key: str) -> str | None:
    rows = (db.query("SELECT value FROM meta WHERE key = ?", [key]))
    return rows[0]["value"] if rows else None


def set_meta_if_absent(db: Database, key: str, value: str) -> None:
    db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING", [key, value])


def set_meta(db: Database, key: str, value: str) -> None:
    db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
               [key, value])


def data_key_owners(db: Database) -> set[str]:
    return {r["owner"] for r in db.query("SELECT owner FROM data_keys")}


def spent_since(db: Database, tenant_id: str, start: float) -> float:
    """USD the ledger holds for ``tenant_id`` since ``start`` (epoch seconds)."""
    rows = db.query("SELECT COALESCE(SUM(cost_usd), 0) AS c FROM usage WHERE tenant_id = ? AND created_at >= ?",
                    [tenant_id, start])
    return float(rows[0]["c"])
