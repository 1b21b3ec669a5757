"""``prefixgate tenant|key|kek ...``: manage tenants, API keys, quotas and the key-encryption key.

Every command takes ``--home`` and ``--json``; user errors are one line on stderr and exit 2.
An API key is printed exactly once, by ``tenant create`` and ``key create``: only its hash is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from gateway.cli.main import CLIError, resolve_home
from tenancy.errors import TenancyError
from tenancy.service import TenancyService, TenantInfo


@contextmanager
def open_service(args: argparse.Namespace) -> Iterator[TenancyService]:
    """The service under --home (on --database-url / --redis-url when given), with tenancy errors
    turned into one-line CLI errors. With Redis, a revocation or deletion reaches running gateways at once."""
    try:
        with TenancyService.open(resolve_home(args.home), database_url=getattr(args, "database_url", None),
                                 redis_url=getattr(args, "redis_url", None)) as svc:
            yield svc
    except TenancyError as exc:
        raise CLIError(str(exc)) from None


def _emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    print(json.dumps(payload, indent=2) if args.json else text)


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _tenant_dict(t: TenantInfo) -> dict[str, Any]:
    d = asdict(t)
    d["per_user_vars"] = list(t.per_user_vars)
    return d


# SQLite stores a signed 64-bit INTEGER; a larger limit would fail deep in the store (OverflowError).
MAX_LIMIT = 2**63 - 1


def _limit(value: str) -> int | None:
    """A positive integer up to MAX_LIMIT, or none/unlimited to clear the limit."""
    if value.lower() in ("none", "unlimited", "off"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {value!r}") from None
    if not 1 <= n <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_LIMIT} or 'none', got {value!r}")
    return n


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(value: str) -> float | str:
    """``5m``, ``1h``, ``24h``, plain seconds, or ``none`` (kept as the string, to clear the setting)."""
    if value.lower() in ("none", "off"):
        return "none"
    unit = _DURATION_UNITS.get(value[-1:].lower())
    try:
        x = float(value[:-1]) * unit if unit else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 5m, 1h, 24h or seconds, got {value!r}") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive duration, got {value!r}")
    return x


def _money(value: str) -> float | None:
    if value.lower() in ("none", "unlimited", "off"):
        return None
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive amount in USD or 'none', got {value!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive amount in USD or 'none', got {value!r}")
    return x


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--share-scope", metavar="tenant|user|group:NAME",
                   help="who shares cached prefixes: the whole tenant (default), each end user, or a named group "
                        "of tenants")
    p.add_argument("--canon", choices=("off", "safe", "reorder"), help="prompt canonicalization mode (default safe)")
    p.add_argument("--per-user-var", action="append", metavar="NAME", dest="per_user_vars",
                   help="template variable that differs per end user (repeatable)")
    p.add_argument("--priority", type=int, help="scheduling priority in [-100, 100] (default 0)")
    p.add_argument("--ttft-target", type=float, metavar="SECONDS", help="time-to-first-token target")
    p.add_argument("--cache-retention", type=_duration, metavar="5m|1h|24h|SECONDS",
                   help="keep every prompt's cached prefix this long (explicit cache control; 'none' clears it)")
    p.add_argument("--store-miss-context", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the prompt text around each cache break and clear prompt-family names "
                        "(end-user ids) in the ledger (default off: no prompt text, families keyed)")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {
        "share_scope": args.share_scope, "canon_mode": args.canon, "per_user_vars": args.per_user_vars,
        "priority": args.priority, "ttft_target_s": args.ttft_target,
        "store_miss_context": args.store_miss_context,
    }
    settings = {k: v for k, v in pairs.items() if v is not None}
    retention = getattr(args, "cache_retention", None)
    if retention is not None:
        settings["cache_retention_s"] = None if retention == "none" else retention
    return settings


def _show_text(t: TenantInfo) -> str:
    q = t.quotas
    budget = f"${q.budget_usd:.2f}/{q.budget_period}" if q.budget_usd is not None else "-"
    lines = [
        f"tenant      {t.name}  ({t.tenant_id}){'  [admin]' if t.is_admin else ''}",
        f"created     {_when(t.created_at)}",
        f"share scope {t.share_scope}",
        f"canon mode  {t.canon_mode}",
        f"user vars   {', '.join(t.per_user_vars) or '-'}",
        f"priority    {t.priority}   TTFT target {t.ttft_target_s if t.ttft_target_s is not None else '-'}",
        f"retention   {f'{t.cache_retention_s:g} s' if t.cache_retention_s else '-'}",
        f"miss text   {'kept (--store-miss-context)' if t.store_miss_context else 'not stored'}",
        f"quotas      rpm={q.rpm or '-'} tpm={q.tpm or '-'} budget="
        f"{budget} "
        f"kv_blocks hbm={q.kv_blocks_hbm or '-'} dram={q.kv_blocks_dram or '-'} nvme={q.kv_blocks_nvme or '-'}",
    ]
    return "\n".join(lines)


# -- tenant --------------------------------------------------------------------------------------

def cmd_tenant_create(args: argparse.Namespace) -> int:
    with open_service(args) as svc:
        created = svc.create_tenant(args.name, admin=args.admin, **_settings(args))
    payload = {"tenant_id": created.tenant_id, "name": created.name, "api_key": created.api_key,
               "key_id": created.key_id}
    _emit(args, payload,
          f"created tenant {created.name} ({created.tenant_id})\n"
          f"API key (shown once, store it now): {created.api_key}\nkey id: {created.key_id}")
    return 0


def cmd_tenant_list(args: argparse.Namespace) -> int:
    with open_service(args) as svc:
        tenants = svc.list_tenants()
    rows = [f"{t.name:<24} {t.tenant_id:<20} {t.share_scope:<14} {t.canon_mode:<8} {'admin' if t.is_admin else ''}"
            for t in tenants]
    head = f"{'NAME':<24} {'ID':<20} {'SHARE SCOPE':<14} {'CANON':<8}"
    _emit(args, [_tenant_dict(t) for t in tenants], "\n".join([head, *rows]) if tenants else "no tenants")
    return 0


def cmd_tenant_show(args: argparse.Namespace) -> int:
    with open_service(args) as svc:
        t = svc.get_tenant_by_name(args.name)
        if t is None:
            raise CLIError(f"no tenant named {args.name!r} (see `prefixgate tenant list`)")
        keys = svc.list_keys(args.name)
    text = _show_text(t) + "\nkeys        " + (
        ", ".join(f"{k.prefix}{'' if k.active else ' (revoked)'}" for k in keys) or "-")
    _emit(args, {**_tenant_dict(t), "keys": [asdict(k) for k in keys]}, text)
    return 0


def cmd_tenant_set(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not settings:
        raise CLIError("nothing to change: give at least one of --share-scope, --canon, --per-user-var, "
                       "--priority, --ttft-target, --cache-retention, --store-miss-context")
    with open_service(args) as svc:
        t = svc.update_tenant(args.name, **settings)
    _emit(args, _tenant_dict(t), _show_text(t))
    return 0


def _confirm_delete(name: str) -> None:
    """Ask before crypto-shredding: the tenant's spilled KV becomes undecryptable, for good.

    Without a terminal there is nobody to ask: refuse rather than guess, and name ``--yes``.
    """
    if not sys.stdin.isatty():
        raise CLIError(f"deleting tenant {name!r} destroys its keys and data key for good; "
                       "pass --yes to confirm (stdin is not a terminal, so there is nobody to ask)")
    print(f"Delete tenant {name!r}? Its API keys stop working and its data key is destroyed, so its spilled "
          "KV can never be decrypted (usage rows are kept).", file=sys.stderr)
    try:
        answer = input(f"Type the tenant name ({name}) to confirm: ")
    except EOFError:
        answer = ""
    if answer.strip() != name:
        raise CLIError(f"not deleted: the answer did not match {name!r}")


def cmd_tenant_delete(args: argparse.Namespace) -> int:
    with open_service(args) as svc:
        if svc.get_tenant_by_name(args.name) is None:
            raise CLIError(f"no tenant named {args.name!r} (see `prefixgate tenant list`)")
        if not args.yes:
            _confirm_delete(args.name)
        t = svc.delete_tenant(args.name)
    _emit(args, {"deleted": True, "tenant_id": t.tenant_id, "name": t.name},
          f"deleted tenant {t.name} ({t.tenant_id}); its API keys are gone and its data key is destroyed, "
          "so its spilled KV can never be decrypted (its usage rows are kept)")
    return 0


def cmd_quota_set(args: argparse.Namespace) -> int:
    given = {k: getattr(args, k) for k in ("rpm", "tpm", "budget_usd", "budget_period", "kv_blocks_hbm",
                                            "kv_blocks_dram", "kv_blocks_nvme")}
    settings = {k: v for k, v in given.items() if v is not _UNSET}
    if not settings:
        raise CLIError("nothing to change: give at least one of --rpm, --tpm, --budget-usd, --period, --kv-blocks, "
                       "--kv-blocks-dram, --kv-blocks-nvme")
    with open_service(args) as svc:
        t = svc.update_tenant(args.name, **settings)
    _emit(args, _tenant_dict(t), _show_text(t))
    return 0


_UNSET = object()


# -- key -----------------------------------------------------------------------------------------

def cmd_key_create(args: argparse.Namespace) -> int:
    with open_service(args) as svc:
        k = svc.create_key(args.tenant)
    _emit(args, {"tenant_id": k.tenant_id, "name": args.tenant, "api_key": k.api_key, "key_id": k.key_id},
          f"API key for {args.tenant} (shown once, store it now): {k.api_key}\nkey id: {k.key_id}")
    return 0


def cmd_key_list(args: argparse.Namespace) -> int:
    with open_service(args) as svc:
        keys = svc.list_keys(args.tenant)
    head = f"{'KEY ID':<10} {'PREFIX':<12} {'TENANT':<24} {'CREATED':<24} REVOKED"
    rows = [f"{k.key_id:<10} {k.prefix:<12} {k.tenant_name:<24} {_when(k.created_at):<24} {_when(k.revoked_at)}"
            for k in keys]
    _emit(args, [asdict(k) for k in keys], "\n".join([head, *rows]) if keys else "no keys")
    return 0


def cmd_key_revoke(args: argparse.Namespace) -> int:
    with open_service(args) as svc:
        key_id = svc.revoke_key(args.key)  # the id, never the argument: it may be the whole secret key
    _emit(args, {"revoked": True, "key_id": key_id},
          f"revoked {key_id}; running gateways stop accepting it within their auth cache TTL (5 s default)")
    return 0


# -- kek -----------------------------------------------------------------------------------------

def cmd_kek_rotate(args: argparse.Namespace) -> int:
    with open_service(args) as svc:
        r = svc.rotate_kek()
    text = f"re-wrapped {r.data_keys} data keys: KEK {r.old_fingerprint} -> {r.new_fingerprint}"
    if r.kek_file:
        text += f"\nnew KEK written to {r.kek_file}"
    else:
        text += (f"\nthe KEK comes from $PREFIXGATE_KEK: set it to this new value before the next start "
                 f"(shown once): {r.new_kek_b64}")
    _emit(args, asdict(r), text)
    if r.new_kek_b64 and args.json:
        print("prefixgate: warning: set $PREFIXGATE_KEK to new_kek_b64 before the next start", file=sys.stderr)
    return 0


def sub_common() -> argparse.ArgumentParser:
    """``--home`` for sub-commands, defaulting to SUPPRESS.

    argparse lets a sub-parser's default overwrite what the top-level parser parsed, so reusing
    main's ``common`` parser here would turn ``prefixgate --home X tenant list`` into ``--home None``.
    With SUPPRESS the sub-command sets ``home`` only when ``--home`` is given after it.
    """
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--home", default=argparse.SUPPRESS,
                   help="state directory (database, keys); default $PREFIXGATE_HOME or the user's data directory")
    # A fleet's shared state: the same URLs the gateways run with (serve's --database-url / --redis-url).
    p.add_argument("--database-url", default=os.environ.get("PREFIXGATE_DATABASE_URL") or None, metavar="URL",
                   help="postgresql://... of a fleet (default $PREFIXGATE_DATABASE_URL, else SQLite under --home)")
    p.add_argument("--redis-url", default=os.environ.get("PREFIXGATE_REDIS_URL") or None, metavar="URL",
                   help="redis://... of a fleet: revocations reach running gateways at once "
                        "(default $PREFIXGATE_REDIS_URL)")
    return p


def _json_flag() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    parents = [sub_common(), _json_flag()]

    tenant = subparsers.add_parser("tenant", help="create, list, show, change and delete tenants")
    tsub = tenant.add_subparsers(dest="tenant_command", metavar="ACTION", required=True)
    p = tsub.add_parser("create", parents=parents, help="create a tenant and print its first API key once")
    p.add_argument("name")
    p.add_argument("--admin", action="store_true", help="may read every tenant's usage")
    _add_settings_flags(p)
    p.set_defaults(func=cmd_tenant_create)
    p = tsub.add_parser("list", parents=parents, help="list tenants")
    p.set_defaults(func=cmd_tenant_list)
    p = tsub.add_parser("show", parents=parents, help="show a tenant's settings, quotas and keys")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_show)
    p = tsub.add_parser("set", parents=parents, help="change a tenant's settings")
    p.add_argument("name")
    _add_settings_flags(p)
    p.set_defaults(func=cmd_tenant_set)
    p = tsub.add_parser("delete", parents=parents,
                        help="delete a tenant, its keys and its data key (crypto-shreds its spilled KV)")
    p.add_argument("name")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation (scripts)")
    p.set_defaults(func=cmd_tenant_delete)
    quota = tsub.add_parser("quota", help="set a tenant's quotas")
    qsub = quota.add_subparsers(dest="quota_command", metavar="ACTION", required=True)
    p = qsub.add_parser("set", parents=parents, help="set quotas ('none' clears a limit; limits not named stay)",
                        argument_default=_UNSET)
    p.add_argument("name", default=None, metavar="NAME")
    p.add_argument("--rpm", type=_limit, metavar="N", help="requests per minute")
    p.add_argument("--tpm", type=_limit, metavar="N", help="tokens per minute (prompt + max_tokens, estimated at admission)")
    p.add_argument("--budget-usd", type=_money, metavar="USD", help="spend cap per period, in USD")
    p.add_argument("--period", dest="budget_period", choices=("day", "month"), help="budget period (UTC)")
    p.add_argument("--kv-blocks", dest="kv_blocks_hbm", type=_limit, metavar="N", help="most KV blocks held in GPU memory")
    p.add_argument("--kv-blocks-dram", type=_limit, metavar="N", help="most KV blocks held in the CPU DRAM tier")
    p.add_argument("--kv-blocks-nvme", type=_limit, metavar="N", help="most KV blocks held in the NVMe tier")
    p.set_defaults(func=cmd_quota_set)

    key = subparsers.add_parser("key", help="create, list and revoke API keys")
    ksub = key.add_subparsers(dest="key_command", metavar="ACTION", required=True)
    p = ksub.add_parser("create", parents=parents, help="create another API key for a tenant (printed once)")
    p.add_argument("tenant")
    p.set_defaults(func=cmd_key_create)
    p = ksub.add_parser("list", parents=parents, help="list API keys (prefixes only)")
    p.add_argument("tenant", nargs="?")
    p.set_defaults(func=cmd_key_list)
    p = ksub.add_parser("revoke", parents=parents,
                        help="revoke an API key by its id, its pg-<id> prefix or the whole key")
    p.add_argument("key", metavar="KEY_ID", help="the key id `key list` prints, pg-<id>, or the whole API key")
    p.set_defaults(func=cmd_key_revoke)

    kek = subparsers.add_parser("kek", help="manage the key-encryption key")
    esub = kek.add_subparsers(dest="kek_command", metavar="ACTION", required=True)
    p = esub.add_parser("rotate", parents=parents, help="re-wrap every tenant data key under a new KEK")
    p.set_defaults(func=cmd_kek_rotate)
