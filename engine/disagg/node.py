"""``DisaggEngine``: an ``EngineClient`` plus the two halves of a prefill/decode split.

    prefill node                                         decode node
    ------------                                         -----------
    prefill_and_send(req, "host:port")
      generate(req, max_tokens=1)   prompt computed,
                                    full blocks indexed
      engine thread: match + export_blocks  ─ staging ─► KVReceiver thread: check each chunk
      transport.send (worker thread) ── chunks ────────►   engine thread, between steps:
                                    ◄── ack ───────────     cache.import_chain (alloc, write, index)
    HandoffReport (cached, prefill_s, transfer)          the gateway's generate(req) there now hits
                                                         every transferred block

Everything that touches the cache manager or the model runner runs on the engine thread
(``AsyncEngine.call_in_engine_thread``); sockets run on their own threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.disagg.api import (
    DisaggConfig,
    HandoffReport,
    LookupResult,
    Role,
    TransferReport,
    TransferStatus,
    derive_transfer_key,
    with_receiver_host,
)
from engine.disagg.metrics import TransferMetrics
from engine.disagg.receiver import ImportOutcome, KVReceiver
from engine.disagg.shared_transport import landing_for
from engine.disagg.transport import CUDA_IPC, KVTransport, OutgoingTransfer, advertise, choose_transport
from engine.disagg.wire import Chunk, EngineLayout
from engine.kv_types import BlockHash, QueueReason
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.protocol import (
    AbortReport,
    GenerateRequest,
    InvalidRequestError,
    ModelCard,
    RequestOutput,
    StaticTenantScope,
    TenantScope,
)
from engine.request import Request


def engine_layout(engine: LLMEngine, runner: ModelRunner) -> EngineLayout:
    return EngineLayout(model=engine.config.resolved_model_id, dtype=str(runner.kv_dtype).removeprefix("torch."),
                        block_size=runner.block_size, num_layers=runner.spec.num_layers,
                        block_bytes=runner.kv_bytes_per_block)


@dataclasses.dataclass(frozen=True)
class ExportedPrefix:
    prefix: tuple[BlockHash, ...]  # blocks the receiver holds already: named, not sent
    hashes: tuple[BlockHash, ...]
    tokens: tuple[tuple[int, ...], ...]
    staging: torch.Tensor  # uint8 [n, block_bytes], contiguous, CPU (or the runner's device)


def export_prefix(engine: LLMEngine, runner: ModelRunner, req: Request, skip_blocks: int = 0,
                  on_device: bool = False) -> ExportedPrefix:
    """Engine thread: the prepared request's prompt blocks resident in HBM now, less the first
    ``skip_blocks`` (the receiver holds them), gathered into one staging buffer (a copy: the
    blocks may be reused by the next step): in host memory, or ``on_device`` for CUDA IPC."""
    match = engine.cache.match(req)
    n, bs = match.num_blocks, runner.block_size
    skip = min(max(0, skip_blocks), n)
    ids = req.prompt_token_ids
    tokens = tuple(tuple(ids[i * bs : (i + 1) * bs]) for i in range(skip, n))
    # staging: [n - skip, kv_bytes_per_block] = per block [layers, 2, block_size, kv_heads, head_dim] (+ int8 scales)
    export = runner.export_blocks_device if on_device else runner.export_blocks
    return ExportedPrefix(match.block_hashes[:skip], match.block_hashes[skip:], tokens,
                          export(match.block_ids[skip:]))


def import_scope(chunk: Chunk) -> StaticTenantScope:
    """Who an import is for: the chunk's tenant key, as the decode node's own node calls for that
    tenant carry it (``prefixgate_tenant``), so imported blocks are held and charged as theirs. No
    quota: node calls carry none, so refusing an import would only make this node compute and hold
    the same blocks; it is refused only when out of blocks. ``remote`` as the label, as on every
    node call."""
    return StaticTenantScope(namespace=chunk.namespace, tenant_key=chunk.tenant_key, metrics_label="remote",
                             cipher=None)


def import_chunk(engine: LLMEngine, runner: ModelRunner, chunk: Chunk, chain: tuple[BlockHash, ...]) -> ImportOutcome:
    """Engine thread: index a verified chunk's blocks under their hashes (the tenant's own chain)."""
    tenant = import_scope(chunk)
    bb = runner.kv_bytes_per_block
    if isinstance(chunk.payload, torch.Tensor):  # landed from a shared buffer, on this engine's device
        data: torch.Tensor | None = chunk.payload.view(chunk.num_blocks, bb)
    else:
        data = torch.frombuffer(chunk.payload, dtype=torch.uint8).view(chunk.num_blocks, bb) if chunk.payload else None

    def write(block_ids: list[int], first: int) -> None:
        assert data is not None
        lo = first - chunk.first_block
        runner.import_blocks(block_ids, data[lo : lo + len(block_ids)])

    result = engine.cache.import_chain(tenant, chain, chunk.first_block, write)
    resident = max(0, engine.cache.resident_prefix(chain) - chunk.first_block)
    if isinstance(result, QueueReason):
        return ImportOutcome(resident, 0, result.value)
    return ImportOutcome(resident, result)


class DisaggEngine:
    """``EngineClient`` (delegating to an ``AsyncEngine``) + ``engine.disagg.api.KVHandoff``."""

    def __init__(self, inner: AsyncEngine, runner: ModelRunner, config: DisaggConfig, metrics: TransferMetrics) -> None:
        self.inner, self.runner, self.config, self.metrics = inner, runner, config, metrics
        self.role = config.role
        self.layout = engine_layout(inner.engine, runner)
        self._key = derive_transfer_key(config.node_token) if config.node_token else b""
        self._counts: dict[str, int] = {}
        self.receiver: KVReceiver | None = None
        if self.role is Role.DECODE:
            self.receiver = KVReceiver(config.kv_host, config.kv_port, self._key, self.layout, self._import, metrics,
                                       landing=landing_for(self._key, str(runner.device)))

    # ------------------------------------------------------------------ EngineClient

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        return self.inner.generate(request)

    async def abort(self, request_id: str) -> AbortReport | None:
        return await self.inner.abort(request_id)

    async def health(self) -> bool:
        return await self.inner.health()

    async def stats(self) -> dict[str, Any]:
        out = await self.inner.stats()
        out["disagg"] = {"role": self.role.value, "kv_receiver": self.receiver_address(), **self._counts}
        return out

    def models(self) -> list[ModelCard]:
        return self.inner.models()

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return self.inner.count_prompt_tokens(request)

    def tokenize(self, request: GenerateRequest) -> list[int]:
        # the node's own gateway tokenizes a chat request here before it reaches generate
        return self.inner.tokenize(request)

    # the node's own API answers /detokenize, echo of a token-id prompt and /v1/cache as any engine's does
    def decode_prompt(self, token_ids: Sequence[int]) -> str:
        return self.inner.decode_prompt(token_ids)

    def cache_usage(self, tenant: TenantScope) -> dict[str, int]:
        return self.inner.cache_usage(tenant)

    def tenant_blocks(self, tenant: TenantScope) -> dict[str, int]:
        return self.inner.tenant_blocks(tenant)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.inner.shutdown(timeout)

    # ------------------------------------------------------------------ KVHandoff

    def receiver_address(self) -> str | None:
        """host:port (the host: ``kv_advertise_host`` when set, else the bound one), advertising
        CUDA IPC from this host when this engine is on a GPU (a prefill engine on the same host
        then sends device to device; any other sender ignores it)."""
        if self.receiver is None:
            return None
        on_gpu = str(self.runner.device).startswith("cuda")
        address = self.receiver.address
        if self.config.kv_advertise_host:
            address = with_receiver_host(address, self.config.kv_advertise_host)
        return advertise(address, (CUDA_IPC,) if on_gpu else ())

    async def lookup(self, request: GenerateRequest) -> LookupResult:
        req = await self._prepare(request)

        receiver = self.receiver_address() or ""

        def match(engine: LLMEngine) -> LookupResult:
            m = engine.cache.match(req)
            return LookupResult(req.num_prompt_tokens, m.cached_tokens, len(engine.scheduler.running),
                                engine.scheduler.num_waiting, receiver)

        return await asyncio.wrap_future(self.inner.call_in_engine_thread(match))

    async def prefill_and_send(self, request: GenerateRequest, address: str, skip_tokens: int = 0) -> HandoffReport:
        if self.role is not Role.PREFILL:
            raise InvalidRequestError(f"this engine's role is {self.role.value}; only a prefill engine sends KV")
        t0 = time.perf_counter()
        one = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, max_tokens=1, stop=(),
                                                                                 prompt_logprobs=None))
        last: RequestOutput | None = None
        async for out in self.inner.generate(one):
            last = out
        prefill_s = time.perf_counter() - t0
        assert last is not None
        if last.finish_reason == "error":
            raise InvalidRequestError(f"prefill failed: {last.error}")
        self.metrics.prefill_seconds.observe(prefill_s)
        req = await self._prepare(request)
        transport = choose_transport(address, self._key, self.layout, device=str(self.runner.device),
                                     blocks_per_chunk=self.config.blocks_per_chunk)
        on_device = transport.staging_device != "cpu"
        exported = await asyncio.wrap_future(
            self.inner.call_in_engine_thread(
                lambda e: export_prefix(e, self.runner, req, skip_tokens // self.runner.block_size, on_device)))
        report = await asyncio.to_thread(self._send, request, exported, transport)
        self.metrics.observe_sent(report)
        if report.status is not TransferStatus.IMPORTED:
            self.metrics.failures.labels("send", report.status.value).inc()
        self._count(f"sent_{report.status.value}")
        return HandoffReport(last.prompt_tokens, last.cached_tokens, prefill_s, report)

    async def _prepare(self, request: GenerateRequest) -> Request:
        """Tokenize off the engine thread, in the request's tenant's prepare lane, and await a
        grammar's compile on the event loop (``AsyncEngine.prepare``). Done in the event loop's
        default executor, the threads every tenant's lookups and KV sends share, one tenant's
        long renders or slow schemas held them all."""
        return await self.inner.prepare(request)

    def _send(self, request: GenerateRequest, exported: ExportedPrefix, transport: KVTransport) -> TransferReport:
        if not exported.hashes:
            return TransferReport(TransferStatus.IMPORTED, reason="no full block to send")
        # .data is memoryview(array): numpy's stubs give ndarray the buffer protocol for Python 3.12+ only
        staging: memoryview | torch.Tensor = (exported.staging.numpy().data.cast("B")
                                              if transport.staging_device == "cpu" else exported.staging)
        return transport.send(OutgoingTransfer(request.request_id, bytes(request.tenant.namespace),
                                               exported.hashes, exported.tokens, staging, exported.prefix,
                                               bytes(request.tenant.tenant_key)))

    async def check_integrity(self) -> str:
        """"" if the cache manager's invariants hold (no leaked or double-held block), else why not."""
        def check(engine: LLMEngine) -> str:
            try:
                engine.check_integrity()
            except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a probe
                return f"{type(exc).__name__}: {exc}"
            return ""

        return await asyncio.wrap_future(self.inner.call_in_engine_thread(check))

    # ------------------------------------------------------------------ receiver side

    def _import(self, chunk: Chunk, chain: tuple[BlockHash, ...]) -> Future[ImportOutcome]:
        self._count("chunks_received")
        return self.inner.call_in_engine_thread(lambda e: import_chunk(e, self.runner, chunk, chain))

    def _count(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1


def build_disagg_engine(config: EngineConfig, disagg: DisaggConfig,
                        registry: CollectorRegistry | None = None) -> DisaggEngine:
    """Load the model and start the engine thread (and, for a decode role, the KV receiver)."""
    from engine.launch import build_llm_engine_for
    from engine.metrics import EngineMetrics

    runner = ModelRunner(config)
    metrics = EngineMetrics(registry, model=config.resolved_model_id)
    llm = build_llm_engine_for(config, runner, metrics)
    return DisaggEngine(AsyncEngine(llm), runner, disagg, TransferMetrics(metrics.registry))
