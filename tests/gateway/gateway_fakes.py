"""Test doubles for the gateway's unit tests: a fake engine and a fake tenancy (no mocks of HTTP).

FakeEngine behaves like a tiny engine: whitespace "tokens", a per-namespace prefix cache in whole
blocks of 4 tokens (so a repeated prompt reports cached tokens and another namespace does not),
deterministic output words, optional per-token delay, a record of aborts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import (
    EngineError,
    EngineOverloadedError,
    GenerateRequest,
    ModelCard,
    PromptTooLongError,
    RequestOutput,
)
from gateway.ports import AuthenticationError, QuotaExceededError

BLOCK = 4


def on_event_loop() -> bool:
    """Whether the calling thread runs an event loop (the gateway's own thread, not a worker)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def render(req: GenerateRequest) -> list[str]:
    if req.prompt_token_ids is not None:
        return [str(t) for t in req.prompt_token_ids]
    if req.prompt is not None:
        return req.prompt.split()
    text = json.dumps(req.tools or []) + " " + " ".join(
        f"<{m['role']}> {m.get('content') or ''}" for m in req.messages
    )
    return text.split()


class FakeEngine:
    def __init__(self, *, model_id: str = "tiny", max_model_len: int = 256, delay_s: float = 0.0,
                 overloaded: bool = False) -> None:
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.delay_s = delay_s
        self.overloaded = overloaded
        self.refusal: EngineError | None = None  # raised by generate() before it starts, when set
        self.cache: set[bytes] = set()
        self.vocab: dict[str, int] = {}
        self.aborted: list[str] = []
        self.requests: list[GenerateRequest] = []
        self.tokenized: list[GenerateRequest] = []  # what the gateway rendered through tokenize()
        self.active: set[str] = set()

    def _block_hashes(self, req: GenerateRequest, tokens: list[str]) -> list[bytes]:
        h = bytes(req.tenant.namespace)
        out = []
        for i in range(len(tokens) // BLOCK):
            h = hashlib.sha256(h + " ".join(tokens[i * BLOCK:(i + 1) * BLOCK]).encode()).digest()
            out.append(h)
        return out

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.overloaded:
            raise EngineOverloadedError("engine queue is full")
        if self.refusal is not None:
            raise self.refusal
        tokens = render(request)
        if len(tokens) + request.sampling.max_tokens > self.max_model_len:
            raise PromptTooLongError(f"prompt of {len(tokens)} tokens is too long")
        self.requests.append(request)
        hashes = self._block_hashes(request, tokens)
        cached = 0
        for h in hashes:
            if h not in self.cache:
                break
            cached += BLOCK
        self.cache.update(hashes)
        rid = request.request_id
        self.active.add(rid)
        start = time.perf_counter()
        n = request.sampling.max_tokens
        seed = request.sampling.seed or 0
        try:
            for i in range(n):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                else:
                    await asyncio.sleep(0)
                word = f" w{(i + seed) % 10}"
                last = i == n - 1
                yield RequestOutput(
                    rid, (i,), word, last, len(tokens), cached, i + 1,
                    finish_reason="length" if last else None, ttft_s=time.perf_counter() - start,
                )
        finally:
            self.active.discard(rid)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> bool:
        return True

    async def stats(self) -> dict[str, Any]:
        return {"cached_blocks": len(self.cache)}

    def models(self) -> list[ModelCard]:
        return [ModelCard(id=self.model_id, max_model_len=self.max_model_len)]

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return len(render(request))

    def tokenize(self, request: GenerateRequest) -> list[int]:
        """Word -> id from a growing vocabulary: ids of the same words stay equal, so caching is unchanged."""
        self.tokenized.append(request)
        return [int(t) if request.prompt_token_ids is not None else self.vocab.setdefault(t, len(self.vocab))
                for t in render(request)]


@dataclass(frozen=True)
class FakeCtx:
    tenant_id: str
    name: str
    key_id: str
    is_admin: bool = False
    share_scope: str = "tenant"
    canon_mode: str = "off"
    per_user_vars: tuple[str, ...] = ()
    namespace: bytes = b""
    tenant_key: bytes = b""  # TenantScope.tenant_key: one per tenant, never its namespace
    metrics_label: str = ""
    cipher: Any = None
    priority: int = 0
    kv_block_quota: int | None = None
    ttft_target_s: float | None = None
    cache_retention_s: float | None = None


@dataclass
class FakePrice:
    cost_usd: float
    saved_usd: float
    priced_as: str = "fake"


@dataclass
class FakeTenancy:
    keys: dict[str, FakeCtx] = field(default_factory=dict)
    rows: list[Any] = field(default_factory=list)
    quota_error: QuotaExceededError | None = None
    admitted: list[int] = field(default_factory=list)

    def add(self, name: str, *, admin: bool = False, canon_mode: str = "off") -> str:
        key = f"sk-{name}"
        self.keys[key] = FakeCtx(tenant_id=f"t-{name}", name=name, key_id=f"k-{name}", is_admin=admin,
                                 canon_mode=canon_mode, namespace=hashlib.sha256(name.encode()).digest(),
                                 tenant_key=hashlib.sha256(b"tenant-key:" + name.encode()).digest(),
                                 metrics_label=name)
        return key

    def authenticate(self, api_key: str | None) -> FakeCtx:
        if api_key is None or api_key not in self.keys:
            raise AuthenticationError("Incorrect API key provided.")
        return self.keys[api_key]

    def scope_for(self, ctx: FakeCtx, user: str | None) -> FakeCtx:
        return ctx

    def admit(self, ctx: FakeCtx, *, estimated_tokens: int) -> None:
        if self.quota_error is not None:
            raise self.quota_error
        self.admitted.append(estimated_tokens)

    def price(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
              cache_creation_tokens: int = 0) -> FakePrice:
        return FakePrice(cost_usd=1e-6 * (prompt_tokens - cached_tokens + completion_tokens),
                         saved_usd=1e-6 * cached_tokens)

    def record_usage(self, record: Any) -> FakePrice:
        self.rows.append(record)
        return self.price(record.price_as or record.model, record.prompt_tokens, record.cached_tokens,
                          record.completion_tokens, record.cache_creation_tokens)

    def usage(self, ctx: FakeCtx, since: Any = None, *, tenant: str | None = None) -> dict:
        # rows carry no tenant names here, so an admin's ``tenant`` does not narrow the fake's count
        own = [r for r in self.rows if ctx.is_admin or r.tenant_id == ctx.tenant_id]
        return {"requests": len(own), "prompt_tokens": sum(r.prompt_tokens for r in own)}


class LoopbackServer:
    """A real uvicorn server for ``app`` on a free loopback port, in a background thread."""

    def __init__(self, app: Any, log_level: str = "warning") -> None:
        import socket
        import threading

        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level=log_level, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
