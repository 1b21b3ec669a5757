"""Past one machine, in simulation: routing policies for 4 to 256 engine replicas and 1 to 100k tenants.

A trace-driven, discrete-event model of a fleet of prefix-caching engine replicas behind one
routing tier. It answers the question the loopback fleet tests cannot: how do the routing policies
compare, and where does each break down, at a size no test machine holds? What it models, and
what it does not:

    tenants ──► templates (a shared prefix per template, 512–4,096 tokens) + a unique suffix
        │  Poisson arrivals; tenant popularity Zipf(s); the offered load is a fraction of the
        │  fleet's capacity *without* any cache (so a cache that works leaves headroom)
        ▼
    router (one of POLICIES) ──► replica r:  LRU cache of block keys (16-token blocks, the
                                 engine's own unit), a FIFO prefill server of `prefill_tok_s`
                                 tokens per second; TTFT = queueing + (uncached tokens / rate)
                                 + a fixed per-request overhead

* Hits are prefix hits in the engine's sense: the longest run of leading blocks of the request's
  chain that the replica still holds. Tenants never share blocks (namespaced hashes).
* The cache-aware policy reads an index fed by the replicas' stored/evicted block events (what
  vLLM's KV events and PrefixGate nodes publish), applied at once: the "approximate" index of a
  real fleet lags by the event delay, which this model leaves out (it flatters that policy a
  little at high churn).
* Decode is not modelled (a decode step does not change which replica holds a prefix; it adds
  the same load whichever replica decodes); neither are failures or replica heterogeneity.

Run:  python benchmarks/fleet_sim.py            (the default grid, a few minutes on one core)
      python benchmarks/fleet_sim.py --quick    (a smaller grid, ~20 s)
Writes benchmarks/results/fleet_sim_<stamp>.json (with command, machine and commit), a table on
stdout, and a chart benchmarks/results/fleet_sim_<stamp>.png.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import git_commit  # noqa: E402 - after the path insert

RESULTS = ROOT / "benchmarks" / "results"
BLOCK_TOKENS = 16

# Written before the first run (the reasoning is in docs/fleet.md):
PREDICTION = {
    "1 tenant": "prefix_hash sends every request to one replica: imbalance = replicas, TTFT p99 explodes; "
                "the bounded and cache-aware policies keep hit rate > 0.8 with imbalance < 1.5",
    "100 tenants": "cache-aware within a load bound has the best hit rate and TTFT; round-robin's hit "
                   "rate falls as 1/replicas once a tenant's templates do not fit every replica",
    "100k tenants": "few repeats within the trace: every policy's hit rate is low and alike; "
                    "least-loaded gives the best TTFT, affinity buys almost nothing",
}


class Policy(StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_HASH = "prefix_hash"              # rendezvous on (namespace, leading block): pure affinity
    PREFIX_HASH_GUARD = "prefix_hash_guard"  # the gateway's router today: rendezvous + an inflight guard
    BOUNDED_HASH = "bounded_hash"            # rendezvous with bounded loads (first replica under the bound)
    CACHE_AWARE = "cache_aware"              # longest cached prefix from the KV-event index, within a bound


@dataclass(frozen=True)
class TraceConfig:
    tenants: int
    requests: int
    templates_per_tenant: tuple[int, int] = (1, 3)
    prefix_tokens: tuple[int, ...] = (512, 1024, 2048, 4096)
    suffix_tokens: tuple[int, int] = (32, 512)
    zipf_s: float = 1.1
    seed: int = 0


@dataclass(frozen=True)
class FleetConfig:
    replicas: int
    cache_blocks: int = 8192          # 128K tokens of KV per replica
    prefill_tok_s: float = 20_000.0   # per replica, uncached prompt tokens per second
    overhead_s: float = 0.010         # per request: scheduling, first decode step, network
    load: float = 0.7                 # offered load as a share of the no-cache capacity
    bound: float = 1.25               # bounded policies: a replica may hold at most bound x mean work


@dataclass
class Request:
    t: float
    tenant: int
    template: int
    prefix_blocks: int
    suffix_tokens: int


@dataclass
class Trace:
    requests: list[Request]
    mean_prompt_tokens: float


def zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def build_trace(cfg: TraceConfig, arrival_rate: float) -> Trace:
    """Requests with Poisson arrivals at ``arrival_rate`` per second (deterministic per seed)."""
    rng = np.random.default_rng(cfg.seed)
    lo, hi = cfg.templates_per_tenant
    n_templates = rng.integers(lo, hi + 1, size=cfg.tenants)
    # a template's prefix length is fixed for the trace, as a real system prompt is
    template_len: dict[tuple[int, int], int] = {}
    tenants = rng.choice(cfg.tenants, size=cfg.requests, p=zipf_weights(cfg.tenants, cfg.zipf_s))
    gaps = rng.exponential(1.0 / arrival_rate, size=cfg.requests)
    suffixes = rng.integers(cfg.suffix_tokens[0], cfg.suffix_tokens[1] + 1, size=cfg.requests)
    templates = rng.random(cfg.requests)
    reqs: list[Request] = []
    t = 0.0
    for i in range(cfg.requests):
        t += gaps[i]
        ten = int(tenants[i])
        tpl = int(templates[i] * n_templates[ten])
        key = (ten, tpl)
        if key not in template_len:
            template_len[key] = int(rng.choice(cfg.prefix_tokens))
        reqs.append(Request(t, ten, tpl, template_len[key] // BLOCK_TOKENS, int(suffixes[i])))
    mean = float(np.mean([r.prefix_blocks * BLOCK_TOKENS + r.suffix_tokens for r in reqs]))
    return Trace(reqs, mean)


def mean_prompt_tokens(cfg: TraceConfig) -> float:
    """The trace's mean prompt length, from a small pilot draw (to set the arrival rate)."""
    pilot = build_trace(TraceConfig(**{**asdict(cfg), "requests": min(cfg.requests, 4000)}), 1.0)
    return pilot.mean_prompt_tokens


class Replica:
    """An LRU cache of block keys and a FIFO prefill server."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.busy_until = 0.0
        self.work_s = 0.0

    def cached_prefix(self, chain: list[int]) -> int:
        n = 0
        for key in chain:
            if key not in self.lru:
                break
            n += 1
        return n

    def insert(self, keys: list[int], evicted: list[int]) -> None:
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)
            else:
                self.lru[key] = None
        while len(self.lru) > self.capacity:
            evicted.append(self.lru.popitem(last=False)[0])


class EventIndex:
    """Block key -> replicas holding it, kept from stored/evicted events (the fleet-wide index)."""

    def __init__(self) -> None:
        self.where: dict[int, set[int]] = {}

    def stored(self, replica: int, keys: list[int]) -> None:
        for k in keys:
            self.where.setdefault(k, set()).add(replica)

    def evicted(self, replica: int, keys: list[int]) -> None:
        for k in keys:
            s = self.where.get(k)
            if s is not None:
                s.discard(replica)
                if not s:
                    del self.where[k]

    def longest(self, chain: list[int]) -> tuple[int, set[int]]:
        """(blocks, replicas) of the longest prefix of ``chain`` some replica holds."""
        best: set[int] = set()
        n = 0
        for key in chain:
            s = self.where.get(key)
            cur = s if n == 0 else (best & s if s else set())
            if not cur:
                break
            best, n = set(cur), n + 1
        return n, best


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-spread hash for rendezvous weights (vectorised)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def rotating_argmin(values: np.ndarray, start: int) -> int:
    """The index of the smallest value, ties going to the first one at or after ``start`` (mod n).

    Ties (idle replicas) rotate, as a real router's would: a plain argmin piles all idle-time work
    onto replica 0, which then reads as load imbalance that no real fleet has.
    """
    n = len(values)
    return (int(np.argmin(np.roll(values, -start))) + start) % n


@dataclass
class RunResult:
    policy: str
    replicas: int
    tenants: int
    requests: int
    hit_rate: float
    imbalance: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    slo_miss: float          # share of requests with TTFT over 10 x the no-queue TTFT of a miss
    routing_us: float        # the router's own cost per request in this Python model
    extra: dict = field(default_factory=dict)


def simulate(policy: Policy, fleet: FleetConfig, trace: Trace, tenants: int) -> RunResult:
    n = fleet.replicas
    replicas = [Replica(fleet.cache_blocks) for _ in range(n)]
    index = EventIndex() if policy is Policy.CACHE_AWARE else None
    salts = _mix64(np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    inflight: list[tuple[float, int]] = []  # (finish time, replica): for the inflight guard
    inflight_count = np.zeros(n, dtype=np.int64)
    busy = np.zeros(n)
    rr = -1
    suffix_id = -1
    hit_tokens = total_tokens = 0
    ttfts = np.empty(len(trace.requests))
    route_s = 0.0
    for i, req in enumerate(trace.requests):
        now = req.t
        while inflight and inflight[0][0] <= now:
            _, r = heapq.heappop(inflight)
            inflight_count[r] -= 1
        base = (req.tenant * 8 + req.template) << 20
        chain = [base | b for b in range(req.prefix_blocks)]
        backlog = np.maximum(busy - now, 0.0)
        t0 = time.perf_counter()
        rr += 1

        if policy is Policy.ROUND_ROBIN:
            r = rr % n
        elif policy is Policy.LEAST_LOADED:
            r = rotating_argmin(backlog, rr)
        else:
            mean = float(backlog.mean())
            limit = fleet.bound * mean + fleet.overhead_s
            if policy is Policy.CACHE_AWARE:
                blocks, holders = index.longest(chain)
                under = sorted(h for h in holders if backlog[h] <= limit)
                if blocks and under:
                    r = min(under, key=lambda h: (backlog[h], (h - rr) % n))
                else:
                    r = rotating_argmin(backlog, rr)
            else:
                weights = _mix64(np.uint64(base) ^ salts)
                if policy is Policy.PREFIX_HASH:
                    r = int(np.argmax(weights))
                elif policy is Policy.PREFIX_HASH_GUARD:
                    best = int(np.argmax(weights))
                    least = int(inflight_count.min())
                    # gateway/routing.py choose(): leave the affinity replica only past 2 x (least + 1)
                    if inflight_count[best] <= 2 * (least + 1):
                        r = best
                    else:
                        r = rotating_argmin(inflight_count, rr)
                else:  # BOUNDED_HASH
                    order = np.argsort(weights)[::-1]
                    r = next((int(h) for h in order if backlog[h] <= limit), int(order[0]))
        route_s += time.perf_counter() - t0
        rep = replicas[r]
        cached = rep.cached_prefix(chain)
        prompt = req.prefix_blocks * BLOCK_TOKENS + req.suffix_tokens
        uncached = prompt - cached * BLOCK_TOKENS
        service = fleet.overhead_s + uncached / fleet.prefill_tok_s
        start = max(now, rep.busy_until)
        rep.busy_until = start + service
        rep.work_s += service
        busy[r] = rep.busy_until
        ttfts[i] = rep.busy_until - now
        heapq.heappush(inflight, (rep.busy_until, r))
        inflight_count[r] += 1
        hit_tokens += cached * BLOCK_TOKENS
        total_tokens += prompt
        # the prefill stores the whole prompt's full blocks: the prefix chain and the unique suffix
        n_suffix = req.suffix_tokens // BLOCK_TOKENS
        suffix = list(range(suffix_id, suffix_id - n_suffix, -1))
        suffix_id -= n_suffix
        evicted: list[int] = []
        new = chain[cached:] + suffix
        rep.insert(chain[:cached] + new, evicted)
        if index is not None:
            index.stored(r, new)
            index.evicted(r, evicted)
    work = np.array([rep.work_s for rep in replicas])
    miss_ttft = fleet.overhead_s + trace.mean_prompt_tokens / fleet.prefill_tok_s
    return RunResult(
        policy=policy.value, replicas=n, tenants=tenants, requests=len(trace.requests),
        hit_rate=hit_tokens / max(total_tokens, 1),
        imbalance=float(work.max() / max(work.mean(), 1e-12)),
        ttft_p50_ms=float(np.percentile(ttfts, 50) * 1e3), ttft_p99_ms=float(np.percentile(ttfts, 99) * 1e3),
        slo_miss=float(np.mean(ttfts > 10 * miss_ttft)),
        routing_us=route_s / len(trace.requests) * 1e6,
    )


def run_grid(replica_counts: list[int], tenant_counts: list[int], requests_per_replica: int,
             fleet_kw: dict, policies: list[Policy], progress: Callable[[str], None]) -> list[RunResult]:
    results = []
    for tenants in tenant_counts:
        for n in replica_counts:
            fleet = FleetConfig(replicas=n, **fleet_kw)
            tcfg = TraceConfig(tenants=tenants, requests=requests_per_replica * n)
            rate = fleet.load * n * fleet.prefill_tok_s / mean_prompt_tokens(tcfg)
            trace = build_trace(tcfg, rate)
            for policy in policies:
                t0 = time.perf_counter()
                res = simulate(policy, fleet, trace, tenants)
                res.extra["wall_s"] = round(time.perf_counter() - t0, 2)
                results.append(res)
                progress(f"tenants={tenants:>6} replicas={n:>3} {policy.value:<17} hit={res.hit_rate:.3f} "
                         f"imb={res.imbalance:5.2f} p99={res.ttft_p99_ms:9.1f} ms ({res.extra['wall_s']} s)")
    return results


def table(results: list[RunResult]) -> str:
    head = (f"{'tenants':>7} {'repl':>4} {'policy':<17} {'hit':>6} {'imbal':>6} {'p50 ms':>8} "
            f"{'p99 ms':>9} {'slo miss':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.tenants:>7} {r.replicas:>4} {r.policy:<17} {r.hit_rate:>6.3f} {r.imbalance:>6.2f} "
                     f"{r.ttft_p50_ms:>8.1f} {r.ttft_p99_ms:>9.1f} {r.slo_miss:>8.3f}")
    return "\n".join(lines)


def chart(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenant_counts = sorted({r.tenants for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    fig, axes = plt.subplots(3, len(tenant_counts), figsize=(4.2 * len(tenant_counts), 10), squeeze=False)
    for col, tenants in enumerate(tenant_counts):
        for policy in policies:
            rows = sorted((r for r in results if r.tenants == tenants and r.policy == policy),
                          key=lambda r: r.replicas)
            xs = [r.replicas for r in rows]
            axes[0][col].plot(xs, [r.hit_rate for r in rows], marker="o", label=policy)
            axes[1][col].plot(xs, [r.imbalance for r in rows], marker="o", label=policy)
            axes[2][col].plot(xs, [r.ttft_p99_ms for r in rows], marker="o", label=policy)
        axes[0][col].set_title(f"{tenants:,} tenant{'s' if tenants > 1 else ''}")
        for row, label in enumerate(("prefix hit rate", "load imbalance (max/mean)", "TTFT p99 (ms, modelled)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("replicas")
            ax.set_ylabel(label)
            if row > 0:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="4,16,64,256", help="comma-separated replica counts")
    ap.add_argument("--tenants", default="1,100,10000,100000", help="comma-separated tenant counts")
    ap.add_argument("--requests-per-replica", type=int, default=150)
    ap.add_argument("--cache-blocks", type=int, default=8192, help="KV blocks of 16 tokens per replica")
    ap.add_argument("--load", type=float, default=0.7, help="offered load as a share of no-cache capacity")
    ap.add_argument("--policies", default=",".join(p.value for p in Policy))
    ap.add_argument("--quick", action="store_true", help="replicas 4,16,64; tenants 1,100,10000; 80 req/replica")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/fleet_sim_*.json)")
    args = ap.parse_args(argv)
    try:
        replica_counts = [int(x) for x in args.replicas.split(",")]
        tenant_counts = [int(x) for x in args.tenants.split(",")]
        policies = [Policy(p) for p in args.policies.split(",")]
    except ValueError as exc:
        print(f"fleet_sim: {exc}", file=sys.stderr)
        return 2
    if args.quick:
        replica_counts, tenant_counts, args.requests_per_replica = [4, 16, 64], [1, 100, 10000], 80
    commit = git_commit()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    fleet_kw = {"cache_blocks": args.cache_blocks, "load": args.load}
    t0 = time.perf_counter()
    results = run_grid(replica_counts, tenant_counts, args.requests_per_replica, fleet_kw, policies,
                       lambda s: print(s, file=sys.stderr, flush=True))
    out = args.out or RESULTS / f"fleet_sim_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    chart(results, png)
    doc = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "git_commit": commit,
        "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0]},
        "wall_s": round(time.perf_counter() - t0, 1),
        "fleet": asdict(FleetConfig(replicas=0, **fleet_kw)),
        "trace": {k: v for k, v in asdict(TraceConfig(tenants=0, requests=0)).items()
                  if k not in ("tenants", "requests")},
        "requests_per_replica": args.requests_per_replica,
        "prediction": PREDICTION,
        "results": [asdict(r) for r in results],
        "chart": png.name,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(results))
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} and {png.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
