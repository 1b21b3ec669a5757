"""Server CPU per request of gateways from several checkouts, interleaved, at nanosecond resolution.

``gateway.py overhead`` reads CPU time from /proc in 10 ms ticks: over 300 requests of ~0.8 ms that is
a 4 % step, coarser than the changes it is meant to show. This reads each server's process CPU clock
(``clock_getcpuclockid`` + ``clock_gettime``, Linux; all threads, so the ledger writer counts too),
and alternates the order of the gateways every round so that load from other processes falls on
all of them alike. Only the direct transport, only CPU (no latency: ``gateway.py overhead`` has it).

Run:  python benchmarks/gateway_cpu_ab.py --tree new=. --tree base=/tmp/gwbase [--rounds 10] [-n 300]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the project is not installed
import benchmarks.gateway as bench  # noqa: E402 - the upstream, tenant and request helpers of `overhead`

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` so far (user + system, all threads), to the nanosecond."""
    clock = ctypes.c_int()
    if _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError(f"clock_getcpuclockid({pid}) failed")
    ts = _Timespec()
    if _libc.clock_gettime(clock.value, ctypes.byref(ts)) != 0:
        raise OSError(ctypes.get_errno(), "clock_gettime")
    return ts.tv_sec + ts.tv_nsec * 1e-9


async def measure(targets: list[bench.Target], rounds: int, n: int) -> dict[str, dict[str, list[float]]]:
    per: dict[str, dict[str, list[float]]] = {t.name: {"whole": [], "stream": []} for t in targets}
    async with httpx.AsyncClient(timeout=60) as client:
        for t in targets:  # warm every code path and connection
            for _ in range(100):
                await bench.whole(client, t)
                await bench.streamed(client, t)
        for r in range(rounds):
            for t in targets if r % 2 == 0 else targets[::-1]:
                c0 = process_cpu_s(t.pid)
                for _ in range(n):
                    await bench.whole(client, t)
                c1 = process_cpu_s(t.pid)
                for _ in range(n):
                    await bench.streamed(client, t)
                c2 = process_cpu_s(t.pid)
                per[t.name]["whole"].append(1e6 * (c1 - c0) / n)
                per[t.name]["stream"].append(1e6 * (c2 - c1) / n)
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout (repeat)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("-n", type=int, default=300, help="requests per gateway, per round, per kind")
    args = ap.parse_args()
    env = bench.base_env()
    procs: list[subprocess.Popen] = []
    try:
        tmp = Path(tempfile.mkdtemp(prefix="pg-cpu-ab-"))
        up = bench.start_upstream(tmp, env, procs)
        key = bench.bench_tenant(tmp / "home")
        targets = []
        for spec in args.tree:
            name, tree = spec.split("=", 1)
            tree = str(Path(tree).resolve())
            port = bench.free_port()
            (tmp / f"{name}.toml").write_text(bench.route_toml(up, "direct"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gateway.cli.main", "serve", "--model", "none", "--home", str(tmp / "home"),
                 "--port", str(port), "--config", str(tmp / f"{name}.toml"), "--log-level", "warning"],
                cwd=tree, env={**env, "PYTHONPATH": tree, "BENCH_UP_KEY": "sk-up"}, stderr=subprocess.DEVNULL))
            bench.wait_up(f"http://127.0.0.1:{port}", procs[-1])
            targets.append(bench.Target(name, f"http://127.0.0.1:{port}/v1/chat/completions",
                                        {"Authorization": f"Bearer {key}"}, procs[-1].pid))
        per = asyncio.run(measure(targets, args.rounds, args.n))
    finally:
        bench.stop_all(procs)
    print(f"load {os.getloadavg()[0]:.2f}; {args.rounds} rounds x {args.n} requests per kind; server CPU us/request")
    for name, kinds in per.items():
        for kind, values in kinds.items():
            v = sorted(values)
            print(f"{name:<10}{kind:<8}median {statistics.median(v):7.1f}  min {v[0]:7.1f}  max {v[-1]:7.1f}  "
                  f"rounds {' '.join(f'{x:.0f}' for x in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
