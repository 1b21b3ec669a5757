"""How long `prefixgate serve` takes to become ready, for several checkouts, interleaved.

    python benchmarks/startup.py --tree new=. --tree base=/tmp/base [--rounds 6] [--model tiny]
                                 [--out benchmarks/results/startup.json]

Each start is a fresh `python -m gateway.cli.main serve --model <model>` process with the checkout on
its PYTHONPATH, under one shared home whose model is built by an unmeasured first start. Two times
per start, from the exec:

  healthy       /health answers 200: the engine is built and the gateway listens (what `make serve`
                and a readiness probe wait for)
  first answer  a one-token chat completion from a fresh tenant has come back

The trees' order rotates each round so that load from other processes falls on all of them alike;
medians per tree, each as a ratio to the first ``--tree``.

Prediction (session 46, written before the first run, this 2-core AMD EPYC): the model's layers built
without their random initial draw (the draw on the meta device imported torch._dynamo) make the tiny
server healthy ~1.2 s sooner out of ~9 s: new / base 0.82-0.92 for both times.
Result (`--tree base=<a882ae3> --tree new=. --rounds 6`, results/startup_cpu_s46.json): healthy 10.68 -> 9.74 s
(0.91x), first answer 11.44 -> 10.59 s (0.93x, just outside the range): ~0.9 s saved, less than the 1.3 s
the import took alone in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import git_commit  # noqa: E402

READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Start:
    tree: str
    round: int
    healthy_s: float
    first_answer_s: float


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): platform.processor() says only x86_64 on Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(tree: Path, home: Path, model: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(tree), "NO_PROXY": "127.0.0.1,localhost",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(home), "--port",
                             str(port), "--model", model, "--log-level", "warning"],
                            cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], t0: float) -> float:
    while time.perf_counter() - t0 < READY_TIMEOUT_S:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise SystemExit(f"startup.py: the server exited with {proc.returncode}: {err}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise SystemExit(f"startup.py: {url} was not healthy within {READY_TIMEOUT_S:.0f} s")


def create_key(tree: Path, home: Path, name: str) -> str:
    """A tenant's API key, created before the server starts (the CLI, as an operator would)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-m", "gateway.cli.main", "--home", str(home), "tenant", "create", name,
                          "--json"], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)["api_key"])


def one_start(name: str, tree: Path, home: Path, model: str, rnd: int) -> Start:
    key = create_key(tree, home, f"start-{name}-{rnd}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = serve(tree, home, model, port)
    try:
        healthy = wait_healthy(url, proc, t0)
        resp = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                          trust_env=False, json={"model": model, "max_tokens": 1, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Ready?"}]})
        first = time.perf_counter() - t0
        if resp.status_code != 200:
            raise SystemExit(f"startup.py: the first request failed: {resp.status_code} {resp.text[:300]}")
    finally:
        stop(proc)
    return Start(name, rnd, healthy, first)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a checkout to start (repeatable; the first is the one ratios are against)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", default="tiny", help="serve --model's value (tiny, or a checkpoint directory)")
    ap.add_argument("--home", type=Path, default=None, help="the shared home (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    trees: list[tuple[str, Path]] = []
    for spec in args.tree or ["new=."]:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_dir():
            print(f"startup.py: --tree wants NAME=PATH to a checkout, got {spec!r}", file=sys.stderr)
            return 2
        trees.append((name, Path(path).resolve()))
    if args.rounds < 1:
        print("startup.py: --rounds must be at least 1", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="pg-startup-") as tmp:
        home = args.home or Path(tmp)
        warm = one_start(trees[0][0], trees[0][1], home, args.model, -1)  # builds the model; not counted
        print(f"warm-up start (model built if missing): healthy {warm.healthy_s:.2f} s")
        starts: list[Start] = []
        for rnd in range(args.rounds):
            order = trees[rnd % len(trees):] + trees[:rnd % len(trees)]
            for name, tree in order:
                s = one_start(name, tree, home, args.model, rnd)
                starts.append(s)
                print(f"round {rnd} {name:>8}: healthy {s.healthy_s:6.2f} s  first answer {s.first_answer_s:6.2f} s",
                      flush=True)

    rows = []
    for name, tree in trees:
        mine = [s for s in starts if s.tree == name]
        rows.append({"tree": name, "path": str(tree), "commit": git_commit(tree),
                     "healthy_median_s": statistics.median(s.healthy_s for s in mine),
                     "first_answer_median_s": statistics.median(s.first_answer_s for s in mine)})
    base = rows[0]
    for row in rows:
        row["healthy_ratio"] = row["healthy_median_s"] / base["healthy_median_s"]
        row["first_answer_ratio"] = row["first_answer_median_s"] / base["first_answer_median_s"]

    print(f"\n{'tree':>8} {'commit':>12} {'healthy s':>10} {'ratio':>6} {'answer s':>9} {'ratio':>6}")
    for row in rows:
        print(f"{row['tree']:>8} {row['commit'][:12]:>12} {row['healthy_median_s']:10.2f} {row['healthy_ratio']:6.2f} "
              f"{row['first_answer_median_s']:9.2f} {row['first_answer_ratio']:6.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "machine": {"processor": cpu_model(), "cores": os.cpu_count(),
                        "platform": platform.platform(), "python": platform.python_version(),
                        "load_avg_1m": os.getloadavg()[0]},
            "model": args.model, "rounds": args.rounds, "trees": rows,
            "starts": [asdict(s) for s in starts],
        }, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
