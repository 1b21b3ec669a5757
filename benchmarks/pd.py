"""Prefill/decode split on loopback: transfer bandwidth, and a mixed workload split vs colocated.

    python benchmarks/pd.py [--smoke] [--decoders 4] [--long-arrivals 4] [--long-tokens 1024]
                            [--device cpu|cuda] [--gpus 1|2] [--model smol|tiny|DIR] [--out FILE]
                            [--nodes serve|engine] [--shape 8b|small] [--kv-blocks N] [--split-min-tokens N]

Starts two real engine processes (``prefixgate serve --role prefill`` and ``--role decode``,
SmolLM2-135M-Instruct on CPU by default) and drives them with the gateway's split client
(``gateway.disagg_client.DisaggEngineClient``), in one run:

1. Transfer bandwidth: long prompts prefilled on the prefill node and sent to the decode node's
   receiver (``POST /internal/v1/kv/prefill``: bytes on the wire / seconds from connect to ack,
   MAC'd chunks of 16 blocks), against, measured in this same run on the same byte count:
   a memcpy, a plain loopback TCP copy between two threads, HMAC-SHA256 over the bytes, the
   socket transport alone and the /dev/shm shared-buffer transport alone (no-op importers).
2. Mixed workload: ``--decoders`` clients each looping short requests (steady decoders) while
   ``--long-arrivals`` long-prompt requests arrive at a fixed interval. Once colocated (every
   request on the decode node), once split (long prompts prefilled on the prefill node, their
   KV moved; short ones stay colocated by the split policy). Fresh tenant namespaces per phase,
   so neither phase hits the other's cache. Reported: the decoders' TPOT p50/p99 (gaps between
   streamed tokens at the client), TTFT p50/p99 of the long requests and of the decoders, and
   every generated token per second of wall time; with ``--nodes engine``, the split requests'
   TTFT by part (``split_phases``) and a third arm: both processes as
   independent colocated engines, each request routed as the gateway routes among engine nodes
   (``pd_engine_nodes.RoutedPairClient``: rendezvous on the prompt's leading block hash, with the
   in-flight guard).

``--nodes engine`` (the default with ``--device cuda``) starts two ``benchmarks/pd_node.py``
processes instead: the same ``DisaggEngine`` roles with a random-weight model (``--shape 8b``: the
Llama-3.1-8B shape in bf16, built on the GPU as in benchmarks/engine_gpu.py), driven over a local
connection with the gateway's ``SplitPolicy`` (no checkpoint, no gateway packages: what the GPU
machines have). ``--device cuda --gpus 1`` puts both on GPU 0 and the KV moves through CUDA IPC;
``--gpus 2`` puts the prefill node on GPU 0 and the decode node on GPU 1 (peer copies; both
processes see both GPUs). Transfer baselines there: a device-to-device copy of the same bytes
(and the peer copy GPU 0 -> 1 with two GPUs) and the transfer's keyed digest alone.
``bash benchmarks/gpu_pd.sh`` is the one-call GPU run (``PD_GPUS=2`` for two GPUs).

Prints a table and writes JSON (command, machine, commit, load average, figures) under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import hmac
import json
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.provenance import git_commit  # noqa: E402 - after the path insert
from engine.disagg.request_wire import request_to_wire  # noqa: E402
from engine.launch import ensure_smol_model, ensure_tiny_model  # noqa: E402
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
    "host_shm_vs_socket_transport": "1.2-2x the socket transport alone: no kernel socket copy, but a copy into "
                                    "the file and two digest passes in torch (int64 temporaries)",
}
# Written before the first GPU run (H200, 8B-shaped random bf16 model, two engine processes on GPU 0):
PREDICTION_GPU = {
    "cuda_ipc_vs_device_copy": "0.1-0.3x on one GPU: gather, landing copy and scatter are three copies, two "
                               "digest passes read the bytes with int64 temporaries, and each chunk waits for a "
                               "frame round trip and an engine-thread hop; on two GPUs 0.5-0.8x of the peer copy "
                               "(the NVLink copy dominates the on-device passes)",
    "decoder_tpot_p99": "split lower than colocated, but less than the prefill step's share: without MPS the two "
                        "processes' kernels time-slice the one GPU, so a long prefill still delays decode steps",
    "long_ttft": "split higher: lookup + prefill round trip + transfer + import + the decode node's first step",
    # written before the first run of the routed arm (session 40, an H100 with --gpus 1; #23's two-GPU run after)
    "routed_one_gpu": "two colocated engines on one GPU, routed as the gateway routes: decoders' TPOT p99 at or "
                      "above one colocated engine's (each still chunks its long prefills into its decode steps, "
                      "and the two processes time-slice the card), long-prompt TTFT p50 within 0.8-1.5x of it, "
                      "generated tokens/s 0.7-1.0x of it (two half-sized decode batches take turns)",
    "routed_two_gpus": "two colocated engines on two GPUs: decoders' TPOT p99 near one colocated engine's (the "
                       "chunks stay in the steps), above the split's; long-prompt TTFT p50 the lowest of the three "
                       "(no transfer, half the queue); generated tokens/s 1.5-2x one colocated engine's",
}


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

def gen_request(rid: str, ns: bytes, n_tokens: int, max_tokens: int, seed: int, hi: int = 30000) -> GenerateRequest:
    """``hi``: above the largest token id drawn; 30,000 fits every served vocabulary (SmolLM2: 49,152)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(min(1000, hi // 2), hi) for _ in range(n_tokens)]
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
            if r.status_code != 200:
                raise RuntimeError(f"prefill node answered {r.status_code}: {r.text[:500]}")
            d = r.json()
            out.append({"prefill_s": d["prefill_s"], **d["transfer"]})
    return out


def split_phases(parts: dict[str, list[float]]) -> dict[str, dict[str, float | None]]:
    """p50 / p99 of each part of the split requests' TTFT (``pd_engine_nodes.split_parts``), by the same
    percentile as every other figure here; empty when no request was split."""
    return {name: {"p50": round(pct(v, 50) or 0.0, 4), "p99": round(pct(v, 99) or 0.0, 4)}
            for name, v in parts.items() if v}


def median_of_rounds(rounds: list[dict]) -> dict:
    """Each numeric figure of ``mixed_phase``'s rounds as its median over them (a figure missing from a
    round, e.g. no long request finished, is left out of that figure's median), the rounds kept too."""
    out: dict = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
        if values:
            out[key] = round(statistics.median(values), 4)
        elif all(r.get(key) is None for r in rounds):
            out[key] = None
    if len(rounds) > 1:
        out["rounds"] = rounds
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
                             seed=i, hi=args.token_hi)
            ttft, times = await stream_times(client, gr)
            dec_ttft.append(ttft)
            tpot.extend(b - a for a, b in zip(times, times[1:]))

    long_out: list[int] = []

    async def arrivals() -> None:
        await asyncio.sleep(args.warmup_s)
        pending = []
        for j in range(args.long_arrivals):
            gr = gen_request(f"{tag}-L{j}", f"{tag}-long-{j}".encode(), args.long_tokens, 8, seed=10_000 + j, hi=args.token_hi)
            pending.append(asyncio.create_task(stream_times(client, gr)))
            await asyncio.sleep(args.interval_s)
        for ttft, times in await asyncio.gather(*pending):
            long_ttft.append(ttft)
            long_out.append(len(times))
        stop_at.set()

    t0 = time.perf_counter()
    await asyncio.gather(arrivals(), *(decoder(d) for d in range(args.decoders)))
    wall = time.perf_counter() - t0
    r = lambda x: round(x, 4) if x is not None else None  # noqa: E731
    generated = len(tpot) + len(dec_ttft) + sum(long_out)
    return {
        "wall_s": round(wall, 2), "decoder_tokens": len(tpot) + len(dec_ttft),
        "tokens_per_s": round(generated / wall, 1),  # every generated token, decoders' and long prompts'
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
                 "transport_noop_import": transport_only_bw(nbytes, block_bytes),
                 "host_shm_noop_import": host_shm_only_bw(nbytes, block_bytes)}

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


def host_shm_only_bw(nbytes: int, block_bytes: int, repeats: int = 5) -> float:
    """The /dev/shm shared-buffer transport (same frames and checks, bytes mapped instead of sent,
    keyed digest on both sides) into a receiver whose importer does nothing."""
    from concurrent.futures import Future

    import torch

    from engine.disagg.api import derive_transfer_key
    from engine.disagg.metrics import TransferMetrics
    from engine.disagg.receiver import ImportOutcome, KVReceiver
    from engine.disagg.shared_transport import HostShmTransport, landing_for
    from engine.disagg.transport import OutgoingTransfer
    from engine.disagg.wire import EngineLayout
    from engine.prefix_index import block_hashes

    bs, n = 16, max(1, nbytes // block_bytes)
    layout, key = EngineLayout("bench", "float32", bs, 4, block_bytes), derive_transfer_key("bench")
    tokens = list(range(n * bs))

    def importer(chunk, chain):  # noqa: ANN001, ANN202 - the receiver's callback shape
        f: Future = Future()
        f.set_result(ImportOutcome(chunk.num_blocks, chunk.num_blocks))
        return f

    rx = KVReceiver("127.0.0.1", 0, key, layout, importer, TransferMetrics(CollectorRegistry()),
                    landing=landing_for(key, "cpu"))
    t = OutgoingTransfer("bw", b"bench", tuple(block_hashes(b"bench", tokens, bs)),
                         tuple(tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n)),
                         torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8))
    try:
        best = min(HostShmTransport(rx.address, key, layout).send(t).seconds for _ in range(repeats))
    finally:
        rx.close()
    return n * block_bytes / best


async def run_engine_nodes(args: argparse.Namespace, ports: tuple[int, int], authkeys: tuple[bytes, bytes],
                           devices: tuple[str, str]) -> dict:
    """Transfer bandwidth and the mixed workload against two ``pd_node.py`` processes."""
    from pd_engine_nodes import (
        NodeClient,
        PairClient,
        RoutedNode,
        RoutedPairClient,
        device_copy_bw,
        digest_bw,
        split_parts,
    )

    loop = asyncio.get_running_loop()
    prefill, decode = (NodeClient(p, k, loop) for p, k in zip(ports, authkeys))
    async def compiled() -> dict[str, list[dict[str, str]]]:
        # Triton launches each node compiled since the last ask: a compile stalls that node's engine
        # thread for a second or more, so a round that compiles is not a steady-state round
        return {"prefill": await prefill.call("compiles"), "decode": await decode.call("compiles")}

    try:
        # the build, the graph captures and the kernel warm-up; then the transfer phase's own (below)
        at_start = {"before": "transfers", **await compiled()}
        receiver = await decode.call("address")
        transfers = []
        for i in range(args.repeats):
            gr = gen_request(f"bw{i}", f"bw-{i}".encode(), args.long_tokens, 1, seed=100 + i, hi=args.token_hi)
            rep = await prefill.call("prefill", gr, receiver, 0)
            transfers.append({"prefill_s": rep.prefill_s, **dataclasses.asdict(rep.transfer),
                              "status": rep.transfer.status.value})
        nbytes = max(t["bytes_sent"] for t in transfers)
        bw = [t["bytes_sent"] / t["seconds"] for t in transfers if t["seconds"] > 0 and t["status"] == "imported"]
        if devices[0].startswith("cuda"):
            baselines = {"device_copy_same_gpu": device_copy_bw(nbytes, devices[1], devices[1]),
                         "keyed_digest": digest_bw(nbytes, devices[1])}
            if devices[0] != devices[1]:
                baselines["peer_copy"] = device_copy_bw(nbytes, devices[0], devices[1])
            ref = baselines.get("peer_copy", baselines["device_copy_same_gpu"])
        else:
            baselines = {"memcpy": memcpy_bw(nbytes)}
            ref = baselines["memcpy"]
        # three arms: one colocated engine (the decode node), the split, and the third arm: both
        # processes as independent colocated engines routed as the gateway routes (each on its own GPU with
        # --gpus 2; time-slicing GPU 0 with --gpus 1). Rounds interleave the arms (fresh namespaces each),
        # so a slow stretch of the host falls on all three; each figure is the median over the rounds.
        split = PairClient(decode, prefill, receiver, SplitPolicy(min_split_tokens=args.split_min_tokens))
        routed = RoutedPairClient([RoutedNode(f"engine-{devices[0]}-a", prefill),
                                   RoutedNode(f"engine-{devices[1]}-b", decode)])
        arms = {"colocated": PairClient(decode, prefill, receiver, None), "split": split, "routed": routed}
        rounds: dict[str, list[dict]] = {arm: [] for arm in arms}

        compiles = [at_start, {"before": "mixed", **await compiled()}]
        for r in range(args.mixed_repeats):
            for arm, arm_client in arms.items():
                rounds[arm].append(await mixed_phase(arm_client, f"{arm[:2]}{r}", args))
                compiles.append({"round": r, "arm": arm, **await compiled()})
        mixed = {arm: median_of_rounds(rs) for arm, rs in rounds.items()}
        mixed["compiles"] = compiles
        mixed["split"]["handoffs"] = len(split.handoffs)
        mixed["split"]["handoff_status"] = sorted({h.transfer.status.value for h in split.handoffs})
        mixed["split"]["phases"] = split_phases(split_parts(split.splits))  # over every round's split requests
        mixed["routed"]["picks"] = {n.label: n.picked for n in routed.nodes}
        leaks = {"prefill": await prefill.call("integrity"), "decode": await decode.call("integrity")}
    finally:
        prefill.close()
        decode.close()
    med = statistics.median(bw) if bw else 0.0
    return {
        "transfer": {"bytes": nbytes, "runs": transfers, "bandwidth_bytes_per_s_median": med,
                     "transport": "cuda_ipc" if devices[0].startswith("cuda") else "socket",
                     "baselines_bytes_per_s": baselines, "ratio_vs_copy": med / ref},
        "mixed": mixed, "integrity": leaks,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds: 2 decoders, 2 short long-prompt arrivals")
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--long-arrivals", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--short-tokens", type=int, default=48)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--interval-s", type=float, default=4.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--split-min-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mixed-repeats", type=int, default=1,
                   help="--nodes engine: rounds of the mixed workload, the arms interleaved; figures are medians")
    p.add_argument("--device", default="cpu", help="cpu or cuda (GPU variant: not run by the CPU CI)")
    p.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="with --device cuda: nodes share GPU 0 or get one each")
    p.add_argument("--model", default="smol",
                   help="'smol' (SmolLM2-135M-Instruct, the default served model), 'tiny', or a checkpoint directory")
    p.add_argument("--nodes", choices=("serve", "engine"), default=None,
                   help="serve: two `prefixgate serve` processes (HTTP, a checkpoint); engine: two "
                        "benchmarks/pd_node.py processes with a random-weight model (default with --device cuda)")
    p.add_argument("--shape", choices=("8b", "small"), default="8b", help="--nodes engine: the model's shape")
    p.add_argument("--kv-blocks", type=int, default=8192, help="--nodes engine: KV blocks per node")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="--nodes engine: the step's token budget")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.nodes = args.nodes or ("engine" if args.device.startswith("cuda") else "serve")
    args.token_hi = 4096 if args.nodes == "engine" and args.shape == "small" else 30000
    if args.smoke:
        args.decoders, args.long_arrivals, args.long_tokens = 2, 2, 320
        args.decode_tokens, args.interval_s, args.warmup_s, args.repeats = 12, 0.5, 0.5, 2

    if args.nodes == "engine":
        return main_engine_nodes(args)
    tmp = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    homes = [tmp / "prefill", tmp / "decode"]
    model_dir = {"smol": ensure_smol_model, "tiny": ensure_tiny_model}.get(args.model, lambda _h: Path(args.model))(homes[0])
    if (homes[0] / "models").is_dir():
        shutil.copytree(homes[0] / "models", homes[1] / "models")
    extra = ["--model", str(model_dir)]
    env = [dict(ENV), dict(ENV)]
    devs = [args.device, args.device]
    if args.device.startswith("cuda") and args.gpus == 2:
        devs = ["cuda:0", "cuda:1"]  # both processes see both GPUs: a CUDA IPC handle names GPU 0 for GPU 1
    procs = []
    load_before = os.getloadavg()
    try:
        prefill_url, pp = serve_tiny(homes[0], "--role", "prefill", "--node-token-env", "PD_BENCH_TOKEN", *extra,
                                     "--device", devs[0], env=env[0])
        procs.append(pp)
        decode_url, dp = serve_tiny(homes[1], "--role", "decode", "--node-token-env", "PD_BENCH_TOKEN", *extra,
                                    "--device", devs[1], env=env[1])
        procs.append(dp)
        figures = asyncio.run(run(args, prefill_url, decode_url))
    finally:
        for proc in procs:
            stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    return report(args, figures, load_before)


def main_engine_nodes(args: argparse.Namespace) -> int:
    from pd_engine_nodes import node_env, start_node, wait_ready

    gpu = args.device.startswith("cuda")
    devices = ("cuda:0", "cuda:1" if args.gpus == 2 else "cuda:0") if gpu else ("cpu", "cpu")
    load_before = os.getloadavg()
    procs, ports, keys = [], [], []
    try:
        for role, dev in zip(("prefill", "decode"), devices):
            env, key = node_env(TOKEN)
            procs.append(start_node(role, dev, args, env))
            keys.append(key)
        ports = [wait_ready(proc, role) for proc, role in zip(procs, ("prefill", "decode"))]
        figures = asyncio.run(run_engine_nodes(args, (ports[0], ports[1]), (keys[0], keys[1]), devices))
    finally:
        for proc in procs:
            stop(proc)
    figures["devices"] = {"prefill": devices[0], "decode": devices[1]}
    if gpu:
        import torch

        figures["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return report(args, figures, load_before)


def report(args: argparse.Namespace, figures: dict, load_before: tuple[float, float, float]) -> int:
    result = {
        "command": " ".join(["python", "benchmarks/pd.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "commit": git_commit(), "device": args.device, "gpus": args.gpus,
        "model": args.model if args.nodes == "serve" else f"random {args.shape}-shaped", "args": vars(args), "prediction": PREDICTION_GPU if args.device.startswith("cuda") else PREDICTION,
        **figures,
    }
    t, m = figures["transfer"], figures["mixed"]
    mb = 1e6
    if "ratio_vs_copy" in t:
        base = ", ".join(f"{k} {v / mb:,.0f} MB/s" for k, v in t["baselines_bytes_per_s"].items())
        print(f"transfer of {t['bytes'] / mb:.2f} MB through {t['transport']}: "
              f"{t['bandwidth_bytes_per_s_median'] / mb:,.0f} MB/s = {t['ratio_vs_copy']:.2f}x of the copy ({base})")
    else:
        print_socket_transfer(t)
    keys = ["decoder_tpot_p50_s", "decoder_tpot_p99_s", "decoder_ttft_p50_s", "decoder_ttft_p99_s",
            "long_ttft_p50_s", "long_ttft_p99_s", "decoder_tokens", "tokens_per_s", "wall_s"]
    arms = [a for a in ("split", "routed") if a in m]
    print(f"{'measure':<22}{'colocated':>12}" + "".join(f"{a:>12}{a + '/colocated':>18}" for a in arms))
    for k in keys:
        base = m["colocated"][k]
        cells = ""
        for a in arms:
            v = m[a][k]
            cells += f"{v!s:>12}{(f'{v / base:.2f}x' if base and v else '-'):>18}"
        print(f"{k:<22}{base!s:>12}{cells}")
    if "routed" in m:
        print("routed: requests per engine " + ", ".join(f"{k} {v}" for k, v in m["routed"]["picks"].items()))
    def names(c: dict, node: str) -> str:
        return ", ".join(k["kernel"].split("[", 1)[0] for k in c[node]) or "-"

    for c in m.get("compiles", []):
        if c.get("before") == "transfers":  # the build, the graph captures, the warm-up: counts only
            print(f"Triton compiles at start: prefill node {len(c['prefill'])}, decode node {len(c['decode'])}")
        elif "before" in c:  # the transfer phase (each node's first export / import)
            print(f"Triton compiles in the transfer phase: prefill node {names(c, 'prefill')}; "
                  f"decode node {names(c, 'decode')}")
        elif c["prefill"] or c["decode"]:
            print(f"Triton compiles, round {c['round']} {c['arm']}: prefill node {names(c, 'prefill')}; "
                  f"decode node {names(c, 'decode')}")
    phases = m["split"].get("phases")
    if phases:
        print("split requests' TTFT by part, p50 / p99 s: "
              + ", ".join(f"{k.removesuffix('_s')} {v['p50']} / {v['p99']}" for k, v in phases.items()))
    if args.smoke:
        name = f"pd_{args.device.split(':')[0]}_smoke.json"
    else:
        name = f"pd_{args.device.split(':')[0]}{'_' + args.shape if args.nodes == 'engine' else ''}" \
               f"{'_2gpu' if args.gpus == 2 and args.device.startswith('cuda') else ''}.json"
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def print_socket_transfer(t: dict) -> None:
    mb = 1e6
    print(f"transfer of {t['bytes'] / mb:.2f} MB: {t['bandwidth_bytes_per_s_median'] / mb:.0f} MB/s "
          f"(socket copy {t['baselines_bytes_per_s']['socket'] / mb:.0f} MB/s = {t['ratio_vs_socket']:.2f}x, "
          f"memcpy {t['baselines_bytes_per_s']['memcpy'] / mb:.0f} MB/s, "
          f"HMAC-SHA256 {t['baselines_bytes_per_s']['hmac_sha256'] / mb:.0f} MB/s, "
          f"the transport alone into a no-op importer {t['baselines_bytes_per_s']['transport_noop_import'] / mb:.0f} MB/s, "
          f"the /dev/shm transport alone {t['baselines_bytes_per_s']['host_shm_noop_import'] / mb:.0f} MB/s)")


if __name__ == "__main__":
    raise SystemExit(main())
