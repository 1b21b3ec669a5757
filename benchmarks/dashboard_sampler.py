"""What the dashboard's time-series sampler costs, against one /metrics scrape measured in the same run.

Builds the registry a busy server would have (the gateway's, the engine's and the tiers' metrics)
with ``--tenants`` tenants, each with traffic in every per-tenant series, and times, interleaved:

    scrape    prometheus_client.generate_latest(registry)    what one GET /metrics costs
    sample    TimeSeries.sample()                            what the panel costs every 5 s

    python benchmarks/dashboard_sampler.py [--tenants 20] [--rounds 200]

Writes ``benchmarks/results/dashboard_sampler.json`` (command, machine, commit, load average).

Prediction, written before the first run: both are dominated by ``registry.collect()``;
the sampler skips the text formatting, so sample / scrape ~0.5, and a few ms each for 20 tenants on
the 2-core build machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from engine.metrics import EngineMetrics  # noqa: E402
from engine.request import QueueReason  # noqa: E402
from engine.tiers.metrics import TierMetrics  # noqa: E402
from gateway.metrics import GatewayMetrics, LiveStats, Outcome, RequestSample  # noqa: E402
from gateway.timeseries import TimeSeries  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "dashboard_sampler.json"


def busy_registry(tenants: int) -> tuple[CollectorRegistry, LiveStats]:
    registry, live = CollectorRegistry(), LiveStats()
    gateway, engine, tiers = GatewayMetrics(registry), EngineMetrics(registry), TierMetrics(registry)
    for reason in QueueReason:
        engine.queue_reason.labels(reason.value).set(1)
    for i in range(tenants):
        label = f"tenant-{i}"
        for outcome in Outcome:
            gateway.count(label, "local", "ok", outcome)
        gateway.prompt_tokens.labels(label, "local").inc(100)
        gateway.cached_tokens.labels(label, "local").inc(50)
        gateway.completion_tokens.labels(label, "local").inc(10)
        gateway.cost_usd.labels(label).inc(0.01)
        gateway.saved_usd.labels(label).inc(0.01)
        gateway.ttft.labels(label, "local").observe(0.1)
        gateway.latency.labels(label, "local").observe(0.5)
        engine.observe_admission(label, 100, 50)
        engine.observe_finished(label, "stop", 0.1, [0.1, 0.11, 0.12])
        for tier in ("dram", "nvme"):
            for counter in (tiers.hits, tiers.restores, tiers.restore_bytes, tiers.demotions, tiers.auth_failures):
                counter.labels(tier, label).inc()
        for _ in range(20):
            live.add(RequestSample(tenant_id=label, tenant=label, outcome=Outcome.OK, ttft=0.1, latency=0.5,
                                   completion=10))
    for tier in ("dram", "nvme"):
        tiers.restore_seconds.labels(tier).observe(0.002)
    return registry, live


def machine() -> dict[str, object]:
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "load_average": os.getloadavg()}


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    registry, live = busy_registry(args.tenants)
    series = TimeSeries(registry, live)
    samples = sum(len(f.samples) for f in registry.collect())
    times: dict[str, list[float]] = {"scrape": [], "sample": []}
    for _ in range(args.rounds):  # interleaved, so load on the shared machine hits both alike
        t0 = time.perf_counter()
        generate_latest(registry)
        t1 = time.perf_counter()
        series.sample()
        t2 = time.perf_counter()
        times["scrape"].append(t1 - t0)
        times["sample"].append(t2 - t1)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.tenants} tenants, {samples} samples in the registry, {args.rounds} rounds, median ms")
    print("| what | median ms | p90 ms | / scrape |")
    print("|---|---|---|---|")
    for k, v in times.items():
        p90 = sorted(v)[int(0.9 * len(v))]
        print(f"| {k} | {1e3 * med[k]:.2f} | {1e3 * p90:.2f} | {med[k] / med['scrape']:.2f} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/dashboard_sampler.py", *sys.argv[1:]]),
        "machine": machine(), "commit": commit(), "tenants": args.tenants, "registry_samples": samples,
        "rounds": args.rounds, "median_s": med, "sample_over_scrape": med["sample"] / med["scrape"],
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
