"""Request-path costs of tenancy and the ledger's write throughput, on this machine.

    python benchmarks/tenancy_bench.py [--rows 20000] [--out benchmarks/results/]

Prints a table and writes JSON (command, machine, git commit, figures, and the predictions written
before the first run) under benchmarks/results/. Each figure is the median of 5 repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from tenancy.crypto import TenantCipher, new_data_key  # noqa: E402
from tenancy.service import TenancyService  # noqa: E402
from tenancy.types import UsageRecord  # noqa: E402

# Written before the first measurement (2 CPU cores, no AES doubts: x86 with AES-NI assumed).
PREDICTIONS = {
    "authenticate_cached_us": 3.0,
    "authenticate_uncached_us": 80.0,
    "admit_rpm_tpm_us": 4.0,
    "record_usage_request_path_us": 15.0,
    "ledger_rows_per_s": 30_000.0,
    "encrypt_64KiB_MBps": 1500.0,
    "decrypt_64KiB_MBps": 1500.0,
}


def per_op_us(fn: Callable[[], object], n: int) -> float:
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        reps.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000, help="ledger rows per throughput repeat")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="pg-bench-"))
    svc = TenancyService.open(home, auth_cache_ttl_s=3600)
    created = svc.create_tenant("bench", rpm=10**9, tpm=10**12)
    ctx = svc.authenticate(created.api_key)
    results: dict[str, float] = {}
    results["authenticate_cached_us"] = per_op_us(lambda: svc.authenticate(created.api_key), 20_000)
    nocache = TenancyService.open(home, auth_cache_ttl_s=0.0)
    results["authenticate_uncached_us"] = per_op_us(lambda: nocache.authenticate(created.api_key), 2_000)
    nocache.close()
    results["admit_rpm_tpm_us"] = per_op_us(lambda: svc.admit(ctx, estimated_tokens=100), 20_000)

    counter = iter(range(10**9))

    def record() -> None:
        svc.record_usage(UsageRecord(f"r{next(counter)}", ctx.tenant_id, ctx.key_id, "gpt-4o-mini", "local",
                                     1000, 600, 50, 0.1, 0.5, "ok", time.time()))

    results["record_usage_request_path_us"] = per_op_us(record, 5_000)
    svc.flush()

    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.rows):
            record()
        svc.flush()
        rates.append(args.rows / (time.perf_counter() - t0))
    results["ledger_rows_per_s"] = statistics.median(rates)
    svc.close()

    cipher = TenantCipher(new_data_key(), owner="bench")
    block = os.urandom(64 * 1024)
    aad = b"namespace|model|hash|v1"
    blob = cipher.encrypt(block, aad)
    results["encrypt_64KiB_MBps"] = 64 * 1024 / per_op_us(lambda: cipher.encrypt(block, aad), 2_000)
    results["decrypt_64KiB_MBps"] = 64 * 1024 / per_op_us(lambda: cipher.decrypt(blob, aad), 2_000)

    print(f"{'figure':<32} {'measured':>12} {'predicted':>12}")
    for k, v in results.items():
        print(f"{k:<32} {v:>12.1f} {PREDICTIONS[k]:>12.1f}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT).stdout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"tenancy_{stamp}.json"
    path.write_text(json.dumps({
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "git_commit": commit + ("-dirty" if dirty else ""),
        "load_average_1_5_15": list(os.getloadavg()),  # the build machine is shared: context for the figures
        "units": {"_us": "microseconds per call", "_per_s": "rows per second", "_MBps": "bytes per microsecond = MB/s"},
        "results": results,
        "predictions": PREDICTIONS,
    }, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
