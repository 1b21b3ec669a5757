"""The driver's side of ``benchmarks/pd.py --nodes engine``: two ``pd_node.py`` processes, a client
per node, and the split decision of the gateway's ``DisaggEngineClient`` made the same way
(decode node lookup -> ``SplitPolicy.decide`` -> prefill node ``prefill_and_send`` -> decode node
``generate``), without HTTP in between.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any, Protocol

from engine.disagg.api import HandoffReport, LookupResult
from engine.protocol import GenerateRequest, RequestOutput
from gateway.disagg_client import Placement, SplitPolicy
from gateway.routing_policy import prefix_hash_choice, token_route_key

REPO = Path(__file__).resolve().parents[1]


class NodeClient:
    """Calls into one node process; replies are routed to the asyncio loop that made the call."""

    def __init__(self, port: int, authkey: bytes, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = Client(("127.0.0.1", port), authkey=authkey)
        self.loop = loop
        self._ids = itertools.count()
        self._queues: dict[int, asyncio.Queue[tuple[str, Any]]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                kind, cid, value = self.conn.recv()
            except (EOFError, OSError):
                for q in list(self._queues.values()):
                    self.loop.call_soon_threadsafe(q.put_nowait, ("error", "node connection closed"))
                return
            q = self._queues.get(cid)
            if q is not None:
                self.loop.call_soon_threadsafe(q.put_nowait, (kind, value))

    def _start(self, op: str, *args: Any) -> tuple[int, asyncio.Queue[tuple[str, Any]]]:
        cid = next(self._ids)
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._queues[cid] = q
        with self._lock:
            self.conn.send((op, cid, *args))
        return cid, q

    async def call(self, op: str, *args: Any) -> Any:
        cid, q = self._start(op, *args)
        try:
            kind, value = await q.get()
        finally:
            self._queues.pop(cid, None)
        if kind == "error":
            raise RuntimeError(f"node {op}: {value}")
        return value

    async def stream(self, op: str, *args: Any) -> AsyncIterator[Any]:
        cid, q = self._start(op, *args)
        try:
            while True:
                kind, value = await q.get()
                if kind == "item":
                    yield value
                elif kind == "done":
                    return
                else:
                    raise RuntimeError(f"node {op}: {value}")
        finally:
            self._queues.pop(cid, None)

    def close(self) -> None:
        with self._lock:
            self.conn.send(("stop", -1))
        self.conn.close()


@dataclasses.dataclass(frozen=True)
class SplitTiming:
    """One split request's way to its first token, part by part, as the driver saw it."""

    lookup_s: float  # the decode node's lookup round trip
    handoff_s: float  # the prefill node's call, end to end: its queue, the prefill, the export, the transfer
    report: HandoffReport  # the prefill node's own figures: prefill_s (its queue and the prefill), the transfer
    first_token_s: float  # from the handoff's return to the decode node's first token


# The parts ``split_phases`` reports, each a function of one split's timing.
_PHASES = {
    "lookup_s": lambda t: t.lookup_s,
    "prefill_node_s": lambda t: t.report.prefill_s,
    "transfer_s": lambda t: t.report.transfer.seconds,
    # what the call took beyond the two: the export (gather into the staging rows) and the calls' own hops
    "export_and_calls_s": lambda t: max(0.0, t.handoff_s - t.report.prefill_s - t.report.transfer.seconds),
    "first_token_s": lambda t: t.first_token_s,
}


def split_parts(timings: list[SplitTiming]) -> dict[str, list[float]]:
    """Each part of the split requests' TTFT, one value a request (``pd.split_phases`` takes their
    percentiles): which part a slow split spent its time in (the prefill node's queue behind earlier
    long prompts, the transfer, or the decode node's first step behind its running batch)."""
    return {name: [part(t) for t in timings] for name, part in _PHASES.items()}


@dataclasses.dataclass
class PairClient:
    """Colocated (``policy`` None: every request on the decode node) or split by ``policy``."""

    decode: NodeClient
    prefill: NodeClient
    receiver: str
    policy: SplitPolicy | None
    handoffs: list[HandoffReport] = dataclasses.field(default_factory=list)
    splits: list[SplitTiming] = dataclasses.field(default_factory=list)
    prefill_inflight: int = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        parts: tuple[float, float, HandoffReport] | None = None
        if self.policy is not None:
            t0 = time.perf_counter()
            look: LookupResult = await self.decode.call("lookup", request)
            t1 = time.perf_counter()
            placement, _reason = self.policy.decide(look, self.prefill_inflight)
            if placement is Placement.SPLIT:
                self.prefill_inflight += 1
                try:
                    report = await self.prefill.call("prefill", request, self.receiver, look.cached_tokens)
                finally:
                    self.prefill_inflight -= 1
                self.handoffs.append(report)
                parts = (t1 - t0, time.perf_counter() - t1, report)
        t_decode = time.perf_counter()
        async for out in self.decode.stream("generate", request):
            if parts is not None and out.new_token_ids:
                self.splits.append(SplitTiming(parts[0], parts[1], parts[2], time.perf_counter() - t_decode))
                parts = None
            yield out


class StreamingNode(Protocol):
    """What ``RoutedPairClient`` asks of a node (``NodeClient`` has it)."""

    def stream(self, op: str, *args: Any) -> AsyncIterator[Any]: ...


@dataclasses.dataclass
class RoutedNode:
    """One engine of ``RoutedPairClient``'s pool: what the routing policy reads (``NodeLoad``)."""

    label: str
    client: StreamingNode
    inflight: int = 0
    picked: int = 0


# The gateway's defaults (gateway/settings.py): route_prefix_tokens 256, the in-flight guard 2.0;
# the nodes' KV block size and the router's longest chain.
ROUTE_PREFIX_TOKENS, ROUTE_LOAD_FACTOR, ROUTE_BLOCK_SIZE, ROUTE_MAX_BLOCKS = 256, 2.0, 16, 512


@dataclasses.dataclass
class RoutedPairClient:
    """Two independent colocated engines, each serving whole requests (prefill and decode on its own
    GPU with ``--gpus 2``), chosen per request as the gateway's default policy chooses among engine
    nodes: rendezvous hashing on the prompt's leading block hash, leaving the affinity node once it
    has more than ``load_factor`` x (least + 1) in flight (``gateway.routing_policy``)."""

    nodes: list[RoutedNode]
    load_factor: float = ROUTE_LOAD_FACTOR

    def pick(self, request: GenerateRequest) -> RoutedNode:
        if request.prompt_token_ids is None:
            raise ValueError("the benchmark's requests carry token ids")
        key, _chain = token_route_key(request.tenant.namespace, request.prompt_token_ids, ROUTE_BLOCK_SIZE,
                                      ROUTE_PREFIX_TOKENS // ROUTE_BLOCK_SIZE, ROUTE_MAX_BLOCKS)
        return prefix_hash_choice(key, self.nodes, self.load_factor)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        node = self.pick(request)
        node.inflight += 1
        node.picked += 1
        try:
            async for out in node.client.stream("generate", request):
                yield out
        finally:
            node.inflight -= 1


def start_node(role: str, device: str, args: Any, env: dict[str, str]) -> subprocess.Popen:
    """Spawn a node (both start in parallel: model build and CUDA graph capture); see ``wait_ready``."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "pd_node.py"), "--role", role, "--device", device,
           "--shape", args.shape, "--kv-blocks", str(args.kv_blocks),
           "--max-model-len", str(args.long_tokens + args.decode_tokens + 64),
           "--max-batched-tokens", str(args.max_batched_tokens)]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env},
                            stdout=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen, role: str) -> int:
    """-> the node's port once it printed READY."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{role} node exited ({proc.wait()}) before READY")
        if line.startswith("READY "):
            # keep reading what it prints later: a full pipe would block the node
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return int(line.split()[1])
    proc.kill()
    raise RuntimeError(f"{role} node not ready in time")


def node_env(token: str) -> tuple[dict[str, str], bytes]:
    key = secrets.token_hex(16)
    return {"PD_NODE_AUTHKEY": key, "PD_BENCH_TOKEN": token}, key.encode()


def device_copy_bw(nbytes: int, src: str, dst: str, repeats: int = 5) -> float:
    """A plain device-to-device copy of ``nbytes`` (a peer copy when ``src != dst``), best of ``repeats``."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=src).random_(0, 255)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    b.copy_(a)  # warm-up (and peer access set up)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def digest_bw(nbytes: int, device: str, repeats: int = 5) -> float:
    """The transfer's keyed checksum alone over ``nbytes`` on ``device`` (it runs once on each side)."""
    import torch

    from engine.disagg.shared_transport import keyed_digest

    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    keyed_digest(b"k", a)  # warm-up (multipliers built)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        keyed_digest(b"k", a)  # ends in a sync (.item())
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
