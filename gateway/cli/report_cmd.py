"""``prefixgate report``: per-tenant, per-model usage, hit rate, cost and savings from the ledger.

Formats: ``table`` (default, for people), ``csv``, ``json`` (stable shape, see ``tenancy.report``),
``html`` (one self-contained file with charts; open it in a browser).
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

from gateway.cli.main import CLIError
from gateway.cli.tenant_cmd import open_service, sub_common
from tenancy import report


def cmd_report(args: argparse.Namespace) -> int:
    try:
        since = None if args.since in (None, "all") else report.parse_since(args.since)
        if since is not None:  # the report prints the start in UTC: it must exist there (year 1..9999)
            since = datetime.fromtimestamp(since.timestamp(), UTC)
    except (ValueError, OverflowError, OSError) as exc:
        raise CLIError(f"--since {args.since!r} is out of range or malformed: {exc}") from None
    with open_service(args) as svc:
        tenant_ids = None
        if args.tenant:
            t = svc.get_tenant_by_name(args.tenant)
            if t is None:
                raise CLIError(f"no tenant named {args.tenant!r} (see `prefixgate tenant list`)")
            tenant_ids = [t.tenant_id]
        rep = svc.report(tenant_ids=tenant_ids, since=since)
    text = report.RENDERERS[args.format](rep)
    if args.out:
        try:
            Path(args.out).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise CLIError(f"cannot write {args.out}: {exc.strerror}") from None
        print(f"wrote {args.format} report to {args.out}")
    else:
        print(text, end="")
    return 0


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    p = subparsers.add_parser("report", parents=[sub_common()], help="usage, cache hit rate, cost and savings per tenant")
    p.add_argument("--tenant", metavar="NAME", help="only this tenant (default: all)")
    p.add_argument("--since", metavar="AGE|DATE", default="7d",
                   help="start of the period: 7d, 24h, 30m, 2w or an ISO date, or 'all' (default 7d)")
    p.add_argument("--format", choices=tuple(report.RENDERERS), default="table")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    p.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=cmd_report)
