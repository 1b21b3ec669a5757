"""The gateway's own Prometheus metrics and the in-memory per-tenant aggregates behind /dashboard.

Labels are bounded: ``tenant`` is ``TenantContext.metrics_label`` (never a raw end-user id),
``backend`` is a route label (``none`` for a request refused before routing), ``status`` is the
ledger's ok/error/aborted and ``outcome`` one of :class:`Outcome`.

Every authenticated request is counted exactly once, in the same call that counts it for the
dashboard (:meth:`GatewayMetrics.count`), whether it ran (``Accounting``) or was refused before
it ran (a 4xx or a 429 from ``prepare``): the panel and ``/metrics`` cannot disagree.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.miss_tracker import break_counter

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RECENT_LATENCIES = 512  # per tenant, for the table's TTFT percentiles
_RECENT_OBSERVATIONS = 20_000  # all tenants, timestamped, for the time-series quantiles
_FAMILIES_PER_TENANT = 64  # most-computed prompt families kept per tenant


class Outcome(StrEnum):
    """How a request ended, as the panel and ``prefixgate_gateway_requests_total{outcome}`` count it."""

    OK = "ok"
    CLIENT_ERROR = "4xx"  # bad request, unknown model, too long, ...
    RATE_LIMITED = "429_rate_limit"  # rpm/tpm: retry later
    QUOTA = "429_quota"  # budget or allowance exhausted: do not retry
    SERVER_ERROR = "5xx"
    ABORTED = "aborted"  # the client went away


def outcome_of_error(status: int, code: str | None) -> Outcome:
    """The outcome of a request refused with HTTP ``status`` and OpenAI error ``code``."""
    if status == 429:
        return Outcome.QUOTA if code == "insufficient_quota" else Outcome.RATE_LIMITED
    return Outcome.SERVER_ERROR if status >= 500 else Outcome.CLIENT_ERROR


def outcome_of_status(status: str) -> Outcome:
    """The outcome of a request that ran, from its ledger status (an error while running is a 5xx)."""
    return {"ok": Outcome.OK, "aborted": Outcome.ABORTED}.get(status, Outcome.SERVER_ERROR)


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (``q`` in [0, 100]), as the ledger report computes it.

    Never outside [min, max] of the data: the value a histogram interpolation (or
    ``statistics.quantiles``' default "exclusive" method) extrapolates past the slowest request
    cannot occur here.
    """
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def family_label(family: str) -> str:
    """A family key the panel may show: a client-chosen ``user``/``prompt_cache_key`` value becomes a
    short hash (it may be an end-user id or text); ``prefix:<model>:<digest>`` is a hash already."""
    kind, _, rest = family.partition(":")
    if kind in ("user", "prompt_cache_key"):
        return f"{kind}:#{hashlib.sha256(rest.encode('utf-8', 'replace')).hexdigest()[:12]}"
    return family


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("tenant", "backend")
        self.requests = Counter(
            "prefixgate_gateway_requests", "Requests finished or refused by the gateway, after authentication",
            (*labels, "status", "outcome"), registry=registry,
        )
        self.prompt_tokens = Counter("prefixgate_gateway_prompt_tokens", "Prompt tokens", labels, registry=registry)
        self.cached_tokens = Counter(
            "prefixgate_gateway_cached_tokens", "Prompt tokens served from a prefix cache", labels, registry=registry
        )
        self.completion_tokens = Counter(
            "prefixgate_gateway_completion_tokens", "Completion tokens", labels, registry=registry
        )
        self.cost_usd = Counter("prefixgate_gateway_cost_usd", "Priced cost in USD", ("tenant",), registry=registry)
        self.saved_usd = Counter(
            "prefixgate_gateway_saved_usd", "USD saved by prefix-cache hits", ("tenant",), registry=registry
        )
        self.ttft = Histogram(
            "prefixgate_gateway_ttft_seconds", "Time to first token seen by the gateway", labels,
            buckets=_TTFT_BUCKETS, registry=registry,
        )
        self.latency = Histogram(
            "prefixgate_gateway_request_seconds", "Whole-request latency", labels,
            buckets=_TTFT_BUCKETS, registry=registry,
        )
        self.cache_breaks = break_counter(registry)  # prefixgate_cache_breaks_total{tenant,rule}
        # no tenant to count them under: missing, unknown or revoked keys (401), on any route
        self.unauthenticated = Counter(
            "prefixgate_gateway_unauthenticated_requests", "Requests refused for a missing or bad API key",
            registry=registry,
        )

        self._series: dict[tuple[str, str], RequestSeries] = {}
        self._requests: dict[tuple[str, str, str, Outcome], Callable[[float], None]] = {}

    def count(self, label: str, backend: str, status: str, outcome: Outcome) -> None:
        # The child looked up once per label set, as in ``series``: ``labels()`` costs ~8 Python
        # calls a request. Bounded: labels and backends are, statuses and outcomes are fixed sets.
        key = (label, backend, status, outcome)
        add = self._requests.get(key)
        if add is None:
            add = self._requests[key] = self.requests.labels(label, backend, status, outcome.value).inc
        add(1)

    def series(self, label: str, backend: str) -> RequestSeries:
        """The per-request series of one tenant label and backend, looked up once: ``labels()``
        validates, joins and locks on every call, eight times per request. Bounded like the
        labels themselves (tenant labels are bounded; backends are the configured ones)."""
        found = self._series.get((label, backend))
        if found is None:
            found = self._series[(label, backend)] = RequestSeries(
                prompt_tokens=self.prompt_tokens.labels(label, backend),
                cached_tokens=self.cached_tokens.labels(label, backend),
                completion_tokens=self.completion_tokens.labels(label, backend),
                cost_usd=self.cost_usd.labels(label), saved_usd=self.saved_usd.labels(label),
                latency=self.latency.labels(label, backend), ttft=self.ttft.labels(label, backend))
        return found


class RequestSeries:
    """The labelled children ``Accounting`` adds one request to (``GatewayMetrics.series``), with
    their bound ``inc`` / ``observe`` looked up once: made once per tenant label and backend."""

    def __init__(self, *, prompt_tokens: Counter, cached_tokens: Counter, completion_tokens: Counter,
                 cost_usd: Counter, saved_usd: Counter, latency: Histogram, ttft: Histogram) -> None:
        self.prompt_tokens, self.cached_tokens, self.completion_tokens = prompt_tokens, cached_tokens, completion_tokens
        self.cost_usd, self.saved_usd, self.latency, self.ttft = cost_usd, saved_usd, latency, ttft
        # bound methods looked up once per series, not per request
        self._prompt, self._cached, self._completion = prompt_tokens.inc, cached_tokens.inc, completion_tokens.inc
        self._cost, self._saved = cost_usd.inc, saved_usd.inc
        self._latency, self._ttft = latency.observe, ttft.observe

    def add(self, prompt: int, cached: int, completion: int, cost: float, saved: float, latency: float,
            ttft: float | None) -> None:
        """One request. A zero adds nothing (the children exist already) and is skipped; token counts
        are never negative (the ledger row refused them first), and a negative or NaN cost or saving
        goes through the public ``inc`` (which refuses a negative amount) as before."""
        if prompt:
            self._prompt(prompt)
        if cached:
            self._cached(cached)
        if completion:
            self._completion(completion)
        if cost > 0:
            self._cost(cost)
        elif cost:
            self.cost_usd.inc(cost)
        if saved > 0:
            self._saved(saved)
        elif saved:
            self.saved_usd.inc(saved)
        self._latency(latency)
        if ttft is not None:
            self._ttft(ttft)


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class RequestSample:
    """One finished or refused request, as the dashboard aggregates it."""

    tenant_id: str
    tenant: str  # display name (the tenant name: labels are cut to 32 characters)
    outcome: Outcome
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    cost: float = 0.0
    saved: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    family: str | None = None  # the miss tracker's prompt family (chat requests)
    spill_encrypted: bool | None = None  # whether the tenant's context carries a cipher for KV that leaves HBM

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.ttft is None or self.latency is None or self.completion < 2:
            return None
        return max(0.0, self.latency - self.ttft) / (self.completion - 1)


@dataclass
class TenantTotals:
    name: str
    requests: int = 0
    errors: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    saved_usd: float = 0.0
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT_LATENCIES))
    # prompt family -> [requests, prompt tokens computed (not served from cache)]
    computed: dict[str, list[int]] = field(default_factory=dict)
    spill_encrypted: bool | None = None  # as of its latest request


# Not frozen: made on every request, and a frozen dataclass sets each field through object.__setattr__
# (2-3x the construction time; issue #17). Nothing hashes it or relies on it not changing.
@dataclass
class Observation:
    at: float
    ttft: float | None
    tpot: float | None


class LiveStats:
    """Since-start totals per tenant id, for the dashboard's JSON endpoint (thread-safe).

    Keyed by tenant id, never by the display label: two tenants whose labels collide (a label is
    cut to 32 characters) must not see each other's rows.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._by_tenant: dict[str, TenantTotals] = {}
        self._recent: deque[Observation] = deque(maxlen=_RECENT_OBSERVATIONS)

    def add(self, s: RequestSample) -> None:
        with self._lock:
            # Not setdefault(id, TenantTotals(...)): that built a TenantTotals (a deque and two dicts)
            # on every request only to drop it for every request but a tenant's first.
            t = self._by_tenant.get(s.tenant_id)
            if t is None:
                t = self._by_tenant[s.tenant_id] = TenantTotals(name=s.tenant)
            t.requests += 1
            t.errors += s.outcome != Outcome.OK
            outcome = s.outcome.value  # read once: an enum's value is a Python-level property
            t.by_outcome[outcome] = t.by_outcome.get(outcome, 0) + 1
            t.prompt_tokens += s.prompt
            t.cached_tokens += s.cached
            t.completion_tokens += s.completion
            t.cost_usd += s.cost
            t.saved_usd += s.saved
            if s.spill_encrypted is not None:
                t.spill_encrypted = s.spill_encrypted
            if s.ttft is not None:
                t.ttfts.append(s.ttft)
            if s.outcome != Outcome.OK and s.ttft is None:
                return
            self._recent.append(Observation(self._clock(), s.ttft, s.tpot))
            if s.family is not None:
                self._count_family(t, s.family, s.prompt - s.cached)

    @staticmethod
    def _count_family(t: TenantTotals, family: str, computed: int) -> None:
        entry = t.computed.get(family)
        if entry is None:
            if len(t.computed) >= _FAMILIES_PER_TENANT:  # bounded: forget the least-computed family
                del t.computed[min(t.computed, key=lambda f: t.computed[f][1])]
            entry = t.computed[family] = [0, 0]
        entry[0] += 1
        entry[1] += computed

    def observations(self, since: float, until: float) -> list[Observation]:
        """Latencies observed in ``[since, until)`` (all tenants; newest at most ``_RECENT_OBSERVATIONS``)."""
        with self._lock:
            return [o for o in self._recent if since <= o.at < until]

    def most_computed(self, only: str | None = None, top: int = 10) -> list[dict[str, str | int]]:
        """The prompt families whose prompt tokens were computed most (cache misses), most first."""
        found: list[tuple[int, str, str, str, int]] = []  # computed, tenant, family, tenant id, requests
        with self._lock:
            for tenant_id, t in self._by_tenant.items():
                if only is not None and tenant_id != only:
                    continue
                for family, (requests, computed) in t.computed.items():
                    found.append((computed, t.name, family_label(family), tenant_id, requests))
        found.sort(key=lambda r: (-r[0], r[1], r[2]))
        return [{"tenant_id": tenant_id, "tenant": name, "family": family, "requests": requests,
                 "computed_tokens": computed} for computed, name, family, tenant_id, requests in found[:top]]

    def spill_encrypted(self) -> dict[str, bool | None]:
        """Tenant id -> whether its latest request's context could encrypt spilled KV."""
        with self._lock:
            return {tenant_id: t.spill_encrypted for tenant_id, t in self._by_tenant.items()}

    def snapshot(self, only: str | None = None) -> list[dict[str, Any]]:
        """One row per tenant (only tenant id ``only`` when given), by name."""
        rows = []
        with self._lock:
            for tenant_id, t in sorted(self._by_tenant.items(), key=lambda kv: (kv[1].name, kv[0])):
                if only is not None and tenant_id != only:
                    continue
                ttfts = sorted(t.ttfts)
                rows.append({
                    "tenant_id": tenant_id,
                    "tenant": t.name,
                    "requests": t.requests,
                    "errors": t.errors,
                    "by_outcome": dict(t.by_outcome),
                    "prompt_tokens": t.prompt_tokens,
                    "cached_tokens": t.cached_tokens,
                    "completion_tokens": t.completion_tokens,
                    "hit_rate": t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0,
                    "cost_usd": round(t.cost_usd, 8),
                    "saved_usd": round(t.saved_usd, 8),
                    "ttft_p50_s": percentile(ttfts, 50),
                    "ttft_p95_s": percentile(ttfts, 95),
                    "ttft_max_s": ttfts[-1] if ttfts else None,
                })
        return rows
