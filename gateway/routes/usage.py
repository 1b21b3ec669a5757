"""``GET /v1/usage``: the caller's own ledger summary (an admin key sees every tenant)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter

from gateway.deps import TenancyDep, TenantDep
from gateway.errors import invalid_request

router = APIRouter(prefix="/v1", tags=["usage"])

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str | None) -> datetime | None:
    """'7d', '12h', '30m' (relative) or an ISO-8601 timestamp -> aware UTC datetime."""
    if not text:
        return None
    t = text.strip()
    if t[:-1].isdigit() and t[-1:].lower() in _UNITS:
        try:
            return datetime.now(UTC) - timedelta(seconds=int(t[:-1]) * _UNITS[t[-1].lower()])
        except (OverflowError, ValueError):  # '9999999999d' is before year 1: a client error, not a 500
            raise invalid_request(f"since is too far in the past: {text!r}", param="since") from None
    try:
        parsed = datetime.fromisoformat(t)
    except ValueError:
        raise invalid_request(f"since must look like 7d, 12h or an ISO-8601 time, got {text!r}",
                              param="since") from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:  # '0001-01-01T00:00:00+14:00' is before year 1 in UTC: a client error, not a 500
        return parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        raise invalid_request(f"since is out of the representable range: {text!r}", param="since") from None


@router.get("/usage")
async def usage(ctx: TenantDep, tenancy: TenancyDep, since: str | None = None, tenant: str | None = None) -> Any:
    """``since``: 30m / 12h / 7d or ISO-8601. ``tenant``: an admin key may name one tenant (else all);
    any other key sees only its own tenant (naming another is a 403 from tenancy)."""
    return tenancy.usage(ctx, since=parse_since(since), tenant=tenant)
