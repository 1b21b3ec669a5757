"""Bounded in-memory time series behind the dashboard's charts, sampled from the ``/metrics`` registry.

Every ``step`` seconds the sampler reads the same ``CollectorRegistry`` that ``/metrics`` exposes
(so a chart and a scrape cannot disagree) into one :class:`Frame`: cumulative counters as they are,
gauges as they are, and the TTFT/TPOT quantiles of the requests that finished since the last frame
(computed from the observed values, so no quantile exceeds the slowest request). Each window keeps
its own ring at a fixed resolution::

    window  span     step   points           frame kept
    5m      300 s    5 s    60               every sample
    1h      3600 s   60 s   60               one per minute (counters: the last; quantiles: the minute's)
    24h     86400 s  20 min 72               one per 20 minutes

Memory is fixed: 192 frames of ~60 numbers, whatever the traffic. Counters become per-second
rates when served (difference of two frames / their distance in time).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gateway.metrics import LiveStats, Observation, percentile


@dataclass(frozen=True)
class Window:
    name: str
    span_s: int
    step_s: int

    @property
    def points(self) -> int:
        return self.span_s // self.step_s


WINDOWS: dict[str, Window] = {w.name: w for w in (
    Window("5m", 300, 5),
    Window("1h", 3600, 60),
    Window("24h", 86400, 1200),
)}

TIERS = ("hbm", "dram", "nvme")
_QUANTILES = (50, 95, 99)


@dataclass(frozen=True)
class Frame:
    at: float
    counters: dict[str, float]  # cumulative: served as rates
    gauges: dict[str, float]  # served as they are


Samples = dict[str, list[tuple[dict[str, str], float]]]


def read_registry(registry: CollectorRegistry) -> Samples:
    """Every sample of ``registry``, grouped by sample name: ``{name: [(labels, value)]}``."""
    out: Samples = {}
    for family in registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _sum(samples: Samples, name: str, **match: str) -> float:
    """Sum of ``name``'s samples whose labels include ``match``."""
    return sum(v for labels, v in samples.get(name, ()) if all(labels.get(k) == want for k, want in match.items()))


def tenant_blocks(registry: CollectorRegistry) -> dict[str, dict[str, int]]:
    """Blocks each tenant (metrics label) holds per tier now: ``{label: {"hbm"|"dram"|"nvme": n}}``,
    from the engine's ``prefixgate_kv_tenant_blocks`` gauge (summed over engines sharing the registry)."""
    out: dict[str, dict[str, int]] = {}
    for labels, v in read_registry(registry).get("prefixgate_kv_tenant_blocks", ()):
        per = out.setdefault(labels["tenant"], {})
        per[labels["tier"]] = per.get(labels["tier"], 0) + int(v)
    return out


def _label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {labels[label] for labels, _ in samples.get(name, ()) if label in labels}


def frame_from_registry(registry: CollectorRegistry, at: float) -> Frame:
    """The counters and gauges the panel charts, read from the registry at time ``at``."""
    s = read_registry(registry)
    c: dict[str, float] = {}
    g: dict[str, float] = {}
    for outcome in _label_values(s, "prefixgate_gateway_requests_total", "outcome"):
        c[f"requests.{outcome}"] = _sum(s, "prefixgate_gateway_requests_total", outcome=outcome)
    c["requests.401"] = _sum(s, "prefixgate_gateway_unauthenticated_requests_total")
    c["prompt_tokens"] = _sum(s, "prefixgate_gateway_prompt_tokens_total")
    c["cached_tokens"] = _sum(s, "prefixgate_gateway_cached_tokens_total")
    c["prefill_tokens"] = _sum(s, "prefixgate_prefill_tokens_total")
    c["decode_tokens"] = _sum(s, "prefixgate_decode_tokens_total")
    c["evictions.hbm"] = _sum(s, "prefixgate_kv_evictions_total", tier="hbm")
    for tier in ("dram", "nvme"):
        c[f"demotions.{tier}"] = _sum(s, "prefixgate_tier_demotions_total", tier=tier)
        c[f"evictions.{tier}"] = _sum(s, "prefixgate_tier_drops_total", tier=tier, reason="evicted")
        c[f"restores.{tier}"] = _sum(s, "prefixgate_tier_restore_seconds_count", tier=tier)
        c[f"restore_seconds.{tier}"] = _sum(s, "prefixgate_tier_restore_seconds_sum", tier=tier)
    c["cache_manage_seconds"] = _sum(s, "prefixgate_cache_manage_seconds_total")
    c["prefill_seconds"] = _sum(s, "prefixgate_prefill_seconds_total")
    block_size = _sum(s, "prefixgate_kv_block_size")
    bytes_per_token = _sum(s, "prefixgate_kv_bytes_per_token")
    used = _sum(s, "prefixgate_kv_blocks_used")
    total = used + _sum(s, "prefixgate_kv_blocks_free")  # free counts the evictable (cached) blocks
    per_block = block_size * bytes_per_token
    # held = referenced by requests + cached prefixes kept until evicted; active = referenced only
    g["kv_bytes.hbm"] = (used + _sum(s, "prefixgate_kv_blocks_evictable")) * per_block
    g["kv_bytes.hbm_active"] = used * per_block
    g["kv_capacity.hbm"] = total * per_block
    for tier in ("dram", "nvme"):
        g[f"kv_bytes.{tier}"] = _sum(s, "prefixgate_tier_bytes_used", tier=tier)
        g[f"kv_capacity.{tier}"] = _sum(s, "prefixgate_tier_capacity_bytes", tier=tier)
    g["kv_bytes_per_token"] = bytes_per_token
    g["fragmentation"] = _sum(s, "prefixgate_kv_fragmentation")
    g["running"] = _sum(s, "prefixgate_running_requests")
    for reason in _label_values(s, "prefixgate_waiting_requests", "reason"):
        g[f"queue.{reason}"] = _sum(s, "prefixgate_waiting_requests", reason=reason)
    return Frame(at, c, g)


def latency_quantiles(observations: Iterable[Observation]) -> dict[str, float]:
    """``ttft_p50`` .. ``tpot_p99`` of the observed values (absent when nothing was observed)."""
    out: dict[str, float] = {}
    obs = list(observations)
    for name in ("ttft", "tpot"):
        values = sorted(v for v in (getattr(o, name) for o in obs) if v is not None)
        for q in _QUANTILES:
            p = percentile(values, q)
            if p is not None:
                out[f"{name}_p{q}"] = p
        if values:
            out[f"{name}_max"] = values[-1]
    return out


class TimeSeries:
    """Fixed-resolution rings of :class:`Frame` per window (thread-safe)."""

    def __init__(self, registry: CollectorRegistry, live: LiveStats,
                 clock: Callable[[], float] = time.time) -> None:
        self._registry = registry
        self._live = live
        self._clock = clock
        self._lock = threading.Lock()
        self._rings: dict[str, deque[Frame]] = {w.name: deque(maxlen=w.points + 1) for w in WINDOWS.values()}

    @property
    def step_s(self) -> int:
        return WINDOWS["5m"].step_s

    def sample(self) -> None:
        """Take one frame now and add it to every window whose step has elapsed since its last frame."""
        now = self._clock()
        base = frame_from_registry(self._registry, now)
        with self._lock:
            for w in WINDOWS.values():
                ring = self._rings[w.name]
                if ring and now - ring[-1].at < w.step_s * 0.999:
                    continue
                since = ring[-1].at if ring else now - w.step_s
                lat = latency_quantiles(self._live.observations(since, now))
                ring.append(Frame(now, base.counters, {**base.gauges, **lat}))

    def series(self, window: str) -> dict:
        """The window as columns: ``t`` (unix seconds) and one list per series (None = no value).

        Counters are per-second rates over the interval ending at each point (the first point has
        none); ``hit_rate`` = cached / prompt tokens of the interval; ``restore_ms.<tier>`` = mean
        restore time of the interval; ``kv_share.<tier>`` = bytes / capacity.
        """
        w = WINDOWS[window]
        with self._lock:
            frames = list(self._rings[w.name])
        names_c = sorted({k for f in frames for k in f.counters})
        names_g = sorted({k for f in frames for k in f.gauges})
        cols: dict[str, list[float | None]] = {n: [] for n in (*names_c, *names_g)}
        for extra in ("hit_rate", *(f"restore_ms.{t}" for t in ("dram", "nvme")),
                      *(f"kv_share.{t}" for t in TIERS)):
            cols[extra] = []
        prev: Frame | None = None
        for f in frames:
            dt = f.at - prev.at if prev is not None else 0.0
            delta = {n: f.counters.get(n, 0.0) - prev.counters.get(n, 0.0) for n in names_c} if prev else {}
            for n in names_c:
                cols[n].append(max(0.0, delta[n]) / dt if prev is not None and dt > 0 else None)
            for n in names_g:
                cols[n].append(f.gauges.get(n))
            prompt = delta.get("prompt_tokens", 0.0)
            cols["hit_rate"].append(delta.get("cached_tokens", 0.0) / prompt if prompt > 0 else None)
            for tier in ("dram", "nvme"):
                count = delta.get(f"restores.{tier}", 0.0)
                cols[f"restore_ms.{tier}"].append(
                    1000 * delta.get(f"restore_seconds.{tier}", 0.0) / count if count > 0 else None)
            for tier in TIERS:
                cap = f.gauges.get(f"kv_capacity.{tier}", 0.0)
                cols[f"kv_share.{tier}"].append(f.gauges.get(f"kv_bytes.{tier}", 0.0) / cap if cap else None)
            prev = f
        return {"window": w.name, "step_s": w.step_s, "span_s": w.span_s, "t": [f.at for f in frames],
                "series": cols}
