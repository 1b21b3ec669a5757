"""The gateway's own Prometheus metrics and the in-memory per-tenant aggregates behind /dashboard.

Labels are bounded: ``tenant`` is ``TenantContext.metrics_label`` (never a raw end-user id),
``backend`` is a route label, ``status`` is ok/error/aborted.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from statistics import quantiles
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.miss_tracker import break_counter

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("tenant", "backend")
        self.requests = Counter(
            "prefixgate_gateway_requests", "Requests finished by the gateway", (*labels, "status"), registry=registry
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


@dataclass
class TenantTotals:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    saved_usd: float = 0.0
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=512))


class LiveStats:
    """Since-start totals per tenant label, for the dashboard's JSON endpoint (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tenant: dict[str, TenantTotals] = {}

    def add(
        self, tenant: str, *, status: str, prompt: int, cached: int, completion: int,
        cost: float, saved: float, ttft: float | None,
    ) -> None:
        with self._lock:
            t = self._by_tenant.setdefault(tenant, TenantTotals())
            t.requests += 1
            t.errors += status != "ok"
            t.prompt_tokens += prompt
            t.cached_tokens += cached
            t.completion_tokens += completion
            t.cost_usd += cost
            t.saved_usd += saved
            if ttft is not None:
                t.ttfts.append(ttft)

    def snapshot(self, only: str | None = None) -> list[dict[str, Any]]:
        rows = []
        with self._lock:
            for name, t in sorted(self._by_tenant.items()):
                if only is not None and name != only:
                    continue
                ttfts = sorted(t.ttfts)
                p50 = ttfts[len(ttfts) // 2] if ttfts else None
                p95 = quantiles(ttfts, n=20)[-1] if len(ttfts) >= 2 else p50
                rows.append({
                    "tenant": name,
                    "requests": t.requests,
                    "errors": t.errors,
                    "prompt_tokens": t.prompt_tokens,
                    "cached_tokens": t.cached_tokens,
                    "completion_tokens": t.completion_tokens,
                    "hit_rate": t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0,
                    "cost_usd": round(t.cost_usd, 8),
                    "saved_usd": round(t.saved_usd, 8),
                    "ttft_p50_s": p50,
                    "ttft_p95_s": p95,
                })
        return rows
