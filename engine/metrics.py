"""Prometheus metrics of one engine, registered in a ``CollectorRegistry`` the caller passes in.

No global registry: several engines (and tests) coexist in one process, and the gateway exposes
whichever registry it built. Tenant labels are ``TenantScope.metrics_label`` values, which tenancy
keeps to a bounded set (never a raw end-user id).

Reading the numbers:
    hit rate       = prefixgate_prompt_tokens_hit_total / prefixgate_prompt_tokens_queried_total
    fragmentation  = unused token slots in allocated blocks / allocated slots (0 = no waste; a
                     sequence wastes at most block_size-1 slots in its last block)
    queue reasons  = how many waiting requests are blocked by each reason right now
    tenant blocks  = prefixgate_kv_tenant_blocks{tenant,tier}: blocks a tenant holds in a tier now,
                     what its block quota of that tier counts (HBM: blocks its requests reference;
                     DRAM/NVMe: blocks of its stored segments). Series of a tenant that holds
                     nothing read 0, so the label set stays the tenants seen (bounded by tenancy)
    cache cost     = prefixgate_cache_manage_seconds_total{phase}: engine-thread time spent hashing
                     blocks, matching prefixes, evicting (tier spill included), indexing full
                     blocks and running the tier hook (restores); compare it with the prefill time
                     the hits saved = hit tokens / (prefixgate_prefill_tokens_total /
                     prefixgate_prefill_seconds_total of a cache-off run)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.kv_types import CachePhase, QueueReason, TierName

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Phases of cache management timed by LLMEngine (the `phase` label of prefixgate_cache_manage_seconds).
CACHE_PHASES = tuple(CachePhase)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.prompt_tokens_queried = Counter(
            "prefixgate_prompt_tokens_queried", "Prompt tokens looked up in the prefix cache", ["tenant"], registry=r
        )
        self.prompt_tokens_hit = Counter(
            "prefixgate_prompt_tokens_hit", "Prompt tokens served from the prefix cache", ["tenant"], registry=r
        )
        self.evictions = Counter("prefixgate_kv_evictions", "Indexed KV blocks evicted", ["tier"], registry=r)
        self.preemptions = Counter("prefixgate_preemptions", "Requests preempted (recompute)", registry=r)
        self.requests_finished = Counter(
            "prefixgate_requests_finished", "Finished requests", ["tenant", "finish_reason"], registry=r
        )
        self.blocks_used = Gauge("prefixgate_kv_blocks_used", "KV blocks referenced by requests", registry=r)
        self.blocks_free = Gauge("prefixgate_kv_blocks_free", "KV blocks allocatable (incl. evictable)", registry=r)
        self.blocks_evictable = Gauge(
            "prefixgate_kv_blocks_evictable", "Free KV blocks still holding an indexed prefix", registry=r
        )
        self.fragmentation = Gauge(
            "prefixgate_kv_fragmentation", "Unused slots in allocated blocks / allocated slots", registry=r
        )
        self.kv_block_size = Gauge("prefixgate_kv_block_size", "Tokens per KV block", registry=r)
        self.kv_bytes_per_token = Gauge("prefixgate_kv_bytes_per_token", "KV cache bytes per token", registry=r)
        self.queue_reason = Gauge(
            "prefixgate_waiting_requests", "Waiting requests by queue reason", ["reason"], registry=r
        )
        self.running = Gauge("prefixgate_running_requests", "Requests in the running batch", registry=r)
        self.tenant_blocks = Gauge(
            "prefixgate_kv_tenant_blocks", "KV blocks a tenant holds in a tier (what its block quota counts)",
            ["tenant", "tier"], registry=r,
        )
        self._tenant_blocks_seen: set[tuple[str, str]] = set()
        self.ttft = Histogram(
            "prefixgate_ttft_seconds", "Time to first token", ["tenant"], buckets=_TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "prefixgate_tpot_seconds", "Time per output token after the first", ["tenant"],
            buckets=_TPOT_BUCKETS, registry=r,
        )
        self.cache_seconds = Counter(
            "prefixgate_cache_manage_seconds", "Engine time spent managing the prefix cache", ["phase"],
            registry=r,
        )
        self.prefill_tokens = Counter(
            "prefixgate_prefill_tokens", "Prompt tokens computed by prefill (cache hits excluded)", registry=r
        )
        self.prefill_seconds = Counter(
            "prefixgate_prefill_seconds",
            "Model time attributed to prefill (each step's time split by its share of prefill tokens)",
            registry=r,
        )
        self.decode_tokens = Counter("prefixgate_decode_tokens", "Tokens computed by decode steps", registry=r)
        self.execute_seconds = Counter("prefixgate_execute_seconds", "Model runner time of all steps", registry=r)
        self._evictions_seen = 0
        self._preemptions_seen = 0

    def observe_admission(self, tenant: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens_queried.labels(tenant).inc(prompt_tokens)
        self.prompt_tokens_hit.labels(tenant).inc(cached_tokens)

    def observe_finished(self, tenant: str, reason: str, ttft_s: float | None, token_times: list[float]) -> None:
        self.requests_finished.labels(tenant, reason).inc()
        if ttft_s is not None:
            self.ttft.labels(tenant).observe(ttft_s)
        if len(token_times) > 1:
            self.tpot.labels(tenant).observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))

    def observe_state(
        self,
        *,
        used: int,
        free: int,
        evictable: int,
        fragmentation: float,
        num_evictions: int,
        num_preemptions: int,
        running: int,
        queue_reasons: dict[str, int],
    ) -> None:
        self.blocks_used.set(used)
        self.blocks_free.set(free)
        self.blocks_evictable.set(evictable)
        self.fragmentation.set(fragmentation)
        self.running.set(running)
        # the pool and scheduler keep running totals; counters advance by the difference
        self.evictions.labels("hbm").inc(num_evictions - self._evictions_seen)
        self._evictions_seen = num_evictions
        self.preemptions.inc(num_preemptions - self._preemptions_seen)
        self._preemptions_seen = num_preemptions
        for reason in QueueReason:
            self.queue_reason.labels(reason.value).set(queue_reasons.get(reason.value, 0))


    def observe_tenant_blocks(self, blocks: dict[TierName, dict[str, int]]) -> None:
        """Set each (tenant, tier) series; a series seen before and absent now drops to 0."""
        now = {(label, tier.value): n for tier, per in blocks.items() for label, n in per.items()}
        for key in self._tenant_blocks_seen - now.keys():
            self.tenant_blocks.labels(*key).set(0)
        for key, n in now.items():
            self.tenant_blocks.labels(*key).set(n)
        self._tenant_blocks_seen |= now.keys()


class CacheTimer:
    """Seconds of cache-management work per ``CachePhase``: the ``CacheObserver`` the engine gives
    its ``KVCacheManager``, and the cost side of the cache's break-even.

    Pure-CPU phases use the calling thread's CPU time: wall time would also count GIL waits and
    descheduling, which belong to other work (seen: 5-30 ms outliers on a loaded 2-core machine).
    Phases that wait on I/O (``wall_phases``) use a wall clock. Phases nest (an eviction inside a
    restore's allocation): a nested phase's seconds count in it and are taken out of the enclosing
    one, so the phases stay disjoint and their sum counts each second once.

    ``phase`` is for the step-loop thread; ``add`` may be called from any thread (``prepare``
    hashes on the caller's thread). ``clock`` replaces both clocks (tests).
    """

    def __init__(self, wall_phases: frozenset[CachePhase] = frozenset(),
                 clock: Callable[[], float] | None = None) -> None:
        self._wall = wall_phases
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds: dict[CachePhase, float] = dict.fromkeys(CachePhase, 0.0)
        self._inner: list[float] = []  # per open phase: seconds of the phases nested in it

    def add(self, phase: CachePhase, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] += seconds

    def seconds(self) -> dict[CachePhase, float]:
        with self._lock:
            return dict(self._seconds)

    @contextmanager
    def phase(self, phase: CachePhase) -> Iterator[None]:
        clock = self._clock or (time.perf_counter if phase in self._wall else time.thread_time)
        self._inner.append(0.0)
        t0 = clock()
        try:
            yield
        finally:
            elapsed = clock() - t0
            inner = self._inner.pop()
            self.add(phase, max(0.0, elapsed - inner))
            if self._inner:
                self._inner[-1] += elapsed
