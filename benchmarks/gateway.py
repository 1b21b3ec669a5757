"""Gateway benchmarks on loopback: proxy overhead, and what canonicalization does to the hit rate.

``overhead`` -- added latency (p50/p99) and highest request rate:

    client ──► upstream                      (direct: the baseline)
    client ──► prefixgate ──► upstream       (gateway-only `prefixgate serve --model none`, a litellm route)
    client ──► litellm proxy ──► upstream    (only with --litellm-cmd, e.g. a venv with litellm[proxy])

The upstream is a minimal OpenAI-compatible server in its own process that answers every chat
completion at once with a fixed reply, so what is measured is the proxy's own cost (auth, ledger,
routing, litellm, JSON), not model time. Latency: closed loop with one client (p50/p99 per
request). Rate: closed loop with --concurrency clients for --seconds; requests per second done.
All processes share this machine's cores with the load generator: say so when quoting figures.

``canon`` -- the same agent request many times with its tools shuffled and a timestamp in the system
prompt (what real clients send), through `prefixgate serve` with the tiny model, for a tenant with
canonicalization off and one with it on: prefix-cache hit rate = cached / prompt tokens.

Run:  python benchmarks/gateway.py overhead [--seconds 5] [--concurrency 32] [--latency-requests 300]
      python benchmarks/gateway.py canon [--requests 20] [--canon-mode reorder]
Each writes benchmarks/results/gateway-<kind>-<utc time>.json with the command, machine and git commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: the project is not installed
BODY = {"model": "echo", "max_tokens": 8,
        "messages": [{"role": "system", "content": "You are a helpful assistant. " * 20},
                     {"role": "user", "content": "Say hi."}]}

UPSTREAM_SRC = '''
import json, sys, time
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
import uvicorn
app = FastAPI()
USAGE = {"prompt_tokens": 120, "completion_tokens": 2, "total_tokens": 122, "prompt_tokens_details": {"cached_tokens": 96}}
@app.post("/v1/chat/completions")
async def chat(req: Request):
    body = await req.json()
    head = {"id": "chatcmpl-echo", "created": int(time.time()), "model": body["model"]}
    if not body.get("stream"):
        return {**head, "object": "chat.completion", "usage": USAGE, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}]}
    def sse():
        for delta, fin in (({"role": "assistant", "content": "hi"}, None), ({"content": " there"}, None), ({}, "stop")):
            chunk = {**head, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]}
            yield "data: " + json.dumps(chunk) + "\\n\\n"
        yield "data: " + json.dumps({**head, "object": "chat.completion.chunk", "choices": [], "usage": USAGE}) + "\\n\\n"
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(sse(), media_type="text/event-stream")
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, path: str = "/health", timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited ({proc.returncode})")
        try:
            httpx.get(url + path, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


async def one(client: httpx.AsyncClient, url: str, headers: dict) -> float:
    t0 = time.perf_counter()
    r = await client.post(url, json=BODY, headers=headers)
    r.raise_for_status()
    return time.perf_counter() - t0


async def measure(url: str, headers: dict, latency_requests: int, concurrency: int, seconds: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        for _ in range(20):  # warm up connections and the servers' code paths
            await one(client, url, headers)
        lat = [await one(client, url, headers) for _ in range(latency_requests)]
        done = 0
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await one(client, url, headers)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    q = statistics.quantiles(lat, n=100)
    return {"p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * q[98], "rate_rps": done / elapsed}


def write_result(kind: str, args: argparse.Namespace, results: dict) -> None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    out = {
        "benchmark": f"gateway_{kind}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": commit,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m_at_end": os.getloadavg()[0]},
        "params": {k: v for k, v in vars(args).items() if k != "func"},
        "created_at": datetime.now(UTC).isoformat(),
        "results": results,
    }
    dest = REPO / "benchmarks" / "results" / f"gateway-{kind}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {dest.relative_to(REPO)}")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def base_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), LITELLM_LOCAL_MODEL_COST_MAP="True", HF_HUB_OFFLINE="1",
                NO_PROXY="127.0.0.1")


def run_overhead(args: argparse.Namespace) -> int:
    env = base_env()
    procs: list[subprocess.Popen] = []
    results: dict[str, dict] = {}
    try:
        tmp = Path(tempfile.mkdtemp(prefix="pg-bench-"))
        up_port = free_port()
        (tmp / "upstream.py").write_text(UPSTREAM_SRC)
        procs.append(subprocess.Popen([sys.executable, str(tmp / "upstream.py"), str(up_port)], env=env))
        up = f"http://127.0.0.1:{up_port}"
        wait_up(up, procs[-1], path="/docs")

        from tenancy.service import TenancyService  # a real tenant for the gateway's auth + ledger

        home = tmp / "home"
        svc = TenancyService.open(home)
        key = svc.create_tenant("bench").api_key
        svc.flush()
        svc.close()
        gw_port = free_port()
        (tmp / "gw.toml").write_text(
            f'[[routes]]\nmodel = "echo"\nprovider = "openai/echo"\napi_base = "{up}/v1"\napi_key_env = "BENCH_UP_KEY"\n'
        )
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gateway.cli.main", "serve", "--model", "none", "--home", str(home),
             "--port", str(gw_port), "--config", str(tmp / "gw.toml"), "--log-level", "warning"],
            cwd=REPO, env={**env, "BENCH_UP_KEY": "sk-up"}))
        gw = f"http://127.0.0.1:{gw_port}"
        wait_up(gw, procs[-1])
        # The same route with transport = "direct" (keep-alive httpx to the OpenAI-compatible upstream).
        gwd_port = free_port()
        (tmp / "gwd.toml").write_text(
            f'[[routes]]\nmodel = "echo"\nprovider = "openai/echo"\napi_base = "{up}/v1"\n'
            'api_key_env = "BENCH_UP_KEY"\ntransport = "direct"\n'
        )
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gateway.cli.main", "serve", "--model", "none", "--home", str(home),
             "--port", str(gwd_port), "--config", str(tmp / "gwd.toml"), "--log-level", "warning"],
            cwd=REPO, env={**env, "BENCH_UP_KEY": "sk-up"}))
        gwd = f"http://127.0.0.1:{gwd_port}"
        wait_up(gwd, procs[-1])

        auth = {"Authorization": f"Bearer {key}"}
        targets = {"direct": (up, {}), "prefixgate": (gw, auth), "prefixgate-direct": (gwd, auth)}
        if args.litellm_cmd:
            lp = free_port()
            (tmp / "litellm.yaml").write_text(
                "model_list:\n  - model_name: echo\n    litellm_params:\n"
                f"      model: openai/echo\n      api_base: {up}/v1\n      api_key: sk-up\n"
            )
            master = "sk-" + secrets.token_urlsafe(32)  # the proxy refuses to start without a strong key
            procs.append(subprocess.Popen([args.litellm_cmd, "--config", str(tmp / "litellm.yaml"), "--port", str(lp),
                                           "--host", "127.0.0.1"], env={**env, "LITELLM_MASTER_KEY": master},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_up(f"http://127.0.0.1:{lp}", procs[-1], path="/health/liveliness")
            targets["litellm-proxy"] = (f"http://127.0.0.1:{lp}", {"Authorization": f"Bearer {master}"})
        for name, (base, headers) in targets.items():
            results[name] = asyncio.run(measure(f"{base}/v1/chat/completions", headers,
                                                args.latency_requests, args.concurrency, args.seconds))
    finally:
        stop_all(procs)

    base = results["direct"]
    print(f"{'target':<18}{'p50 ms':>10}{'p99 ms':>10}{'added p50':>11}{'added p99':>11}{'req/s':>10}")
    for name, r in results.items():
        r["added_p50_ms"] = r["p50_ms"] - base["p50_ms"]
        r["added_p99_ms"] = r["p99_ms"] - base["p99_ms"]
        print(f"{name:<18}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['added_p50_ms']:>11.2f}"
              f"{r['added_p99_ms']:>11.2f}{r['rate_rps']:>10.0f}")
    write_result("overhead", args, results)
    return 0


TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} for the user",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string"}, "limit": {"type": "integer"}}}}}
    for name in ("search_orders", "get_invoice", "refund_payment", "update_address", "track_parcel", "open_ticket")
]
AGENT_PROMPT = ("You are the order-support agent of ExampleShop. Use the tools to look things up; never invent "
                "order numbers; answer in two sentences at most. ") * 4


def canon_request(i: int, rng: random.Random) -> dict:
    tools = TOOLS[:]
    rng.shuffle(tools)  # clients build tool lists from dicts and sets: the order changes per request
    stamp = datetime(2026, 1, 1, tzinfo=UTC).timestamp() + 37 * i
    system = f"Current time: {datetime.fromtimestamp(stamp, UTC).isoformat()}\n{AGENT_PROMPT}"
    return {"model": "tiny", "max_tokens": 1, "temperature": 0, "tools": tools,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Where is my parcel number {1000 + i}?"}]}


def run_canon(args: argparse.Namespace) -> int:
    from tenancy.service import TenancyService

    env = base_env()
    tmp = Path(tempfile.mkdtemp(prefix="pg-bench-canon-"))
    home = tmp / "home"
    svc = TenancyService.open(home)
    keys = {"off": svc.create_tenant("canon-off", canon_mode="off").api_key,
            args.canon_mode: svc.create_tenant("canon-on", canon_mode=args.canon_mode).api_key}
    svc.flush()
    svc.close()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli.main", "serve", "--home", str(home), "--port",
                             str(port), "--model", "tiny", "--log-level", "warning"], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    results: dict[str, dict] = {}
    try:
        wait_up(url, proc)
        for mode, key in keys.items():
            rng = random.Random(0)  # the same request sequence for both tenants
            prompt = cached = 0
            applied: set[str] = set()
            for i in range(args.requests):
                r = httpx.post(f"{url}/v1/chat/completions", json=canon_request(i, rng), timeout=300,
                               headers={"Authorization": f"Bearer {key}"})
                r.raise_for_status()
                u = r.json()["usage"]
                prompt += u["prompt_tokens"]
                cached += u["prompt_tokens_details"]["cached_tokens"]
                applied.update(x for x in r.headers.get("x-prefixgate-canonical", "").split(",") if x and x != "none")
            results[mode] = {"requests": args.requests, "prompt_tokens": prompt, "cached_tokens": cached,
                             "hit_rate": cached / prompt if prompt else 0.0, "applied": sorted(applied)}
    finally:
        stop_all([proc])
    print(f"{'canon mode':<12}{'requests':>10}{'prompt tok':>12}{'cached tok':>12}{'hit rate':>10}  applied")
    for mode, r in results.items():
        print(f"{mode:<12}{r['requests']:>10}{r['prompt_tokens']:>12}{r['cached_tokens']:>12}"
              f"{r['hit_rate']:>10.1%}  {','.join(r['applied']) or '-'}")
    write_result("canon", args, results)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="kind", required=True)
    o = sub.add_parser("overhead", help="added latency and request rate vs the upstream directly")
    o.add_argument("--seconds", type=float, default=5.0)
    o.add_argument("--concurrency", type=int, default=32)
    o.add_argument("--latency-requests", type=int, default=300)
    o.add_argument("--litellm-cmd", default=None, help="path of a `litellm` proxy executable (litellm[proxy])")
    o.set_defaults(func=run_overhead)
    c = sub.add_parser("canon", help="hit rate with and without canonicalization")
    c.add_argument("--requests", type=int, default=20)
    c.add_argument("--canon-mode", default="reorder", choices=["safe", "reorder"])
    c.set_defaults(func=run_canon)
    args = ap.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
