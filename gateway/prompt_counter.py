"""Count prompt tokens off the event loop, with a per-tenant bound on the worker threads.

Tokenizing a long prompt takes long enough (seconds for megabytes of text) that doing it on the
event loop froze ``/health`` and every other tenant's stream (issue 16.2). Counting runs in a small
thread pool instead; each tenant may hold at most ``per_tenant`` of its ``workers`` at a time, so
one tenant sending many large prompts queues behind itself, not in front of everyone else::

    request ─► tenant semaphore (per_tenant) ─► shared limiter (workers) ─► thread: tokenize
               (waits here without holding a                               (bounded by the
                worker while its tenant is busy)                            ingress char limit)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio

from engine.protocol import EngineClient, GenerateRequest


class PromptCounter:
    def __init__(self, *, workers: int = 2, per_tenant: int = 1) -> None:
        if not 1 <= per_tenant <= workers:
            raise ValueError("need 1 <= per_tenant <= workers")
        self._limiter = anyio.CapacityLimiter(workers)
        self._per_tenant = per_tenant
        # One semaphore per authenticated tenant id: as many entries as tenants, never per request.
        self._tenants: dict[str, asyncio.Semaphore] = {}

    async def count(self, tenant_id: str, engine: EngineClient, requests: Sequence[GenerateRequest]) -> list[int]:
        """Prompt tokens of each request, through ``engine.count_prompt_tokens`` in a worker thread."""
        gate = self._tenants.setdefault(tenant_id, asyncio.Semaphore(self._per_tenant))
        async with gate:
            return await anyio.to_thread.run_sync(_count_all, engine, list(requests), limiter=self._limiter)


def _count_all(engine: EngineClient, requests: list[GenerateRequest]) -> list[int]:
    return [engine.count_prompt_tokens(r) for r in requests]
