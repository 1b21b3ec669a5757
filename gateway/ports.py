"""Thin adapters to the sibling packages the request path depends on (tenancy, promptlint.canon).

The request path codes against the small Protocols here, so that tests can inject fakes; the CLI,
``gateway.app`` (engines through ``engine.launch``) and a few modules import the siblings' public
modules directly, within the allow-lists of ``.importlinter``. The ledger row is tenancy's own
``UsageRecord`` and the errors are tenancy's, so real and fake tenancy take and raise the same types.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from engine.protocol import TenantScope
from gateway.errors import OpenAIError
from promptlint.canon import CanonMode, CanonResult
from promptlint.canon import canonicalize_owned as _canonicalize

# The rest of the gateway (and its test fakes) take tenancy's types from here.
from tenancy.service import (  # noqa: F401 - re-exported
    AuthenticationError,
    FleetStatus,
    KeyInfo,
    QuotaExceededError,
    Quotas,
    TenancyError,
    TenancyService,
    TenantInfo,
    UsageRecord,
)
from tenancy.service import metrics_label as tenant_metrics_label  # noqa: F401 - the label a tenant's name gets
from tenancy.types import UsageStatus  # noqa: F401 - re-exported


class TenantCtx(TenantScope, Protocol):
    """What the gateway reads of ``tenancy.service.TenantContext``: the engine's ``TenantScope``
    (namespace, tenant key, metrics label, cipher, priority, block quotas) and the tenant's own settings.

    Read-only members: the context is a frozen dataclass, and its narrower field types (``canon_mode``
    a Literal) conform to read-only members only."""

    @property
    def tenant_id(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def key_id(self) -> str: ...

    @property
    def is_admin(self) -> bool: ...

    @property
    def share_scope(self) -> str:
        """One of ``tenant``, ``user``, ``group:<name>``."""
        ...

    @property
    def canon_mode(self) -> CanonMode: ...

    @property
    def per_user_vars(self) -> tuple[str, ...]: ...

    @property
    def quotas(self) -> Quotas: ...

    @property
    def cache_retention_s(self) -> float | None:
        """The tenant's default retention of its prompts' prefixes."""
        ...


class PriceQuote(Protocol):
    """What a request cost and what its cache hits saved (``tenancy.service.Price``)."""

    cost_usd: float
    saved_usd: float


class TenancyPort(Protocol):
    """The subset of ``tenancy.service.TenancyService`` the gateway calls (see its docs for contracts)."""

    def authenticate(self, api_key: str | None) -> TenantCtx: ...

    def scope_for(self, ctx: TenantCtx, user: str | None) -> TenantCtx: ...

    def admit(self, ctx: TenantCtx, *, estimated_tokens: int) -> None: ...

    def price(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
              cache_creation_tokens: int = 0) -> PriceQuote: ...

    def record_usage(self, record: UsageRecord) -> PriceQuote:
        """Queue the row for the ledger; the price it was stored at (also for a duplicate)."""
        ...

    def usage(self, ctx: TenantCtx, since: datetime | None = None, *, tenant: str | None = None) -> dict: ...


@runtime_checkable
class AsyncCloseable(Protocol):
    """A backend client that holds connections (a node's or an upstream provider's HTTP pool; the
    in-process engine holds none): ``aclose`` releases them at shutdown."""

    async def aclose(self) -> None: ...


@runtime_checkable
class LedgerFlush(Protocol):
    """A tenancy that queues ledger rows (``TenancyService.flush``; fakes may write at once): shutdown
    writes the queue out before the process ends."""

    def flush(self) -> None: ...


@runtime_checkable
class FleetStatusSource(Protocol):
    """Which store and limits the tenancy uses (``TenancyService.fleet_status``; fakes may not have it)."""

    def fleet_status(self) -> FleetStatus: ...


class LedgerCounts(Protocol):
    """What the usage-ledger writer counts since it started (``tenancy.ledger.LedgerStats``)."""

    committed: int
    quarantined: int
    spilled: int
    replayed: int
    lost: int
    retries: int
    queued: int


@runtime_checkable
class LedgerStatsSource(Protocol):
    """The ledger writer's counters (``TenancyService.ledger_stats``; fakes may not have it)."""

    def ledger_stats(self) -> LedgerCounts: ...


@runtime_checkable
class TenantDirectory(Protocol):
    """Listing tenants and keys (``TenancyService`` has it; test fakes may not): the panel's isolation table."""

    def list_tenants(self) -> list[TenantInfo]: ...

    def list_keys(self, name: str | None = None) -> list[KeyInfo]: ...


def open_tenancy(home: Path, *, auth_cache_ttl_s: float = 5.0, database_url: str | None = None,
                 redis_url: str | None = None, store_retention_days: float = 30.0) -> TenancyService:
    """Open the real tenancy service under ``home`` (on ``database_url`` / ``redis_url`` when given);
    ``store_retention_days`` 0 keeps stored responses and completions until deleted."""
    return TenancyService.open(home, auth_cache_ttl_s=auth_cache_ttl_s, database_url=database_url,
                               redis_url=redis_url,
                               stored_ttl_s=store_retention_days * 86_400.0 if store_retention_days else None)


# QuotaExceededError.kind -> the error ``type`` OpenAI gives that refusal.
_QUOTA_TYPES = {"rate": "requests", "tokens": "tokens", "budget": "insufficient_quota"}


def quota_error(exc: QuotaExceededError) -> OpenAIError:
    """Map ``QuotaExceededError`` to a 429 in OpenAI's shape: ``type`` ``requests`` (rpm), ``tokens``
    (tpm) or ``insufficient_quota`` (budget), ``code`` ``rate_limit_exceeded`` / ``insufficient_quota``.

    ``Retry-After`` is the wait rounded up to whole seconds, the figure the message gives, whenever
    one is known (a budget's: until its period ends). A rate limit that waiting can cure is retried
    by the SDK; an exhausted budget, or a request too large for the quota on its own (no wait can
    help), says ``x-should-retry: false`` so the SDK does not retry, as OpenAI does.
    """
    headers: dict[str, str] = {}
    retry = exc.retry_after_whole_s
    if retry is not None:
        headers["retry-after"] = str(retry)
    if exc.kind == "budget" or retry is None:
        headers["x-should-retry"] = "false"
    return OpenAIError(429, exc.message, code=exc.code, type=_QUOTA_TYPES[exc.kind], headers=headers)


def tenancy_error(exc: TenancyError) -> OpenAIError:
    """Any other tenancy error: it carries its own HTTP ``status`` and OpenAI ``code``."""
    if isinstance(exc, QuotaExceededError):
        return quota_error(exc)
    return OpenAIError(exc.status, str(exc), code=exc.code)


def canonicalize(body: dict[str, Any], mode: CanonMode, per_user_vars: Sequence[str] = ()) -> CanonResult:
    """``promptlint.canon.canonicalize`` for a tenant's mode ("off" returns the body unchanged).

    ``body`` is the caller's to give away (the request's own ``model_dump``, scanned at ingress):
    canonicalized in place, not copied (``canonicalize_owned``)."""
    if mode == "off":
        return CanonResult(body, ())
    return _canonicalize(body, mode, per_user_vars=tuple(per_user_vars))
