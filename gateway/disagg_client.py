"""``DisaggEngineClient``: one decode node plus a pool of prefill nodes, split or colocated per request.

    generate(req)
      decode node: POST /internal/v1/kv/lookup  -> prompt tokens, prefix cached there, queue depth
      SplitPolicy.decide(...)
        colocated: decode node runs the whole request (short prompt, prefix already there, prefill busy)
        split:     least-loaded prefill node: POST /internal/v1/kv/prefill {request, decode's receiver,
                   skip_tokens = the decode node's prefix} (it prefills, sends the blocks the decode
                   node lacks, returns after the decode node's ack)
                   then the decode node runs the request: its prompt is now a prefix hit
      a prefill node that fails, refuses or whose transfer is rejected: the decode node computes
      what did not arrive (the request still completes); the failure is counted.

``cached_tokens`` after a split = min(prefill node's hit, decode node's hit): the prompt tokens no
engine computed for this request (the transferred ones were paid for on the prefill node).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.disagg.api import WILDCARD_HOSTS, LookupResult, receiver_host, with_receiver_host
from engine.disagg.request_wire import request_to_wire
from engine.protocol import EngineError, GenerateRequest, RequestOutput
from gateway.remote import HEALTH_TIMEOUT_S, NodeUnavailableError, RemoteEngineClient, _error_from_response

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Placement(enum.StrEnum):
    COLOCATED = "colocated"
    SPLIT = "split"


@dataclass(frozen=True)
class SplitPolicy:
    """Split only when the prefill that would stall the decode node's running decoders is long
    enough to be worth moving, and a prefill node has room.

    min_split_tokens: uncached prompt tokens (prompt - prefix already cached on the decode node)
        below which the request stays on the decode node: moving the KV costs more than it saves.
    max_prefill_queue: requests in flight on the chosen prefill node at or above which a request
        stays colocated (a queued prefill would only add its wait to the TTFT).
    split_when_decode_idle: False = a decode node with nothing running and nothing waiting
        computes the prefill itself (no decoder to stall).
    """

    min_split_tokens: int = 256
    max_prefill_queue: int = 8
    split_when_decode_idle: bool = True

    def decide(self, look: LookupResult, prefill_inflight: int) -> tuple[Placement, str]:
        uncached = look.prompt_tokens - look.cached_tokens
        if uncached < self.min_split_tokens:
            return Placement.COLOCATED, "cached_on_decode" if look.cached_tokens else "short_prompt"
        if prefill_inflight >= self.max_prefill_queue:
            return Placement.COLOCATED, "prefill_busy"
        if not self.split_when_decode_idle and look.running == 0 and look.waiting == 0:
            return Placement.COLOCATED, "decode_idle"
        return Placement.SPLIT, "long_uncached_prompt"


class DisaggMetrics:
    """Gateway-side view of the split: decisions, TTFT parts, failures, bytes moved."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = Counter("prefixgate_pd_decisions", "Split or colocated, and why", ["placement", "reason"],
                                 registry=r)
        self.ttft_part = Histogram("prefixgate_pd_ttft_part_seconds",
                                   "TTFT of split requests by part: prefill, transfer, first_decode", ["part"],
                                   buckets=_SECONDS, registry=r)
        self.failures = Counter("prefixgate_pd_failures", "Split requests that fell back to recompute, by reason",
                                ["reason"], registry=r)
        self.transfer_bytes = Counter("prefixgate_pd_transfer_bytes", "KV bytes moved by split requests",
                                      registry=r)
        self.transfer_bandwidth = Histogram(
            "prefixgate_pd_transfer_bandwidth_bytes_per_second", "Bandwidth of each split request's transfer",
            buckets=(1e6, 1e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 5e10), registry=r)


def _with_lookup_usage(out: RequestOutput, look: LookupResult, prefill_cached: int | None) -> RequestOutput:
    """A streamed output before the node's final usage, carrying the prompt the lookup counted (and
    the hit it saw, bounded by the prefill node's after a split): a stream that ends early (client
    gone, decode node lost) is billed the prompt that was prefilled, not 0."""
    cached = look.cached_tokens if prefill_cached is None else min(prefill_cached, look.cached_tokens)
    return dataclasses.replace(out, prompt_tokens=look.prompt_tokens, cached_tokens=cached)


def reachable_receiver(advertised: str, node_url: str) -> str:
    """A receiver advertised on a wildcard host (a decode node bound to 0.0.0.0 or :: without
    ``--kv-advertise-host``) is reached at the host this gateway reaches the node at; any other
    address is passed on as the node gave it."""
    if receiver_host(advertised) not in WILDCARD_HOSTS:
        return advertised
    host = httpx.URL(node_url).host
    return with_receiver_host(advertised, host) if host else advertised


@dataclass
class _PrefillNode:
    url: str
    http: httpx.AsyncClient
    inflight: int = 0
    healthy: bool | None = None  # None: not probed yet
    last_error: str | None = None

    async def probe(self) -> bool:
        """``GET /health`` (what ``/health`` shows of it, and whether the split picks it)."""
        try:
            resp = await self.http.get("/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.healthy, self.last_error = False, repr(exc)
            return False
        self.healthy = resp.status_code == 200
        self.last_error = None if self.healthy else f"HTTP {resp.status_code}"
        return self.healthy

    def status(self) -> dict[str, object]:
        return {"url": self.url, "healthy": self.healthy, "inflight": self.inflight, "last_error": self.last_error}


class DisaggEngineClient(RemoteEngineClient):
    """An ``EngineClient`` for a decode node (the base class talks to it) fed by prefill nodes."""

    def __init__(self, decode_url: str, prefill_urls: Sequence[str], token: str | None, *,
                 policy: SplitPolicy, metrics: DisaggMetrics, timeout_s: float = 600.0) -> None:
        super().__init__(decode_url, token, timeout_s=timeout_s)
        if not prefill_urls:
            raise ValueError("a split route needs at least one prefill node")
        self.policy, self.metrics = policy, metrics
        self._prefills = [_PrefillNode(u.rstrip("/"), httpx.AsyncClient(base_url=u.rstrip("/"), headers=self._headers,
                                                                          timeout=self._timeout))
                          for u in prefill_urls]
        self.last_placement: tuple[Placement, str] | None = None

    async def _post(self, http: httpx.AsyncClient, path: str, body: dict) -> dict:
        try:
            resp = await http.post(path, json=body)
        except httpx.TransportError as exc:
            raise NodeUnavailableError(f"engine node {http.base_url} unreachable: {exc!r}") from exc
        if resp.status_code != 200:
            raise _error_from_response(resp.status_code, resp.content)
        return resp.json()

    async def lookup(self, request: GenerateRequest) -> LookupResult:
        d = await self._post(self._http, "/internal/v1/kv/lookup", request_to_wire(request))
        return LookupResult(**d)

    def _receiver_address(self, look: LookupResult) -> str:
        """Where the prefill node sends the blocks: the receiver the decode node named in this very
        lookup (never a cached one: a restarted node listens on a fresh KV port)."""
        if not look.receiver:
            raise NodeUnavailableError(f"decode node {self.base_url} has no KV receiver (serve --role decode)")
        return reachable_receiver(look.receiver, self.base_url)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        look = await self.lookup(request)  # raises the node's EngineError (prompt too long ...) as usual
        node = self._least_loaded_prefill()
        placement, reason = self.policy.decide(look, node.inflight)
        self.last_placement = (placement, reason)
        self.metrics.decisions.labels(placement.value, reason).inc()
        prefill_cached: int | None = None
        if placement is Placement.SPLIT:
            prefill_cached = await self._handoff(node, request, look)
        t_decode = time.perf_counter()
        first = True
        async for out in super().generate(request):
            if first and out.new_token_ids and prefill_cached is not None:
                self.metrics.ttft_part.labels("first_decode").observe(time.perf_counter() - t_decode)
            first = first and not out.new_token_ids
            if not out.finished:
                out = _with_lookup_usage(out, look, prefill_cached)
            elif prefill_cached is not None:
                out = dataclasses.replace(out, cached_tokens=min(prefill_cached, out.cached_tokens))
            yield out

    async def _handoff(self, node: _PrefillNode, request: GenerateRequest, look: LookupResult) -> int | None:
        """Prefill on ``node`` and move the blocks; the prefill node's cache hit, or None when the
        decode node must compute the prompt itself (then its own hit is what the tenant got)."""
        node.inflight += 1
        try:
            d = await self._post(node.http, "/internal/v1/kv/prefill",
                                 {"request": request_to_wire(request), "address": self._receiver_address(look),
                                  "skip_tokens": look.cached_tokens})
        except Exception as exc:  # noqa: BLE001 - any prefill failure means: recompute on the decode node
            reason = exc.code if isinstance(exc, EngineError) else type(exc).__name__
            self.metrics.failures.labels(reason).inc()
            return None
        finally:
            node.inflight -= 1
        transfer = d["transfer"]
        self.metrics.ttft_part.labels("prefill").observe(float(d["prefill_s"]))
        self.metrics.transfer_bytes.inc(int(transfer["bytes_sent"]))
        if transfer["status"] != "imported":
            self.metrics.failures.labels(f"transfer_{transfer['status']}").inc()
        self._observe_transfer(transfer)
        return int(d["cached_tokens"])

    def _observe_transfer(self, transfer: dict) -> None:
        """Time and bandwidth of a transfer that reached the receiver; a failed one (no connection,
        broken mid-way) would fill the low buckets with failures, and its TTFT part was recomputed."""
        if transfer["status"] == "failed":
            return
        seconds, sent = float(transfer["seconds"]), int(transfer["bytes_sent"])
        self.metrics.ttft_part.labels("transfer").observe(seconds)
        if seconds > 0 and sent > 0:
            self.metrics.transfer_bandwidth.observe(sent / seconds)

    def _least_loaded_prefill(self) -> _PrefillNode:
        """The least-loaded prefill node among those the last probe did not find down (all of
        them when every one is down: the attempt then counts as a failure and falls back)."""
        up = [p for p in self._prefills if p.healthy is not False] or self._prefills
        return min(up, key=lambda p: p.inflight)

    async def probe(self) -> bool:
        """The decode node's health (what routes requests here), and the prefill nodes' too."""
        ok, *_ = await asyncio.gather(super().probe(), *(p.probe() for p in self._prefills))
        return ok

    def prefill_status(self) -> list[dict[str, object]]:
        return [p.status() for p in self._prefills]

    async def aclose(self) -> None:
        for p in self._prefills:
            await p.http.aclose()
        await super().aclose()
