"""Gateway benchmarks on loopback: the front door's overhead, its profile, and what canonicalization does.

``overhead`` -- added latency and saturated request rate, all targets side by side in one run:

    client ──► upstream                                   (baseline: the mock upstream itself)
    client ──► prefixgate (transport = "direct") ──► upstream
    client ──► prefixgate (transport = "litellm") ──► upstream
    client ──► litellm proxy ──► upstream                 (with --litellm-cmd: a venv with litellm[proxy])

The upstream is a raw ASGI app (no framework) under uvicorn in its own process that answers every
chat completion at once with fixed bytes, so what is measured is each proxy's own cost (auth,
ledger, routing, JSON), not model time. At concurrency 1, interleaved over --rounds rounds (each
round sends --latency-requests to every target in turn, so load from other processes hits all
targets alike): p50/p99 of whole non-stream requests, and for streams the time to the first body
byte (TTFB) and to the end. Then each target's saturated rate: --concurrency closed-loop clients
for --seconds, once per round, interleaved (the median is reported). Added = target minus the
upstream alone, measured in the same run. The CPU time each server process spent per request
(from /proc, over the concurrency-1 phase) is reported too: another process's load delays a
request but adds little to its CPU time, so on a shared machine it is the steadier figure.
``--base-tree DIR`` adds the gateway of another checkout
(the base commit) as one more target, so that before/after is one run too.

``profile`` -- the gateway in this process (httpx's ASGI transport; the mock upstream over loopback
HTTP in its own process, reached through the direct transport): the request's hops, i.e. Python
calls made for one request counted with ``sys.setprofile`` (all calls, and calls of functions
defined in gateway/ or promptlint/), and cProfile's top entries over --requests requests.

``canon`` -- the same agent request many times with its tools shuffled and a timestamp in the system
prompt (what real clients send), through `prefixgate serve` with the tiny model, for a tenant with
canonicalization off and one with it on: prefix-cache hit rate = cached / prompt tokens.

Run:  python benchmarks/gateway.py overhead [--rounds 3] [--latency-requests 300] [--seconds 5]
                                            [--concurrency 16] [--litellm-cmd PATH]
      python benchmarks/gateway.py profile [--requests 2000]
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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: the project is not installed
BODY = {"model": "echo", "max_tokens": 8,
        "messages": [{"role": "system", "content": "You are a helpful assistant. " * 20},
                     {"role": "user", "content": "Say hi."}]}
STREAM_BODY = {**BODY, "stream": True, "stream_options": {"include_usage": True}}

# A raw ASGI app: no framework between uvicorn and the fixed answer, so the baseline is as cheap as
# an upstream can be and every millisecond above it is the proxy's.
UPSTREAM_SRC = r'''
import json, sys
import uvicorn
USAGE = {"prompt_tokens": 120, "completion_tokens": 2, "total_tokens": 122,
         "prompt_tokens_details": {"cached_tokens": 96}}
HEAD = {"id": "chatcmpl-echo", "created": 1764547200, "model": "echo"}
WHOLE = json.dumps({**HEAD, "object": "chat.completion", "usage": USAGE, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}]}).encode()
def chunk(choices, **extra):
    return b"data: " + json.dumps({**HEAD, "object": "chat.completion.chunk", "choices": choices, **extra}).encode() + b"\n\n"
EVENTS = [chunk([{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}]),
          chunk([{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]),
          chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
          chunk([], usage=USAGE), b"data: [DONE]\n\n"]
JSON = [(b"content-type", b"application/json")]
async def app(scope, receive, send):
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["method"] == "GET":
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    if not json.loads(body or b"{}").get("stream"):
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": WHOLE})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for event in EVENTS:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
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


@dataclass(frozen=True)
class Target:
    name: str
    url: str  # .../v1/chat/completions
    headers: dict[str, str]
    pid: int  # the server process: its CPU time per request is counted too


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc; 10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def whole(client: httpx.AsyncClient, t: Target) -> float:
    t0 = time.perf_counter()
    r = await client.post(t.url, json=BODY, headers=t.headers)
    r.raise_for_status()
    return time.perf_counter() - t0


async def streamed(client: httpx.AsyncClient, t: Target) -> tuple[float, float]:
    """(time to the first body byte, time to the end) of one streamed request."""
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", t.url, json=STREAM_BODY, headers=t.headers) as r:
        r.raise_for_status()
        tail = b""
        async for part in r.aiter_raw():
            if first is None and part:
                first = time.perf_counter() - t0
            tail = (tail + part)[-32:]
    if not tail.rstrip().endswith(b"[DONE]"):
        raise RuntimeError(f"{t.name}: the stream did not end with [DONE]")
    return first or 0.0, time.perf_counter() - t0


def _p(values: list[float], q: int) -> float:
    return 1000 * statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else 1000 * values[0]


async def latency_rounds(targets: list[Target], rounds: int, n: int) -> dict[str, dict[str, float]]:
    """Concurrency 1, interleaved: each round measures every target in turn."""
    samples = {t.name: {"whole": [], "ttfb": [], "stream": []} for t in targets}
    # CPU seconds the server process spent on the measured requests (less noisy than wall time on a
    # shared machine: another process's load delays a request but does not add to its CPU time)
    cpu = {t.name: {"whole": 0.0, "stream": 0.0} for t in targets}
    async with httpx.AsyncClient(timeout=60) as client:
        for t in targets:  # warm up connections and every server's code paths
            for _ in range(30):
                await whole(client, t)
                await streamed(client, t)
        for _ in range(rounds):
            for t in targets:
                s = samples[t.name]
                c0 = cpu_seconds(t.pid)
                for _ in range(n):
                    s["whole"].append(await whole(client, t))
                c1 = cpu_seconds(t.pid)
                for _ in range(n):
                    first, total = await streamed(client, t)
                    s["ttfb"].append(first)
                    s["stream"].append(total)
                cpu[t.name]["whole"] += c1 - c0
                cpu[t.name]["stream"] += cpu_seconds(t.pid) - c1
    return {name: {"p50_ms": 1000 * statistics.median(s["whole"]), "p99_ms": _p(s["whole"], 99),
                   "ttfb_p50_ms": 1000 * statistics.median(s["ttfb"]), "ttfb_p99_ms": _p(s["ttfb"], 99),
                   "stream_p50_ms": 1000 * statistics.median(s["stream"]), "requests": len(s["whole"]),
                   "cpu_ms_per_request": 1000 * cpu[name]["whole"] / len(s["whole"]),
                   "cpu_ms_per_stream": 1000 * cpu[name]["stream"] / len(s["stream"])}
            for name, s in samples.items()}


async def saturated_rate(t: Target, concurrency: int, seconds: float) -> float:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        for _ in range(concurrency):
            await whole(client, t)
        done = 0
        stop = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await whole(client, t)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def write_result(kind: str, args: argparse.Namespace, results: dict) -> None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip())
    out = {
        "benchmark": f"gateway_{kind}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": commit + ("+dirty" if dirty else ""),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m_at_start": LOAD_AT_START, "load_avg_1m_at_end": os.getloadavg()[0]},
        "params": {k: v for k, v in vars(args).items() if k != "func"},
        "created_at": datetime.now(UTC).isoformat(),
        "results": results,
    }
    dest = REPO / "benchmarks" / "results" / f"gateway-{kind}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {dest.relative_to(REPO)}")


LOAD_AT_START = os.getloadavg()[0]


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


def start_upstream(tmp: Path, env: dict[str, str], procs: list[subprocess.Popen]) -> str:
    port = free_port()
    (tmp / "upstream.py").write_text(UPSTREAM_SRC)
    procs.append(subprocess.Popen([sys.executable, str(tmp / "upstream.py"), str(port)], env=env))
    url = f"http://127.0.0.1:{port}"
    wait_up(url, procs[-1], path="/")
    return url


def bench_tenant(home: Path) -> str:
    from tenancy.service import TenancyService  # a real tenant for the gateway's auth + ledger

    svc = TenancyService.open(home)
    key = svc.create_tenant("bench").api_key
    svc.flush()
    svc.close()
    return key


def route_toml(upstream: str, transport: str) -> str:
    return (f'[[routes]]\nmodel = "echo"\nprovider = "openai/echo"\napi_base = "{upstream}/v1"\n'
            f'api_key_env = "BENCH_UP_KEY"\ntransport = "{transport}"\n')


def run_overhead(args: argparse.Namespace) -> int:
    env = base_env()
    procs: list[subprocess.Popen] = []
    try:
        tmp = Path(tempfile.mkdtemp(prefix="pg-bench-"))
        up = start_upstream(tmp, env, procs)
        home = tmp / "home"
        key = bench_tenant(home)
        auth = {"Authorization": f"Bearer {key}"}
        targets = [Target("upstream", f"{up}/v1/chat/completions", {}, procs[0].pid)]
        # (name, checkout, transport, PYTHONPATH)
        gateways = [("prefixgate-direct", REPO, "direct", str(REPO))]
        if args.extra_path:  # packages this venv lacks (uvloop, httptools: uvicorn picks them up)
            gateways.append(("prefixgate-direct+extra", REPO, "direct", f"{REPO}{os.pathsep}{args.extra_path}"))
        if args.base_tree:  # the same gateway from another checkout (the base commit), side by side
            base = Path(args.base_tree).resolve()
            gateways.append(("base-direct", base, "direct", str(base)))
        if not args.no_litellm_transport:
            gateways.append(("prefixgate-litellm", REPO, "litellm", str(REPO)))
        for name, tree, transport, path in gateways:
            port = free_port()
            (tmp / f"{name}.toml").write_text(route_toml(up, transport))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gateway.cli.main", "serve", "--model", "none", "--home", str(home),
                 "--port", str(port), "--config", str(tmp / f"{name}.toml"), "--log-level", "warning"],
                cwd=tree, env={**env, "PYTHONPATH": path, "BENCH_UP_KEY": "sk-up"}))
            wait_up(f"http://127.0.0.1:{port}", procs[-1])
            targets.append(Target(name, f"http://127.0.0.1:{port}/v1/chat/completions", auth, procs[-1].pid))
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
            wait_up(f"http://127.0.0.1:{lp}", procs[-1], path="/health/liveliness", timeout=300)
            targets.append(Target("litellm-proxy", f"http://127.0.0.1:{lp}/v1/chat/completions",
                                  {"Authorization": f"Bearer {master}"}, procs[-1].pid))
        results = asyncio.run(latency_rounds(targets, args.rounds, args.latency_requests))
        rates: dict[str, list[float]] = {t.name: [] for t in targets}
        for _ in range(args.rounds):  # interleaved too: the median of one run per round
            for t in targets:
                rates[t.name].append(asyncio.run(saturated_rate(t, args.concurrency, args.seconds)))
        for name, runs in rates.items():
            results[name]["rate_rps"] = statistics.median(runs)
            results[name]["rate_rps_runs"] = runs
    finally:
        stop_all(procs)

    base = results["upstream"]
    proxy_rate = results.get("litellm-proxy", {}).get("rate_rps")
    cols = ("p50", "p99", "+p50", "+p99", "TTFB p50", "+TTFB", "stream p50", "+stream", "req/s", "x proxy",
            "cpu ms", "cpu/strm")
    print(f"{'target (ms)':<20}" + "".join(f"{c:>11}" for c in cols))
    for name, r in results.items():
        r["added_p50_ms"] = r["p50_ms"] - base["p50_ms"]
        r["added_p99_ms"] = r["p99_ms"] - base["p99_ms"]
        r["added_ttfb_p50_ms"] = r["ttfb_p50_ms"] - base["ttfb_p50_ms"]
        r["added_stream_p50_ms"] = r["stream_p50_ms"] - base["stream_p50_ms"]
        r["rate_vs_litellm_proxy"] = r["rate_rps"] / proxy_rate if proxy_rate else None
        ratio = f"{r['rate_vs_litellm_proxy']:.1f}" if proxy_rate else "-"
        print(f"{name:<20}" + "".join(f"{v:>11.2f}" for v in (
            r["p50_ms"], r["p99_ms"], r["added_p50_ms"], r["added_p99_ms"], r["ttfb_p50_ms"], r["added_ttfb_p50_ms"],
            r["stream_p50_ms"], r["added_stream_p50_ms"], r["rate_rps"])) + f"{ratio:>11}"
              + f"{r['cpu_ms_per_request']:>11.3f}{r['cpu_ms_per_stream']:>11.3f}")
    write_result("overhead", args, results)
    return 0


def run_profile(args: argparse.Namespace) -> int:
    """Hops of one request and cProfile's top entries, the gateway in this process (see the module doc)."""
    import cProfile
    import io
    import pstats

    from gateway.app import create_app
    from gateway.settings import GatewaySettings, RouteConfig

    env = base_env()
    procs: list[subprocess.Popen] = []
    os.environ["BENCH_UP_KEY"] = "sk-up"
    try:
        tmp = Path(tempfile.mkdtemp(prefix="pg-bench-profile-"))
        up = start_upstream(tmp, env, procs)
        home = tmp / "home"
        key = bench_tenant(home)
        settings = GatewaySettings(home=home, model=None, model_dir=None, routes=(RouteConfig(
            model="echo", provider="openai/echo", api_base=f"{up}/v1", api_key_env="BENCH_UP_KEY",
            transport="direct"),))
        app = create_app(settings)
        results = asyncio.run(_profile(app, key, args.requests, cProfile, pstats, io, args.pstats))
    finally:
        stop_all(procs)
    print("Python frame entries (calls and coroutine resumptions) for one request, by where the code lives:")
    areas = list(next(iter(results["hops"].values())))
    print(f"{'':<26}" + "".join(f"{a[:9]:>10}" for a in areas))
    for label, counts in results["hops"].items():
        print(f"{label:<26}" + "".join(f"{counts[a]:>10}" for a in areas))
    print("CPU ms per request (this process, min of 5 runs):",
          {k: round(v, 3) for k, v in results["cpu_ms_per_request_min_of_5"].items()})
    print(results["top"])
    write_result("profile", args, results)
    return 0


# Where the other calls of a request are made (by the path of the function's file); the rest: "other".
_AREAS = ("fastapi", "starlette", "pydantic", "httpx", "httpcore", "anyio", "asyncio", "prometheus_client",
          "tenancy", "engine", "other")


def _count_calls(ours: tuple[str, ...]):  # noqa: ANN202 - (profile function, its counts)
    counts = {"all": 0, "gateway+promptlint": 0} | {area: 0 for area in _AREAS}

    def count(frame, event, _arg) -> None:  # noqa: ANN001 - sys.setprofile's shape
        if event == "call":  # a call, or a coroutine resuming
            counts["all"] += 1
            name = frame.f_code.co_filename
            if name.startswith(ours):
                counts["gateway+promptlint"] += 1
            else:
                counts[next((a for a in _AREAS if f"/{a}/" in name), "other")] += 1

    return count, counts


async def _null_app(scope, receive, send) -> None:  # noqa: ANN001 - raw ASGI
    """The client's own share of the calls: the same client, transport and answer, no gateway."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"choices": []}'})


async def _profile(app, key: str, n: int, cProfile, pstats, io, dump: str | None) -> dict:  # noqa: ANN001
    ours = (str(REPO / "gateway"), str(REPO / "promptlint"))
    headers = {"Authorization": f"Bearer {key}"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as client, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=_null_app), base_url="http://null") as null:

            async def one(body: dict, via: httpx.AsyncClient = client) -> None:
                r = await via.post("/v1/chat/completions", json=body, headers=headers)
                r.raise_for_status()

            for _ in range(50):  # warm: connections, caches, lazy imports
                await one(BODY)
                await one(STREAM_BODY)
                await one(BODY, null)
            hops: dict[str, dict[str, int]] = {}
            for label, body, via in (("client only", BODY, null), ("non-stream", BODY, client),
                                     ("stream", STREAM_BODY, client)):
                count, counts = _count_calls(ours)
                sys.setprofile(count)
                try:
                    await one(body, via)
                finally:
                    sys.setprofile(None)
                hops[label] = counts
            # CPU time of this process per request (the upstream runs in its own process): less noisy
            # than wall time on a shared machine; the null app's share is the client's own.
            cpu = {}
            for label, body, via in (("client only", BODY, null), ("non-stream", BODY, client),
                                     ("stream", STREAM_BODY, client)):
                runs = []
                for _ in range(5):
                    c0 = time.process_time()
                    for _ in range(max(1, n // 10)):
                        await one(body, via)
                    runs.append(1000 * (time.process_time() - c0) / max(1, n // 10))
                cpu[label] = min(runs)
            cpu["non-stream minus client"] = cpu["non-stream"] - cpu["client only"]
            cpu["stream minus client"] = cpu["stream"] - cpu["client only"]
            base = hops["client only"]
            for label in ("non-stream", "stream"):  # the gateway's own: minus what the client does anyway
                hops[f"{label} minus client"] = {k: v - base[k] for k, v in hops[label].items()}
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(n):
                await one(BODY)
            prof.disable()
            elapsed = time.perf_counter() - t0
    if dump:
        prof.dump_stats(dump)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    text = out.getvalue()
    top = text[text.index("ncalls"):] if "ncalls" in text else text
    return {"hops": hops, "cpu_ms_per_request_min_of_5": cpu, "requests": n, "seconds_under_profile": elapsed,
            "top": "\n".join(line.replace(str(REPO) + "/", "") for line in top.splitlines()[:27])}


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
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--latency-requests", type=int, default=300, help="per target, per round, per kind")
    o.add_argument("--seconds", type=float, default=5.0)
    o.add_argument("--concurrency", type=int, default=16)
    o.add_argument("--litellm-cmd", default=None, help="path of a `litellm` proxy executable (litellm[proxy])")
    o.add_argument("--base-tree", default=None,
                   help="a checkout of the base commit: its gateway (direct transport) runs as one more target")
    o.add_argument("--extra-path", default=None,
                   help="a directory of extra packages (pip install --target): one more direct target with it")
    o.add_argument("--no-litellm-transport", action="store_true", help="leave out transport = \"litellm\"")
    o.set_defaults(func=run_overhead)
    pr = sub.add_parser("profile", help="hops of one request and cProfile's top entries (gateway in-process)")
    pr.add_argument("--requests", type=int, default=2000)
    pr.add_argument("--pstats", default=None, help="also write the raw cProfile stats to this file")
    pr.set_defaults(func=run_profile)
    c = sub.add_parser("canon", help="hit rate with and without canonicalization")
    c.add_argument("--requests", type=int, default=20)
    c.add_argument("--canon-mode", default="reorder", choices=["safe", "reorder"])
    c.set_defaults(func=run_canon)
    args = ap.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
