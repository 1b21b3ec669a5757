"""Prefill/decode split on loopback: transfer bandwidth, and a mixed workload split vs colocated.

    python benchmarks/pd.py [--smoke] [--decoders 4] [--long-arrivals 6] [--long-tokens 1536]
                            [--device cpu|cuda] [--gpus 1|2] [--model DIR] [--out FILE]

Starts two real engine processes (``prefixgate serve --role prefill`` and ``--role decode``,
tiny model on CPU by default) and drives them with the gateway's split client
(``gateway.disagg_client.DisaggEngineClient``), in one run:

1. Transfer bandwidth: long prompts prefilled on the prefill node and sent to the decode node's
   receiver (``POST /internal/v1/kv/prefill``: bytes on the wire / seconds from connect to ack,
   MAC'd chunks of 16 blocks), against, measured in this same run on the same byte count:
   a memcpy, a plain loopback TCP copy between two threads, and HMAC-SHA256 over the bytes.
2. Mixed workload: ``--decoders`` clients each looping short requests (steady decoders) while
   ``--long-arrivals`` long-prompt requests arrive at a fixed interval. Once colocated (every
   request on the decode node), once split (long prompts prefilled on the prefill node, their
   KV moved; short ones stay colocated by the split policy). Fresh tenant namespaces per phase,
   so neither phase hits the other's cache. Reported: the decoders' TPOT p50/p99 (gaps between
   streamed tokens at the client), TTFT p50/p99 of the long requests and of the decoders.

GPU variant (flags present, not run in the session that wrote this): ``--device cuda`` runs both
nodes on GPU 0 (``--gpus 1``) or the prefill node on GPU 0 and the decode node on GPU 1
(``--gpus 2``, via CUDA_VISIBLE_DEVICES); pass ``--model`` for a real checkpoint.

Prints a table and writes JSON (command, machine, commit, load average, figures) under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
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
import threading
import time
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.disagg.request_wire import request_to_wire  # noqa: E402
from engine.launch import ensure_tiny_model  # noqa: E402
from engine.protocol import GenerateRequest, SamplingParams, StaticTenantScope  # noqa: E402
from gateway.disagg_client import DisaggEngineClient, DisaggMetrics, SplitPolicy  # noqa: E402
from tests.serverutil import serve_tiny, stop  # noqa: E402

TOKEN = "pd-bench-node-token"
ENV = {"PD_BENCH_TOKEN": TOKEN}
HEADERS = {"authorization": f"Bearer {TOKEN}"}

# Written before the first run (CPU, tiny model, 2 shared cores):
PREDICTION = {
    "transfer_vs_socket": "0.2-0.6x: HMAC-SHA256 (~1-2 GB/s) and the engine-thread export/import copies sit in series "
                          "with the socket copy",
    "decoder_tpot_p99": "split lower than colocated (a long prefill no longer shares the decode engine's step), "
                        "but by less than on a GPU: both processes share the same 2 CPU cores",
    "long_ttft": "split higher than colocated: lookup + prefill round trip + transfer + import + the decode node's "
                 "tail prefill, and the prefill competes for the same cores",
}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "unknown"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# ----------------------------------------------------------------------------- copy baselines

def memcpy_bw(nbytes: int, repeats: int = 5) -> float:
    src = bytearray(os.urandom(1024)) * (nbytes // 1024 + 1)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst = bytes(src[:nbytes])  # noqa: F841 - the copy is what is timed
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def hmac_bw(nbytes: int, repeats: int = 5) -> float:
    data = os.urandom(nbytes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        hmac.new(b"k" * 32, data, hashlib.sha256).digest()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def socket_bw(nbytes: int, repeats: int = 5) -> float:
    """A plain loopback TCP copy of ``nbytes`` (sender thread -> receiver, until the last byte is read)."""
    data = os.urandom(nbytes)
    best = float("inf")
    for _ in range(repeats):
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        done = threading.Event()

        def drain(server: socket.socket = server, done: threading.Event = done) -> None:
            conn, _ = server.accept()
            buf, got = bytearray(1 << 20), 0
            with conn:
                while got < nbytes:
                    got += conn.recv_into(buf)
            done.set()

        th = threading.Thread(target=drain)
        th.start()
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(data)
            done.wait()
        best = min(best, time.perf_counter() - t0)
        th.join()
        server.close()
    return nbytes / best


def transport_only_bw(nbytes: int, block_bytes: int, repeats: int = 5) -> float:
    """The socket transport alone (frames, MACs, hash-chain checks, ack) into a receiver whose
    importer does nothing: the wire's share of a transfer, without the engines' export/import."""
    from concurrent.futures import Future

    from engine.disagg.api import derive_transfer_key
    from engine.disagg.metrics import TransferMetrics
    from engine.disagg.receiver import ImportOutcome, KVReceiver
    from engine.disagg.transport import OutgoingTransfer, SocketTransport
    from engine.disagg.wire import EngineLayout
    from engine.prefix_index import block_hashes

    bs, n = 16, max(1, nbytes // block_bytes)
    layout, key = EngineLayout("bench", "float32", bs, 4, block_bytes), derive_transfer_key("bench")
    tokens = list(range(n * bs))

    def importer(chunk, chain):  # noqa: ANN001, ANN202 - the receiver's callback shape
        f: Future = Future()
        f.set_result(ImportOutcome(chunk.num_blocks, chunk.num_blocks))
        return f

    rx = KVReceiver("127.0.0.1", 0, key, layout, importer, TransferMetrics(CollectorRegistry()))
    t = OutgoingTransfer("bw", b"bench", tuple(block_hashes(b"bench", tokens, bs)),
                         tuple(tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n)),
                         memoryview(os.urandom(n * block_bytes)))
    try:
        best = min(SocketTransport(rx.address, key, layout).send(t).seconds for _ in range(repeats))
    finally:
        rx.close()
    return n * block_bytes / best


# ----------------------------------------------------------------------------- requests

def gen_request(rid: str, ns: bytes, n_tokens: int, max_tokens: int, seed: int) -> GenerateRequest:
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 50000) for _ in range(n_tokens)]
    return GenerateRequest(rid, StaticTenantScope(namespace=ns),
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           prompt_token_ids=prompt)


async def stream_times(client: DisaggEngineClient, gr: GenerateRequest) -> tuple[float, list[float]]:
    """-> (TTFT, arrival time of each streamed token) at the client."""
    t0 = time.perf_counter()
    times: list[float] = []
    async for out in client.generate(gr):
        now = time.perf_counter()
        times += [now] * len(out.new_token_ids)
    return (times[0] - t0 if times else float("nan")), times


async def transfer_phase(prefill_url: str, receiver: str, n_tokens: int, repeats: int) -> list[dict]:
    out = []
    async with httpx.AsyncClient(headers=HEADERS, timeout=600, trust_env=False) as http:
        for i in range(repeats):
            gr = gen_request(f"bw{i}", f"bw-{i}".encode(), n_tokens, 1, seed=100 + i)
            r = await http.post(f"{prefill_url}/internal/v1/kv/prefill",
                                json={"request": request_to_wire(gr), "address": receiver})
            r.raise_for_status()
            d = r.json()
            out.append({"prefill_s": d["prefill_s"], **d["transfer"]})
    return out


async def mixed_phase(client: DisaggEngineClient, tag: str, args: argparse.Namespace) -> dict:
    stop_at = asyncio.Event()
    tpot: list[float] = []
    dec_ttft: list[float] = []
    long_ttft: list[float] = []
    counter = iter(range(10**9))

    async def decoder(d: int) -> None:
        while not stop_at.is_set():
            i = next(counter)
            gr = gen_request(f"{tag}-d{d}-{i}", f"{tag}-dec-{d}".encode(), args.short_tokens, args.decode_tokens,
                             seed=i)
            ttft, times = await stream_times(client, gr)
            dec_ttft.append(ttft)
            tpot.extend(b - a for a, b in zip(times, times[1:]))

    async def arrivals() -> None:
        await asyncio.sleep(args.warmup_s)
        pending = []
        for j in range(args.long_arrivals):
            gr = gen_request(f"{tag}-L{j}", f"{tag}-long-{j}".encode(), args.long_tokens, 8, seed=10_000 + j)
            pending.append(asyncio.create_task(stream_times(client, gr)))
            await asyncio.sleep(args.interval_s)
        for ttft, _ in await asyncio.gather(*pending):
            long_ttft.append(ttft)
        stop_at.set()

    t0 = time.perf_counter()
    await asyncio.gather(arrivals(), *(decoder(d) for d in range(args.decoders)))
    wall = time.perf_counter() - t0
    r = lambda x: round(x, 4) if x is not None else None  # noqa: E731
    return {
        "wall_s": round(wall, 2), "decoder_tokens": len(tpot) + len(dec_ttft),
        "decoder_tpot_p50_s": r(pct(tpot, 50)), "decoder_tpot_p99_s": r(pct(tpot, 99)),
        "decoder_ttft_p50_s": r(pct(dec_ttft, 50)), "decoder_ttft_p99_s": r(pct(dec_ttft, 99)),
        "long_ttft_p50_s": r(pct(long_ttft, 50)), "long_ttft_p99_s": r(pct(long_ttft, 99)),
        "long_requests": len(long_ttft),
    }


async def run(args: argparse.Namespace, prefill_url: str, decode_url: str) -> dict:
    async with httpx.AsyncClient(headers=HEADERS, trust_env=False) as http:
        receiver = (await http.get(f"{decode_url}/internal/v1/kv/receiver")).json()["address"]
    transfers = await transfer_phase(prefill_url, receiver, args.long_tokens, args.repeats)
    nbytes = max(t["bytes_sent"] for t in transfers)
    bw = [t["bytes_sent"] / t["seconds"] for t in transfers if t["seconds"] > 0]
    block_bytes = nbytes // max(1, max(t["blocks_sent"] for t in transfers))
    baselines = {"memcpy": memcpy_bw(nbytes), "socket": socket_bw(nbytes), "hmac_sha256": hmac_bw(nbytes),
                 "transport_noop_import": transport_only_bw(nbytes, block_bytes)}

    def client(min_split: int) -> DisaggEngineClient:
        return DisaggEngineClient(decode_url, [prefill_url], TOKEN, policy=SplitPolicy(min_split_tokens=min_split),
                                  metrics=DisaggMetrics(CollectorRegistry()))

    colocated, split = client(10**9), client(args.split_min_tokens)
    try:
        mixed = {"colocated": await mixed_phase(colocated, "co", args),
                 "split": await mixed_phase(split, "sp", args)}
    finally:
        await colocated.aclose()
        await split.aclose()
    return {
        "transfer": {"bytes": nbytes, "runs": transfers, "bandwidth_bytes_per_s_median": statistics.median(bw),
                     "baselines_bytes_per_s": baselines,
                     "ratio_vs_socket": statistics.median(bw) / baselines["socket"],
                     "ratio_vs_memcpy": statistics.median(bw) / baselines["memcpy"]},
        "mixed": mixed,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds: 2 decoders, 2 short long-prompt arrivals")
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--long-arrivals", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=1536)
    p.add_argument("--short-tokens", type=int, default=48)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--interval-s", type=float, default=2.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--split-min-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu or cuda (GPU variant: not run by the CPU CI)")
    p.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="with --device cuda: nodes share GPU 0 or get one each")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the tiny model)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.decoders, args.long_arrivals, args.long_tokens = 2, 2, 320
        args.decode_tokens, args.interval_s, args.warmup_s, args.repeats = 12, 0.5, 0.5, 2

    tmp = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    homes = [tmp / "prefill", tmp / "decode"]
    ensure_tiny_model(homes[0])
    shutil.copytree(homes[0] / "models", homes[1] / "models")
    extra = ["--device", args.device] + (["--model", args.model] if args.model else [])
    env = [dict(ENV), dict(ENV)]
    if args.device.startswith("cuda") and args.gpus == 2:
        env[0]["CUDA_VISIBLE_DEVICES"], env[1]["CUDA_VISIBLE_DEVICES"] = "0", "1"
    procs = []
    load_before = os.getloadavg()
    try:
        prefill_url, pp = serve_tiny(homes[0], "--role", "prefill", "--node-token-env", "PD_BENCH_TOKEN", *extra,
                                     env=env[0])
        procs.append(pp)
        decode_url, dp = serve_tiny(homes[1], "--role", "decode", "--node-token-env", "PD_BENCH_TOKEN", *extra,
                                    env=env[1])
        procs.append(dp)
        figures = asyncio.run(run(args, prefill_url, decode_url))
    finally:
        for proc in procs:
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "command": " ".join(["python", "benchmarks/pd.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "commit": git_commit(), "device": args.device, "gpus": args.gpus,
        "model": args.model or "tiny", "args": vars(args), "prediction": PREDICTION, **figures,
    }
    t, m = figures["transfer"], figures["mixed"]
    mb = 1e6
    print(f"transfer of {t['bytes'] / mb:.2f} MB: {t['bandwidth_bytes_per_s_median'] / mb:.0f} MB/s "
          f"(socket copy {t['baselines_bytes_per_s']['socket'] / mb:.0f} MB/s = {t['ratio_vs_socket']:.2f}x, "
          f"memcpy {t['baselines_bytes_per_s']['memcpy'] / mb:.0f} MB/s, "
          f"HMAC-SHA256 {t['baselines_bytes_per_s']['hmac_sha256'] / mb:.0f} MB/s, "
          f"the transport alone into a no-op importer {t['baselines_bytes_per_s']['transport_noop_import'] / mb:.0f} MB/s)")
    keys = ["decoder_tpot_p50_s", "decoder_tpot_p99_s", "decoder_ttft_p50_s", "decoder_ttft_p99_s",
            "long_ttft_p50_s", "long_ttft_p99_s", "decoder_tokens", "wall_s"]
    print(f"{'measure':<22}{'colocated':>12}{'split':>12}{'split/colocated':>17}")
    for k in keys:
        a, b = m["colocated"][k], m["split"][k]
        ratio = f"{b / a:.2f}x" if a and b else "-"
        print(f"{k:<22}{a!s:>12}{b!s:>12}{ratio:>17}")
    name = "pd_cpu_smoke.json" if args.smoke else f"pd_{args.device.split(':')[0]}.json"
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
