"""Routing policies on a real fleet on loopback: 4 engine nodes (tiny model, one process each) behind
one gateway, a multi-tenant trace, hit rate and TTFT for kv_aware vs round_robin vs least_loaded.

    trace: T tenants (Zipf popularity, s = 1.1), 2 templates each = a shared prefix of P tokens,
           + a unique suffix of S tokens per request; Poisson arrivals at R requests/s;
           token-id prompts on /v1/completions (streamed, 4 output tokens)
    fleet: 4 x `prefixgate serve --model tiny --kv-blocks B --threads 1` publishing KV events,
           1 x `prefixgate serve --model none` with routing_policy = <policy>
    per policy: fresh nodes (cold caches), the same trace (same seed), the same tenants
    hit rate = sum(cached_tokens) / sum(prompt_tokens) from the responses' usage
    TTFT     = first streamed chunk, measured by the client

Run:  python benchmarks/fleet_loopback.py [--requests 120] [--rate 6] [--smoke]
Needs pyzmq + msgpack (pip install 'prefixgate[fleet]'). Writes benchmarks/results/fleet_loopback_<ts>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("kv_aware", "round_robin", "least_loaded")
TOKEN_ENV = "PG_BENCH_NODE_TOKEN"
PREDICTION = (
    "Written before the first run. Each node's cache holds about a third of the trace's templates. "
    "kv_aware sends a template to the node that holds it, so after each template's first request "
    "nearly every prefix is a hit: hit rate ~0.7 (the ceiling is P/(P+S) x (1 - templates/requests)). "
    "round_robin and least_loaded spread each template over all 4 nodes, each of which must miss it "
    "once and then loses it to the other templates: hit rate ~0.3. TTFT p50 follows the uncached "
    "tokens: kv_aware ~1.5-2x lower than both; least_loaded's p99 no better than kv_aware's, since "
    "the load bound keeps kv_aware from piling onto one node."
)


@dataclass(frozen=True)
class Request:
    at_s: float
    tenant: str
    prompt: tuple[int, ...]


@dataclass
class Result:
    policy: str
    requests: int
    errors: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    wall_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trace(tenants: int, requests: int, prefix: int, suffix: int, rate: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** 1.1 for i in range(tenants)]
    templates = {(t, k): tuple(rng.randrange(1000, 90000) for _ in range(prefix)) for t in range(tenants) for k in (0, 1)}
    out, at = [], 0.0
    for _ in range(requests):
        at += rng.expovariate(rate)
        t = rng.choices(range(tenants), weights)[0]
        body = templates[(t, rng.randrange(2))] + tuple(rng.randrange(1000, 90000) for _ in range(suffix))
        out.append(Request(at, f"t{t}", body))
    return out


def child_env() -> dict[str, str]:
    import msgpack
    import zmq

    dirs = [str(REPO)] + sorted({str(Path(m.__file__).parent.parent) for m in (zmq, msgpack)})
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dirs), TOKEN_ENV: "bench-node-secret",
            "NO_PROXY": "127.0.0.1,localhost", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1"}


def serve(home: Path, port: int, *flags: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(home), "--port", str(port),
         "--log-level", "warning", *flags],
        cwd=REPO, env=child_env(), stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server exited during start-up; its log ends:\n{log.read_text()[-3000:]}")
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    if pending:
        raise RuntimeError(f"not healthy in {timeout:.0f} s: {sorted(pending)}")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


async def replay(url: str, keys: dict[str, str], trace: list[Request], max_tokens: int) -> list[tuple[float, int, int] | None]:
    clients = {t: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=k, max_retries=0, timeout=120) for t, k in keys.items()}
    start = time.perf_counter()

    async def one(req: Request) -> tuple[float, int, int] | None:
        await asyncio.sleep(max(0.0, req.at_s - (time.perf_counter() - start)))
        sent = time.perf_counter()
        ttft = None
        usage = None
        try:
            stream = await clients[req.tenant].completions.create(
                model="tiny", prompt=list(req.prompt), max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:
                if ttft is None and chunk.choices:
                    ttft = time.perf_counter() - sent
                if chunk.usage is not None:
                    usage = chunk.usage
        except openai.APIError as exc:
            print(f"  error: {exc}", file=sys.stderr)
            return None
        if ttft is None or usage is None:
            return None
        details = usage.prompt_tokens_details
        return ttft, usage.prompt_tokens, (details.cached_tokens or 0) if details else 0

    try:
        return await asyncio.gather(*(one(r) for r in trace))
    finally:
        for c in clients.values():
            await c.close()


def run_policy(policy: str, args: argparse.Namespace, work: Path, gw_home: Path, keys: dict[str, str],
               trace: list[Request]) -> Result:
    procs: list[subprocess.Popen] = []
    try:
        nodes = []
        for i in range(4):
            home = work / f"{policy}-node{i}"
            home.mkdir()
            if args.model_cache.exists():  # one tiny checkpoint for every node (built once)
                (home / "models").mkdir()
                shutil.copytree(args.model_cache, home / "models" / "tiny")
            port, ev = free_port(), f"tcp://127.0.0.1:{free_port()}"
            (home / "node.toml").write_text(f'[server]\nnode_token_env = "{TOKEN_ENV}"\n'
                                            f'[engine]\nkv_events_endpoint = "{ev}"\n')
            procs.append(serve(home, port, "--model", "tiny", "--config", str(home / "node.toml"),
                               "--kv-blocks", str(args.kv_blocks), "--threads", "1", log=work / "servers.log"))
            nodes.append((f"http://127.0.0.1:{port}", ev))
        wait_healthy([u for u, _ in nodes], procs, work / "servers.log")
        gw_port = free_port()
        cfg = gw_home / f"{policy}.toml"
        nodes_toml = ", ".join(f'"{u}"' for u, _ in nodes)
        events_toml = ", ".join(f'"{e}"' for _, e in nodes)
        cfg.write_text(f'[server]\nrouting_policy = "{policy}"\n[engine]\nmodel = "none"\n'
                       f'[[routes]]\nmodel = "tiny"\nnodes = [{nodes_toml}]\nkv_events = [{events_toml}]\n'
                       f'node_token_env = "{TOKEN_ENV}"\n')
        gw = serve(gw_home, gw_port, "--config", str(cfg), log=work / "servers.log")
        procs.append(gw)
        gw_url = f"http://127.0.0.1:{gw_port}"
        wait_healthy([gw_url], procs, work / "servers.log")
        time.sleep(1.0)  # the gateway's SUB sockets join the nodes' PUB sockets
        t0 = time.perf_counter()
        got = asyncio.run(replay(gw_url, keys, trace, args.max_tokens))
        wall = time.perf_counter() - t0
    finally:
        stop_all(procs)
    ok = [g for g in got if g is not None]
    ttfts = sorted(g[0] * 1000 for g in ok)
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) > 1 else ttfts * 99
    return Result(policy, len(got), len(got) - len(ok), sum(g[2] for g in ok) / max(1, sum(g[1] for g in ok)),
                  statistics.median(ttfts), q[89], q[98], wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=6.0, help="arrivals per second (Poisson)")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--prefix", type=int, default=384, help="template prefix tokens")
    p.add_argument("--suffix", type=int, default=64, help="unique suffix tokens")
    p.add_argument("--kv-blocks", type=int, default=160, help="KV blocks per node (16 tokens each)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--smoke", action="store_true", help="24 requests, 4 tenants: does it run")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.tenants = 24, 4
    work = Path(tempfile.mkdtemp(prefix="pg-fleet-loopback-"))
    args.model_cache = work / "tiny-model"
    load_before = os.getloadavg()
    try:
        from engine.launch import build_tiny_checkpoint

        build_tiny_checkpoint(args.model_cache)
        gw_home = work / "gateway"
        keys = {}
        for t in range(args.tenants):
            out = subprocess.run([sys.executable, "-m", "gateway.cli.main", "tenant", "create", f"t{t}", "--json",
                                  "--home", str(gw_home)], cwd=REPO, env=child_env(), capture_output=True,
                                 text=True, check=True)
            keys[f"t{t}"] = json.loads(out.stdout)["api_key"]
        trace = make_trace(args.tenants, args.requests, args.prefix, args.suffix, args.rate, args.seed)
        results = []
        for policy in args.policies.split(","):
            print(f"{policy}: starting 4 nodes + gateway, replaying {len(trace)} requests ...", flush=True)
            results.append(run_policy(policy, args, work, gw_home, keys, trace))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    base = {r.policy: r for r in results}
    print(f"\n{'policy':<14}{'hit rate':>9}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'errors':>8}{'wall s':>8}")
    for r in results:
        print(f"{r.policy:<14}{r.hit_rate:>9.3f}{r.ttft_p50_ms:>8.1f}ms{r.ttft_p90_ms:>7.1f}ms{r.ttft_p99_ms:>7.1f}ms"
              f"{r.errors:>8}{r.wall_s:>8.1f}")
    ratios = {}
    if "kv_aware" in base:
        for other in ("round_robin", "least_loaded"):
            if other in base:
                ratios[f"ttft_p50_{other}_over_kv_aware"] = base[other].ttft_p50_ms / base["kv_aware"].ttft_p50_ms
                ratios[f"hit_rate_kv_aware_minus_{other}"] = base["kv_aware"].hit_rate - base[other].hit_rate
        for k, v in ratios.items():
            print(f"  {k}: {v:.2f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.out / f"fleet_loopback_{stamp}.json"
    path.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/fleet_loopback.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "commit": commit, "load_avg_before": load_before, "load_avg_after": load_after,
        "prediction": PREDICTION,
        "trace": {"requests": args.requests, "rate_per_s": args.rate, "tenants": args.tenants, "prefix": args.prefix,
                  "suffix": args.suffix, "kv_blocks_per_node": args.kv_blocks, "max_tokens": args.max_tokens,
                  "seed": args.seed},
        "results": [asdict(r) for r in results], "ratios": ratios,
    }, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
