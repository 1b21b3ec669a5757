"""Admission quotas: requests/min and tokens/min (token buckets) and a USD budget per period.

Rate limits are token buckets held in this process: a bucket of ``rpm`` (or ``tpm``) capacity
refills continuously at ``rpm / 60`` per second, so a tenant may burst up to its per-minute number
and then proceeds at the steady rate. ``RateLimiter`` holds them in this process: with several
gateway replicas each one enforces the full limit. ``tenancy.shared_limits.SharedLimits`` (with
``--redis-url``) holds the same buckets in Redis, so a fleet enforces the limit once.

A request is admitted only if every check passes, and only then does it consume from the buckets,
so a request refused for tokens does not also eat a request slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from tenancy.errors import QuotaExceededError, retry_whole_seconds
from tenancy.types import Quotas


@dataclass
class TokenBucket:
    capacity: float
    per_second: float
    level: float
    updated: float

    @classmethod
    def per_minute(cls, limit: int, now: float) -> TokenBucket:
        return cls(capacity=float(limit), per_second=limit / 60.0, level=float(limit), updated=now)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.per_second)
        self.updated = now

    def wait_for(self, amount: float) -> float | None:
        """Seconds until ``amount`` is available (0 if now); None if it exceeds the capacity."""
        if amount > self.capacity:
            return None
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.per_second


def period_bounds(period: str, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of the UTC calendar day or month containing ``now``."""
    now = now.astimezone(UTC)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        end = datetime.fromtimestamp(start.timestamp() + 86400, UTC)
    elif period == "month":
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    else:
        raise ValueError(f"budget period must be 'day' or 'month', got {period!r}")
    return start, end


class Limiter(Protocol):
    """Admission by rpm/tpm buckets: ``RateLimiter`` (this process) or ``SharedLimits`` (Redis)."""

    def admit(self, tenant_id: str, quotas: Quotas, estimated_tokens: int) -> None:
        """Consume one request and ``estimated_tokens``, or raise QuotaExceededError consuming nothing.

        Raises ValueError for a negative ``estimated_tokens``.
        """
        ...


def rate_error(quotas: Quotas, estimated_tokens: int, kind: str, wait: float | None) -> QuotaExceededError:
    """The error for a refusal by the ``kind`` ("rpm" | "tpm") bucket (``wait`` None: never fits)."""
    if kind == "rpm":
        return QuotaExceededError("rate", f"Rate limit reached: {quotas.rpm} requests per minute. "
                                          f"Retry in {_whole(wait)} s.", retry_after_s=wait)
    if wait is None:
        return QuotaExceededError(
            "tokens",
            f"Request too large: about {estimated_tokens} tokens, but the limit is "
            f"{quotas.tpm} tokens per minute. Reduce the prompt or max_tokens.",
            retry_after_s=None,
        )
    return QuotaExceededError(
        "tokens",
        f"Rate limit reached: {quotas.tpm} tokens per minute "
        f"(this request needs about {estimated_tokens}). Retry in {_whole(wait)} s.",
        retry_after_s=wait,
    )


class RateLimiter:
    """Per-tenant rpm/tpm buckets. Thread-safe. ``clock`` is injectable for tests (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, tenant_id: str, kind: str, limit: int, now: float) -> TokenBucket:
        b = self._buckets.get((tenant_id, kind))
        if b is None or b.capacity != limit:  # new tenant or the quota was changed: start full
            b = self._buckets[(tenant_id, kind)] = TokenBucket.per_minute(limit, now)
        b.refill(now)
        return b

    def admit(self, tenant_id: str, quotas: Quotas, estimated_tokens: int) -> None:
        """Consume one request and ``estimated_tokens`` or raise QuotaExceededError (consuming nothing)."""
        if estimated_tokens < 0:
            raise ValueError("estimated_tokens must be >= 0")
        with self._lock:
            now = self._clock()
            req = self._bucket(tenant_id, "rpm", quotas.rpm, now) if quotas.rpm is not None else None
            tok = self._bucket(tenant_id, "tpm", quotas.tpm, now) if quotas.tpm is not None else None
            if req is not None:
                wait = req.wait_for(1)
                if wait is None or wait > 0:
                    raise rate_error(quotas, estimated_tokens, "rpm", wait)
            if tok is not None:
                wait = tok.wait_for(estimated_tokens)
                if wait is None or wait > 0:
                    raise rate_error(quotas, estimated_tokens, "tpm", wait)
            if req is not None:
                req.level -= 1
            if tok is not None:
                tok.level -= estimated_tokens


def check_budget(quotas: Quotas, spent_usd: float, now: datetime) -> None:
    """Raise QuotaExceededError("budget") when this period's spend has reached the budget."""
    if quotas.budget_usd is None or spent_usd < quotas.budget_usd:
        return
    _, end = period_bounds(quotas.budget_period, now)
    retry = max(0.0, (end - now).total_seconds())
    raise QuotaExceededError(
        "budget",
        f"Budget exhausted: {usd(spent_usd)} spent of {usd(quotas.budget_usd)} this {quotas.budget_period} "
        f"(resets {end.strftime('%Y-%m-%d %H:%M')} UTC).",
        retry_after_s=retry,
    )


def usd(amount: float) -> str:
    """``$`` and the amount with cents, and with the digits below a cent that it has (four
    significant ones at most): a $0.00005 budget must not print as $0.00."""
    if amount == 0 or abs(amount) >= 1:
        return f"${amount:.2f}"
    decimals = 2
    while decimals < 12 and abs(amount) < 10 ** (3 - decimals):  # four significant digits shown
        decimals += 1
    text = f"{amount:.{decimals}f}".rstrip("0")
    whole, _, cents = text.partition(".")
    return f"${whole}.{cents.ljust(2, '0')}"


def _whole(wait: float | None) -> int:
    return 0 if wait is None else retry_whole_seconds(wait)
